"""2-D max pooling with 1-byte argmax offsets: `max_pool2d`.

torch's ``F.max_pool2d`` saves an int64 index per output element for its backward (8 bytes, four
times an fp16 output) and its channels_last backward scatters into a zeroed gradient. At O2 a
ResNet's stem max-pool runs on fp16 channels_last activations; `max_pool2d` computes the same
values and gradients with ``amp_fx.kernels.max_pool``'s Triton kernels: the forward writes the
output and a uint8 tap offset per element, the backward gathers each input element's gradient
(summed in fp32, rounded once) and writes it once. Nothing else is saved for the backward: not
the input, not the output.

Eager calls go through a ``torch.autograd.Function`` that calls the kernel functions directly
(``amp_fx.kernels.implementation_for``: the Triton kernels on CUDA tensors, the pure-torch
reference elsewhere): one metadata check, one autograd node and one kernel launch each way.

The same kernels are also wrapped as the custom ops ``amp_fx::max_pool2d_forward`` (input,
kernel_size, stride, padding, dilation, ceil_mode) -> (out, offsets) and
``amp_fx::max_pool2d_backward``, with fake implementations and autograd, for callers that trace
with functional or fake tensors (torch.export, make_fx, dispatch modes).

Under torch.compile `max_pool2d` is plain ``F.max_pool2d``: Inductor has its own max-pool
lowering (with small offsets, like this one) and fuses it with its neighbours. The custom ops in
the compiled graph instead made compiled O2 ResNet-50 slower on an H200 (36.3 against 35.6 ms per
step, 2026-11-30), although Inductor's max-pool backward alone takes 1.44 ms there against 0.33 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from amp_fx.kernels.arguments import KERNEL_DTYPES
from amp_fx.ops.dispatch import is_eager, is_traced_backward

__all__ = ["MIN_FUSED_ELEMENTS", "max_pool2d", "max_pool2d_forward", "max_pool2d_backward"]


# An eager fused call costs the host more than torch's max-pool (an autograd Function and a Triton
# launch each way), so on small inputs it is host-bound and slower. On an H200 (2026-11-30), forward
# + backward: ResNet-50's stem, 2**27.6 elements, 0.61 ms against torch's 2.78 ms; a 2**25.6-element
# 2x2 pool 0.50 against 0.40 ms and a 2**23.2-element 3x3 pool 0.56 against 0.33 ms. Smaller calls
# run torch's.
MIN_FUSED_ELEMENTS = 2**26

Pair = tuple[int, int]


@torch.library.custom_op("amp_fx::max_pool2d_forward", mutates_args=())
def max_pool2d_forward(
    input: Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> tuple[Tensor, Tensor]:
    """Max pooling of a channels_last 4-D ``input`` with (height, width) window pairs: ``(out,
    offsets)``, channels_last, out in input's dtype, offsets uint8 (``kh * KW + kw`` of each
    window's winning tap): the kernel contract of ``amp_fx.kernels.max_pool``."""
    # Imported on first use: importing amp_fx must not load Triton.
    from amp_fx.kernels import implementation_for

    return implementation_for([input]).max_pool2d_forward(
        input, kernel_size, stride, padding, dilation, ceil_mode
    )


