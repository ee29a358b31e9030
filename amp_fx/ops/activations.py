"""Activations computed in fp32 from fp16/bf16 values: `fp32_gated_activation` (``act(gate) *
up``, a gated MLP's middle) and `fp32_activation` (``act(x)`` alone).

At O2 these run as torch computes them: a Llama MLP's ``silu(gate) * up`` is two kernels (the
activation's output written and read back), and a GELU written out in torch ops (Hugging Face's
``gelu_new``, GPT-2's) is nine, with an fp32 island around its ``pow`` and casts on either side.
These functions compute the same math in fp32 from the low-precision inputs and round the result
once to their dtype (``amp_fx.kernels.activations``: one read of each input and one write each
way; the backward recomputes the activation from the inputs, which are all it saves).

The kernels (``amp_fx.kernels.implementation_for``: the Triton kernels on CUDA tensors; an eager
call on a CPU computes the torch expression instead, `amp_fx.kernels.kernels_run_for`) are the
custom ops ``amp_fx::gated_activation`` / ``amp_fx::activation`` and their backward ops, with fake
implementations and autograd, which tracers (torch.export, fake or functional tensors) see; eager
calls run them directly, without the custom ops' dispatch (`amp_fx.ops.dispatch.fused_op`). Under
torch.compile the functions are their torch expression, and a backward that torch.compile traces is
the reference's torch math, both for Inductor to fuse with its neighbours. Under `amp_fx.watch` the
forward kernel records the range statistics of the output it writes
(`amp_fx.ops.range_record.kernel_record`).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

# amp_fx.kernels loads Triton only when a CUDA tensor's kernels are asked for.
from amp_fx.kernels import implementation_for, reference
from amp_fx.kernels.activations import ACTIVATIONS
from amp_fx.kernels.arguments import KERNEL_DTYPES
from amp_fx.ops.dispatch import fused_op, gives_expression, is_traced_backward
from amp_fx.ops.outputs import reshaped_output
from amp_fx.ops.range_record import kernel_record, records_in_kernel

__all__ = [
    "ACTIVATIONS",
    "fp32_activation",
    "fp32_gated_activation",
    "fused_activation",
    "fused_activation_backward",
    "fused_gated_activation",
    "fused_gated_activation_backward",
]


def _rows(tensor: Tensor) -> Tensor:
    """The (rows, columns) view the kernels take: leading dimensions flattened (a copy only where
    they cannot be), a vector as one row."""
    return tensor.unsqueeze(0) if tensor.dim() == 1 else tensor.flatten(0, -2)


def _kernels(tensor: Tensor) -> ModuleType:
    return implementation_for([tensor])


# ---- the custom ops -----------------------------------------------------------------------------


@fused_op("amp_fx::gated_activation")
def fused_gated_activation(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """``act(gate) * up`` in fp32, rounded once: gate and up of one shape, dtype and device; the
    output contiguous, in their dtype (the kernel contract of ``amp_fx.kernels.activations``)."""
    record = kernel_record(gate.device, [(None, gate.dtype)])
    out = _kernels(gate).gated_activation_forward(_rows(gate), _rows(up), activation, record)
    return reshaped_output(out, gate.shape)


@fused_gated_activation.register_fake
def _gated_activation_fake(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    return gate.new_empty(gate.shape)


@fused_op("amp_fx::gated_activation_backward")
def fused_gated_activation_backward(
    grad_out: Tensor, gate: Tensor, up: Tensor, activation: str
) -> tuple[Tensor, Tensor]:
    """(grad_gate, grad_up) of `fused_gated_activation`, the activation recomputed from gate."""
    grad_gate, grad_up = _kernels(gate).gated_activation_backward(
        _rows(grad_out), _rows(gate), _rows(up), activation
    )
    return grad_gate.view(gate.shape), grad_up.view(gate.shape)


@fused_gated_activation_backward.register_fake
def _gated_activation_backward_fake(
    grad_out: Tensor, gate: Tensor, up: Tensor, activation: str
) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


@fused_op("amp_fx::activation")
def fused_activation(input: Tensor, activation: str) -> Tensor:
    """``act(input)`` in fp32, rounded once; contiguous, in the input's dtype."""
    record = kernel_record(input.device, [(None, input.dtype)])
    out = _kernels(input).activation_forward(_rows(input), activation, record)
    return reshaped_output(out, input.shape)


@fused_activation.register_fake
def _activation_fake(input: Tensor, activation: str) -> Tensor:
    return input.new_empty(input.shape)


@fused_op("amp_fx::activation_backward")
def fused_activation_backward(grad_out: Tensor, input: Tensor, activation: str) -> Tensor:
    """Gradient of `fused_activation` w.r.t. its input, the activation recomputed."""
    grad = _kernels(input).activation_backward(_rows(grad_out), _rows(input), activation)
    return grad.view(input.shape)


