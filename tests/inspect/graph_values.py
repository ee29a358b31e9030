"""The values a converted graph computes, node by node, for the range tests to compare the recorded
statistics with: in the graph's own dtypes (`values_in_graph_dtypes`), and in float64 (`values_in_float64`,
the same graph's ops with every floating value, parameter and input in float64 and amp_fx's casts
left out) for the overflow tests' reference.

Each returns, per node name, the node's value and the gradient flowing back to it (None where none
flows) after a backward of ``sum(outputs * loss_scale)`` taken over the graph's floating tensor
outputs, and the order the gradients were completed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import Tensor

from amp_fx.core.node_info import node_info
from amp_fx.inspect.ranges import is_range_record
from amp_fx.ops.casts import cast_if_floating

__all__ = ["GraphValues", "values_in_float64", "values_in_graph_dtypes", "python_statistics"]


@dataclass
class GraphValues:
    values: dict[str, Tensor] = field(default_factory=dict)
    grads: dict[str, Tensor] = field(default_factory=dict)
    # Node names in the order their gradients were complete (autograd's execution order).
    grad_order: list[str] = field(default_factory=list)
    outputs: Any = None


class _Recording(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, found: GraphValues, float64: bool) -> None:
        super().__init__(gm)
        self.found, self.float64 = found, float64

    def run_node(self, n: torch.fx.Node) -> Any:
        if is_range_record(n):
            return self.env[n.args[0]] if n.meta["amp_fx_range_record"] >= 0 else None
        out = super().run_node(n)
        if isinstance(out, Tensor) and out.is_floating_point() and n.op not in ("get_attr", "output"):
            self.found.values[n.name] = out
            if out.requires_grad:
                out.register_hook(lambda grad, name=n.name: self._got(name, grad))
        return out

    def _got(self, name: str, grad: Tensor) -> None:
        self.found.grads[name] = grad
        self.found.grad_order.append(name)

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().placeholder(target, args, kwargs)
        return _double(value) if self.float64 else value

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        return _double(value) if self.float64 else value

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.float64 and target is cast_if_floating:
            return args[0]
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if self.float64 and target in ("to", "half", "bfloat16", "float", "type"):
            return args[0]
        return super().call_method(target, args, kwargs)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        if not self.float64:
            return module(*args, **kwargs)
        tensors = {
            name: _double(tensor) for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        }
        return torch.func.functional_call(module, tensors, args, kwargs)


def _double(value: Any) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.detach().double().requires_grad_(value.requires_grad)
    return value


def _run(gm: torch.fx.GraphModule, args: tuple[Any, ...], loss_scale: float, float64: bool) -> GraphValues:
    found = GraphValues()
    params = [p for p in gm.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    outputs = _Recording(gm, found, float64).run(*args)
    found.outputs = outputs
    floating = [t for t in pytree.tree_leaves(outputs) if isinstance(t, Tensor) and t.requires_grad]
    if floating:
        total = sum((t.double() * loss_scale).sum() for t in floating)
        total.backward()
    for p, grad in zip(params, saved, strict=True):
        p.grad = grad  # the rerun leaves the model's gradients as they were
    return found


def values_in_graph_dtypes(gm: torch.fx.GraphModule, *args: Any, loss_scale: float = 1.0) -> GraphValues:
    """Every node's value and gradient as the graph computes them (amp_fx's recording calls left
    out: they return their input)."""
    return _run(gm, args, loss_scale, float64=False)


def values_in_float64(gm: torch.fx.GraphModule, *args: Any, loss_scale: float = 1.0) -> GraphValues:
    """The same graph's ops in float64: inputs, parameters and every value float64, casts left out."""
    return _run(gm, args, loss_scale, float64=True)


def python_statistics(value: Tensor, dtype: torch.dtype) -> tuple[float, int, int, int]:
    """(largest non-NaN magnitude, underflowing, inf/NaN, all) of ``value`` counted in Python,
    against ``dtype``'s smallest normal."""
    tiny = torch.finfo(dtype).tiny
    magnitudes = [abs(v) for v in value.detach().double().flatten().tolist()]
    largest = max((v for v in magnitudes if not math.isnan(v)), default=0.0)
    underflow = sum(1 for v in magnitudes if 0 < v < tiny)
    nonfinite = sum(1 for v in magnitudes if not math.isfinite(v))
    return largest, underflow, nonfinite, len(magnitudes)


def low_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the graph's call nodes whose value the graph computes in fp16/bf16 (its info)."""
    return [
        n.name
        for n in gm.graph.nodes
        if n.op.startswith("call") and node_info(n).out_dtype in (torch.float16, torch.bfloat16)
    ]
