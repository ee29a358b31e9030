"""Activations in plain torch: the family's contract (``amp_fx.kernels.activations``, which has
the math) computed with torch's own activations and their backward ops in fp32, on any device;
the definition the Triton kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from amp_fx.kernels.activations.arguments import check_activation_arguments
from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.kernels.range_stats.reference import record_outputs_

__all__ = [
    "activation_backward",
    "activation_forward",
    "gated_activation_backward",
    "gated_activation_forward",
]


def _act(x: Tensor, activation: str) -> Tensor:
    """act(x) of fp32 ``x`` with torch's implementation."""
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def _act_backward(grad: Tensor, x: Tensor, activation: str) -> Tensor:
    """grad * act'(x), fp32, with torch's backward ops."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh" if activation == "gelu_tanh" else "none")


def gated_activation_forward(
    gate: Tensor, up: Tensor, activation: str, record: KernelRecord | None = None
) -> Tensor:
    """``act(gate) * up`` in fp32, rounded once to the inputs' dtype: the contract of
    ``amp_fx.kernels.activations`` (with ``record``, its range statistics recorded).

    Example:
        >>> gate = torch.tensor([[-1.0, 0.0, 2.0]], dtype=torch.bfloat16)
        >>> gated_activation_forward(gate, torch.full_like(gate, 2.0), "silu")
        tensor([[-0.5391,  0.0000,  3.5156]], dtype=torch.bfloat16)
    """
    check_activation_arguments(activation, gate=gate, up=up)
    # fp32 * up promotes: the product reads up's values as the fp32 copy would hold them.
    out = (_act(gate.float(), activation) * up).to(gate.dtype).contiguous()
    record_outputs_(record, [out])
    return out


def gated_activation_backward(
    grad_out: Tensor, gate: Tensor, up: Tensor, activation: str
) -> tuple[Tensor, Tensor]:
    """Gradients of `gated_activation_forward` w.r.t. (gate, up), recomputed from the inputs in
    fp32 and rounded once each.

    Example:
        >>> gate = torch.tensor([[-1.0, 0.0, 2.0]], dtype=torch.float16)
        >>> grad_gate, grad_up = gated_activation_backward(torch.ones_like(gate), gate, gate, "gelu")
        >>> grad_up
        tensor([[-0.1587,  0.0000,  1.9541]], dtype=torch.float16)
    """
    check_activation_arguments(activation, grad_out=grad_out, gate=gate, up=up)
    dy, g = grad_out.float(), gate.float()
    grad_gate = _act_backward(dy * up, g, activation)  # fp32 * up promotes, as above
    grad_up = dy * _act(g, activation)
    return grad_gate.to(gate.dtype).contiguous(), grad_up.to(up.dtype).contiguous()


def activation_forward(input: Tensor, activation: str, record: KernelRecord | None = None) -> Tensor:
    """``act(input)`` in fp32, rounded once to the input's dtype (with ``record``, its range
    statistics recorded).

    Example:
        >>> activation_forward(torch.tensor([[-1.0, 3.0]], dtype=torch.bfloat16), "gelu_tanh")
        tensor([[-0.1592,  3.0000]], dtype=torch.bfloat16)
    """
    check_activation_arguments(activation, input=input)
    out = _act(input.float(), activation).to(input.dtype).contiguous()
    record_outputs_(record, [out])
    return out


def activation_backward(grad_out: Tensor, input: Tensor, activation: str) -> Tensor:
    """Gradient of `activation_forward` w.r.t. its input, in fp32, rounded once.

    Example:
        >>> x = torch.tensor([[-1.0, 3.0]], dtype=torch.bfloat16)
        >>> activation_backward(torch.ones_like(x), x, "gelu_tanh")
        tensor([[-0.0830,  1.0078]], dtype=torch.bfloat16)
    """
    check_activation_arguments(activation, grad_out=grad_out, input=input)
    grad = _act_backward(grad_out.float(), input.float(), activation)
    return grad.to(input.dtype).contiguous()