@fused_activation_backward.register_fake
def _activation_backward_fake(grad_out: Tensor, input: Tensor, activation: str) -> Tensor:
    return input.new_empty(input.shape)


def _traced_backward(grad_out: Tensor, input: Tensor, up: Tensor | None, name: str) -> tuple[Tensor, ...]:
    """The backward as the reference's torch math, for torch.compile to fuse with its neighbours."""
    rows = (_rows(grad_out), _rows(input))
    if up is None:
        return (reference.activation_backward(*rows, name).view(input.shape),)
    grad_input, grad_up = reference.gated_activation_backward(*rows, _rows(up), name)
    return grad_input.view(input.shape), grad_up.view(input.shape)


def _gated_setup_context(ctx, inputs: tuple[Tensor, Tensor, str], output: Tensor) -> None:
    gate, up, name = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation = name


@once_differentiable  # the recomputed activation is a constant of the backward
def _gated_backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    gate, up = ctx.saved_tensors
    if is_traced_backward(gate):
        grad_gate, grad_up = _traced_backward(grad_out, gate, up, ctx.activation)
    else:
        grad_gate, grad_up = fused_gated_activation_backward(grad_out, gate, up, ctx.activation)
    return grad_gate, grad_up, None


fused_gated_activation.register_autograd(_gated_backward, setup_context=_gated_setup_context)


def _setup_context(ctx, inputs: tuple[Tensor, str], output: Tensor) -> None:
    input, name = inputs
    ctx.save_for_backward(input)
    ctx.activation = name


@once_differentiable
def _backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None]:
    (input,) = ctx.saved_tensors
    if is_traced_backward(input):
        (grad_input,) = _traced_backward(grad_out, input, None, ctx.activation)
    else:
        grad_input = fused_activation_backward(grad_out, input, ctx.activation)
    return grad_input, None


fused_activation.register_autograd(_backward, setup_context=_setup_context)


# ---- what the converted graphs call -----------------------------------------------------------


def _check_activation(name: object) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not one of {', '.join(ACTIVATIONS)}; these fused activations "
            "compute those three only"
        )


def _torch_activation(x: Tensor, name: str) -> Tensor:
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


def _runs_fused(*tensors: Tensor) -> bool:
    """Whether the kernels compute this call: tensors of one shape, dtype and device, at least
    1-D. Reads metadata only, so torch.compile decides it while tracing."""
    first = tensors[0]
    if not isinstance(first, Tensor) or gives_expression(first):
        return False
    return all(
        isinstance(t, Tensor)
        and t.dim() >= 1
        and t.dtype in KERNEL_DTYPES
        and t.shape == first.shape
        and t.dtype == first.dtype
        and t.device == first.device
        for t in tensors
    )


def fp32_gated_activation(gate: Tensor, up: Tensor, activation: str = "silu") -> Tensor:
    """``act(gate) * up`` computed in fp32 and rounded once to the inputs' dtype, for ``activation``
    ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``: what ``(act(gate.float()) *
    up.float()).to(gate.dtype)`` gives, without the fp32 copies. The backward saves gate and up only.

    Fused when gate and up share one shape, dtype (fp16, bf16 or fp32) and device; any other call
    (broadcasting, mixed dtypes) returns that expression in the dtype the product promotes to.

    Example:
        >>> gate = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
        >>> up = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
        >>> out = fp32_gated_activation(gate, up, "silu")
        >>> out.dtype
        torch.bfloat16
        >>> torch.equal(out, (F.silu(gate.float()) * up.float()).to(torch.bfloat16))
        True
        >>> out.sum().backward(); gate.grad.dtype
        torch.bfloat16
    """
    _check_activation(activation)
    if not _runs_fused(gate, up):
        dtype = torch.promote_types(gate.dtype, up.dtype)
        return (_torch_activation(gate.float(), activation) * up.float()).to(dtype)
    return fused_gated_activation(gate, up, activation)


def fp32_activation(input: Tensor, activation: str = "gelu_tanh") -> Tensor:
    """``act(input)`` computed in fp32 and rounded once to the input's dtype, for ``activation``
    ``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` (Hugging Face's ``gelu_new``): what
    ``act(input.float()).to(input.dtype)`` gives. The backward saves the input only.

    Example:
        >>> x = torch.randn(4, 6, dtype=torch.float16, requires_grad=True)
        >>> y = fp32_activation(x, "gelu_tanh")
        >>> torch.equal(y, F.gelu(x.float(), approximate="tanh").half())
        True
    """
    _check_activation(activation)
    if not _runs_fused(input):
        return _torch_activation(input.float(), activation).to(input.dtype)
    return fused_activation(input, activation)


# A watched graph asks these functions' kernel to record the range statistics of what it writes.
records_in_kernel(fp32_activation, fp32_gated_activation)
