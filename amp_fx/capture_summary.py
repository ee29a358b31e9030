"""What the torch.export front end did for a converted model: graphs, capture time, islands.

Example::

    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(nn.Linear(4, 2), preset("O2", torch.bfloat16, "cpu"))
    >>> _ = model(torch.randn(3, 4))
    >>> capture_summary(model).graphs, capture_summary(model).parameter_coverage
    (1, 1.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.captured_model import capture_states, captured_model  # noqa: F401  (captured_model: doctests)

__all__ = ["CaptureSummary", "capture_summary", "captured_graphs"]


@dataclasses.dataclass
class CaptureSummary:
    """What the torch.export front end did for a converted model so far.

    Attributes:
        graphs: graphs captured and rewritten (one per argument structure and size range).
        capture_seconds: seconds each capture took (export plus the passes), in order.
        parameter_coverage: share of the model's parameters (by element count) read by a rewritten
            graph in the calls so far; the rest ran in islands or were not reached.
        islands: qualified module name -> why it runs in an autocast island (the line that
            stopped torch.export, and what to do).
    """

    graphs: int = 0
    capture_seconds: list[float] = dataclasses.field(default_factory=list)
    parameter_coverage: float = 0.0
    islands: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [
            f"torch.export front end: {self.graphs} graph(s) captured in "
            f"{sum(self.capture_seconds):.2f} s; {self.parameter_coverage:.0%} of the parameters "
            "ran in rewritten graphs"
        ]
        lines += [f"  island {name or '<model>'}: {why}" for name, why in self.islands.items()]
        return "\n".join(lines)


def capture_summary(model: nn.Module) -> CaptureSummary:
    """What the torch.export front end did for ``model`` (a result of `amp_fx.convert`) so far.

    >>> capture_summary(nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    TypeError: capture_summary expects a model converted by amp_fx.convert's torch.export front end, ...
    """
    states = capture_states(model)
    if not states or states[0][0] != "":
        raise TypeError(
            "capture_summary expects a model converted by amp_fx.convert's torch.export front end, "
            f"got {type(model).__name__}"
        )
    summary = CaptureSummary()
    covered: set[int] = set()
    for name, state in states:
        summary.graphs += len(state.graphs)
        summary.capture_seconds += state.seconds
        for reason in dict.fromkeys(state.islands.values()):
            summary.islands[name] = reason
        for graph in state.graphs:
            for node in graph.graph.nodes:
                if node.op == "get_attr":
                    value = _attribute(graph, node.target)
                    if isinstance(value, nn.Parameter):
                        covered.add(id(value))
    parameters = {id(p): p.numel() for p in model.parameters()}
    total = sum(parameters.values())
    summary.parameter_coverage = (
        sum(parameters[key] for key in covered if key in parameters) / total if total else 1.0
    )
    return summary


def captured_graphs(model: nn.Module) -> list[torch.fx.GraphModule]:
    """The rewritten graphs ``model`` (a result of the torch.export front end) has captured so far,
    its children's included, in capture order; each can be printed or given to `amp_fx.report`.

    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(nn.Linear(4, 2), preset("O1", torch.bfloat16, "cpu"))
    >>> _ = model(torch.randn(3, 4))
    >>> [type(g).__name__ for g in captured_graphs(model)]
    ['Linear']
    """
    capture_summary(model)  # the same TypeError for a model of the other front end
    return [graph for _, state in capture_states(model) for graph in state.graphs]


def _attribute(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