@max_pool2d_forward.register_fake
def _max_pool2d_forward_fake(
    input: Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
) -> tuple[Tensor, Tensor]:
    from amp_fx.kernels.max_pool.arguments import max_pool2d_output_size

    out_size = [
        max_pool2d_output_size(
            input.shape[2 + i], kernel_size[i], stride[i], padding[i], dilation[i], ceil_mode
        )
        for i in range(2)
    ]
    shape = (*input.shape[:2], *out_size)
    out = input.new_empty(shape).contiguous(memory_format=torch.channels_last)
    offsets = input.new_empty(shape, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    return out, offsets


@torch.library.custom_op("amp_fx::max_pool2d_backward", mutates_args=())
def max_pool2d_backward(
    grad_out: Tensor,
    offsets: Tensor,
    input_size: list[int],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> Tensor:
    """Gradient of `max_pool2d_forward` w.r.t. its input (of size ``input_size``), in grad_out's
    dtype, channels_last."""
    from amp_fx.kernels import implementation_for

    return implementation_for([grad_out]).max_pool2d_backward(
        grad_out, offsets, input_size, kernel_size, stride, padding, dilation
    )


@max_pool2d_backward.register_fake
def _max_pool2d_backward_fake(
    grad_out: Tensor,
    offsets: Tensor,
    input_size: list[int],
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
) -> Tensor:
    return grad_out.new_empty(input_size).contiguous(memory_format=torch.channels_last)


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    input, kernel_size, stride, padding, dilation, _ceil_mode = inputs
    _, offsets = output
    ctx.save_for_backward(offsets)
    ctx.input_size = list(input.shape)
    ctx.window = (kernel_size, stride, padding, dilation)
    ctx.mark_non_differentiable(offsets)


def _backward(
    ctx, grad_out: Tensor, grad_offsets: Tensor | None
) -> tuple[Tensor | None, None, None, None, None, None]:
    (offsets,) = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    arguments = (grad_out, offsets, ctx.input_size, *ctx.window)
    # AOT autograd traces this backward with functional tensors: plain torch math there.
    if is_traced_backward(offsets):
        from amp_fx.kernels import reference

        grad_input = reference.max_pool2d_backward(*arguments)
    else:
        grad_input = max_pool2d_backward(*arguments)
    return grad_input, None, None, None, None, None


max_pool2d_forward.register_autograd(_backward, setup_context=_setup_context)


class _MaxPool2d(torch.autograd.Function):
    """The eager path: the kernel functions called directly, without the custom ops' dispatch
    (their schema handling costs the host more than the kernels cost the GPU). Saves only the
    uint8 offsets."""

    @staticmethod
    def forward(
        ctx,
        input: Tensor,
        kernel_size: Pair,
        stride: Pair,
        padding: Pair,
        dilation: Pair,
        ceil_mode: bool,
        kernels,
    ) -> Tensor:
        # _window_if_fused checked every argument.
        out, offsets = kernels.max_pool2d_forward(
            input, kernel_size, stride, padding, dilation, ceil_mode, validate=False
        )
        ctx.kernels = kernels
        ctx.input_size = tuple(input.shape)
        ctx.window = (kernel_size, stride, padding, dilation)
        ctx.save_for_backward(offsets)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None, None, None, None, None, None]:
        (offsets,) = ctx.saved_tensors
        grad_input = ctx.kernels.max_pool2d_backward(
            grad_out, offsets, ctx.input_size, *ctx.window, validate=False
        )
        return grad_input, None, None, None, None, None, None


def _pair(value: object) -> Pair | None:
    """F.max_pool2d's int-or-pair argument as a pair of ints, or None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (tuple, list)) and len(value) in (1, 2):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (value[0], value[-1])
    return None


def _window_if_fused(
    input: Tensor, kernel_size: object, stride: object, padding: object, dilation: object, ceil_mode: object
) -> tuple[Pair, Pair, Pair, Pair] | None:
    """The normalized window (kernel, stride, padding, dilation) when the kernels compute this call,
    else None. Reads dtypes, shapes, strides and Python values only (no host synchronization)."""
    if not (
        isinstance(input, Tensor)
        and input.dim() == 4
        and input.dtype in KERNEL_DTYPES
        and isinstance(ceil_mode, bool)
        and input.numel() >= max(MIN_FUSED_ELEMENTS, 1)
        # channels_last and not also contiguous: torch then gives a channels_last output too.
        and input.is_contiguous(memory_format=torch.channels_last)
        and not input.is_contiguous()
    ):
        return None
    # Only for a call that may fuse.
    from amp_fx.kernels.max_pool.arguments import (
        MAX_POOL_MAX_PIXELS,
        MAX_POOL_MAX_TAPS,
        max_pool2d_output_size,
    )

    batch, _, height, width = input.shape
    if batch * height * width > MAX_POOL_MAX_PIXELS:
        return None
    kernel = _pair(kernel_size)
    strides = (
        kernel if stride is None or (isinstance(stride, (tuple, list)) and not stride) else _pair(stride)
    )
    pads = _pair(padding)
    dilations = _pair(dilation)
    if kernel is None or strides is None or pads is None or dilations is None:
        return None
    if min(kernel) < 1 or min(strides) < 1 or min(pads) < 0 or min(dilations) < 1:
        return None
    if kernel[0] * kernel[1] > MAX_POOL_MAX_TAPS or pads[0] > kernel[0] // 2 or pads[1] > kernel[1] // 2:
        return None
    for i in range(2):
        if (
            max_pool2d_output_size(
                input.shape[2 + i], kernel[i], strides[i], pads[i], dilations[i], ceil_mode
            )
            < 1
        ):
            return None
    return kernel, strides, pads, dilations


def max_pool2d(
    input: Tensor,
    kernel_size: int | tuple[int, int],
    stride: int | tuple[int, int] | None = None,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    ceil_mode: bool = False,
) -> Tensor:
    """``F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode)``: same values,
    same gradients (each input element's gradient summed in fp32 and rounded once), same
    layout; the backward keeps 1 byte per output element instead of torch's 8-byte indices. A
    fused call's gradient is not differentiable again (double backward raises).

    Fused when ``input`` is a 4-D fp16/bf16/fp32 tensor contiguous in ``torch.channels_last``
    (and not also contiguous, as with one channel) with at least `MIN_FUSED_ELEMENTS` elements
    and at most 2**31 - 1 pixels (N * H * W), and the window has at most 256 taps. Any other
    call, and every call under torch.compile (where Inductor lowers max-pool itself), is
    ``F.max_pool2d`` with its results and errors.

    Example:
        >>> x = torch.randn(2, 8, 9, 9).to(memory_format=torch.channels_last)
        >>> y = max_pool2d(x, 3, stride=2, padding=1)
        >>> torch.equal(y, F.max_pool2d(x, 3, stride=2, padding=1))
        True
        >>> y.is_contiguous(memory_format=torch.channels_last)
        True
    """
    window = (
        None
        if torch.compiler.is_compiling()
        else _window_if_fused(input, kernel_size, stride, padding, dilation, ceil_mode)
    )
    if window is None:
        return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode)
    # Imported on first use: importing amp_fx must not load Triton.
    from amp_fx.kernels import implementation_for

    if is_eager(input):
        return _MaxPool2d.apply(input, *window, ceil_mode, implementation_for((input,)))
    out, _ = max_pool2d_forward(input, *(list(pair) for pair in window), ceil_mode)
    return out
