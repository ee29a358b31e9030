"""torch.compile with a backend that keeps the graphs Dynamo traced, to read what a call became."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compile_keeping_graphs(function: Callable) -> tuple[Callable, list[torch.fx.GraphModule]]:
    """``function`` compiled with ``fullgraph=True`` (a graph break raises), and the list its traced
    graphs are appended to, run as traced (no Inductor)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(graph_module)
        return graph_module.forward

    return torch.compile(function, backend=backend, fullgraph=True), graphs


def calls_amp_fx_ops(graph_module: torch.fx.GraphModule) -> bool:
    """Whether a traced graph calls any of amp_fx's custom ops or fused functions."""
    return any("amp_fx" in str(node.target) for node in graph_module.graph.nodes)
