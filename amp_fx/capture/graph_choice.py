"""Whether a captured graph computes a call: its argument structure, constants, dtypes and sizes
(`amp_fx.capture.captured_model` chooses the graph a call runs with these).

>>> structure(nn.Linear(2, 2), flatten(((torch.ones(3, 2),), {})))[2]
((torch.float32, 2, 'cpu'),)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.capture.call_signature import accepts, call_signature
from amp_fx.capture.export import container_call
from amp_fx.capture.state import CaptureState
from amp_fx.core.containers import Spec, flatten
from amp_fx.core.node_info import TRAINING_MODE_KEY

__all__ = ["fits", "fits_containers", "structure", "traced_choice"]


def fits(
    graph: torch.fx.GraphModule,
    training: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    traced: bool = False,
) -> bool:
    """Whether ``graph`` computes this call: its `CallSignature` decides (plain Python, microseconds,
    and traceable by torch.compile); `accepts`, which reads the graph and checks sizes with sympy,
    only where there is none (container arguments), and never in ``traced`` code."""
    if graph.meta[TRAINING_MODE_KEY] != training or container_call(graph) is not None:
        return False
    signature = call_signature(graph)
    if signature is not None:
        return signature.matches(args, kwargs)
    return not traced and accepts(graph, args, kwargs)


def traced_choice(
    state: CaptureState, training: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.fx.GraphModule | None:
    # Under torch.compile, the graph for this call chosen in code Dynamo traces and guards on: a
    # graph break here would make the model's whole output, float32 logits included, tensors the
    # compiled code must materialise. None: the call needs `accepts` or a capture, which run
    # eagerly (`amp_fx.capture.captured_model`): a graph break, which Dynamo's code for that call keeps (so
    # the model is called once before it is compiled; docs/DESIGN.md).
    for graph in state.graphs:
        if fits(graph, training, args, kwargs, traced=True):
            return graph
    if any(container_call(graph) for graph in state.graphs):
        flat = flatten((args, kwargs))
        for graph in state.graphs:
            if fits_containers(graph, training, flat, traced=True):
                return graph
    return None


def structure(module: nn.Module, flat: tuple[list[torch.Tensor], Spec]) -> tuple[Any, ...]:
    """What a graph is captured for, sizes aside: the mode, the nesting with every non-tensor
    value and type (`amp_fx.core.containers`), and each tensor's dtype, rank and device type."""
    leaves, spec = flat
    described = tuple(
        (leaf.dtype, leaf.dim(), leaf.device.type) if isinstance(leaf, torch.Tensor) else int
        for leaf in leaves
    )
    return (module.training, spec, described)


def fits_containers(
    graph: torch.fx.GraphModule,
    training: bool,
    flat: tuple[list[torch.Tensor], Spec],
    *,
    traced: bool = False,
) -> bool:
    """`fits` for a graph captured with containers: the same nesting, and its tensors fit."""
    call = container_call(graph)
    if call is None or graph.meta[TRAINING_MODE_KEY] != training or call.arguments != flat[1]:
        return False
    leaves, signature = tuple(flat[0]), call_signature(graph)
    if signature is not None:
        return signature.matches(leaves, {})
    return not traced and accepts(graph, leaves, {})
