"""2-D max pooling in plain torch: the family's contract (``amp_fx.kernels.max_pool``, which has
the math) computed with torch ops, on any device; the definition the Triton kernels are tested
against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.max_pool.arguments import (
    check_channels_last,
    check_max_pool2d_arguments,
    check_max_pool2d_backward_arguments,
    max_pool2d_output_size,
)

__all__ = ["max_pool2d_backward", "max_pool2d_forward"]


def max_pool2d_forward(
    input: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    *,
    validate: bool = True,
) -> tuple[Tensor, Tensor]:
    """2-D max pooling of a channels_last ``input`` (N, C, H, W): ``(out, offsets)``, the contract
    of ``amp_fx.kernels.max_pool``.

    Example:
        >>> x = torch.tensor([[[[1.0, 3.0], [3.0, float("nan")]]]]).to(memory_format=torch.channels_last)
        >>> out, offsets = max_pool2d_forward(x, (2, 2), (2, 2), (0, 0), (1, 1), False)
        >>> out.flatten().tolist(), offsets.flatten().tolist()
        ([nan], [3])
    """
    if validate:
        check_channels_last("input", input)
        check_max_pool2d_arguments(
            input.shape, input.dtype, kernel_size, stride, padding, dilation, ceil_mode
        )
    out_h, out_w = (
        max_pool2d_output_size(
            input.shape[2 + i], kernel_size[i], stride[i], padding[i], dilation[i], ceil_mode
        )
        for i in range(2)
    )
    (kernel_h, kernel_w), (stride_h, stride_w) = kernel_size, stride
    (pad_h, pad_w), (dilation_h, dilation_w) = padding, dilation
    height, width = input.shape[2:]
    device = input.device
    oh = torch.arange(out_h, device=device)
    ow = torch.arange(out_w, device=device)
    best = input.new_full((*input.shape[:2], out_h, out_w), float("-inf"))
    best_tap = torch.full(best.shape, -1, dtype=torch.int64, device=device)
    for kh in range(kernel_h):
        ih = oh * stride_h - pad_h + kh * dilation_h
        valid_h = (ih >= 0) & (ih < height)
        for kw in range(kernel_w):
            iw = ow * stride_w - pad_w + kw * dilation_w
            valid_w = (iw >= 0) & (iw < width)
            # Out-of-range taps read row/column 0 and are masked out: never an out-of-bounds index.
            rows = input.index_select(2, torch.where(valid_h, ih, 0))
            value = rows.index_select(3, torch.where(valid_w, iw, 0))
            valid = valid_h[:, None] & valid_w[None, :]
            take = valid & ((value > best) | torch.isnan(value) | (best_tap < 0))
            best = torch.where(take, value, best)
            best_tap = torch.where(take, kh * kernel_w + kw, best_tap)
    out = best.contiguous(memory_format=torch.channels_last)
    offsets = best_tap.to(torch.uint8).contiguous(memory_format=torch.channels_last)
    return out, offsets


def max_pool2d_backward(
    grad_out: Tensor,
    offsets: Tensor,
    input_size: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    *,
    validate: bool = True,
) -> Tensor:
    """Gradient of `max_pool2d_forward` w.r.t. its input (of size ``input_size``), from ``grad_out``
    (any strides) and the forward's ``offsets``: the contract of ``amp_fx.kernels.max_pool``.

    Example:
        >>> x = torch.tensor([[[[1.0, 3.0, 2.0]]]]).to(memory_format=torch.channels_last)
        >>> _, offsets = max_pool2d_forward(x, (1, 2), (1, 1), (0, 0), (1, 1), False)
        >>> max_pool2d_backward(torch.ones(1, 1, 1, 2), offsets, x.shape, (1, 2), (1, 1), (0, 0), (1, 1))
        tensor([[[[0., 2., 0.]]]])
    """
    if validate:
        check_max_pool2d_backward_arguments(
            grad_out, offsets, input_size, kernel_size, stride, padding, dilation
        )
    (kernel_h, kernel_w), (stride_h, stride_w) = kernel_size, stride
    (pad_h, pad_w), (dilation_h, dilation_w) = padding, dilation
    height, width = input_size[2:]
    out_h, out_w = offsets.shape[2:]
    grad = torch.zeros(tuple(input_size), dtype=torch.float32, device=grad_out.device)
    grad_of_out = grad_out.float()
    # Taps in reverse: for one input element, windows further down/right reach it through smaller
    # taps, so this adds each element's windows in (oh, ow) order, as the Triton kernel does.
    for kh in reversed(range(kernel_h)):
        first_h, last_h = _windows_in_range(out_h, height, stride_h, kh * dilation_h - pad_h)
        for kw in reversed(range(kernel_w)):
            first_w, last_w = _windows_in_range(out_w, width, stride_w, kw * dilation_w - pad_w)
            if first_h > last_h or first_w > last_w:
                continue
            windows = (slice(None), slice(None), slice(first_h, last_h + 1), slice(first_w, last_w + 1))
            # One tap of distinct windows reaches distinct input elements: a strided slice of them.
            start_h = first_h * stride_h + kh * dilation_h - pad_h
            start_w = first_w * stride_w + kw * dilation_w - pad_w
            reached = (
                slice(None),
                slice(None),
                slice(start_h, start_h + (last_h - first_h) * stride_h + 1, stride_h),
                slice(start_w, start_w + (last_w - first_w) * stride_w + 1, stride_w),
            )
            won = offsets[windows] == kh * kernel_w + kw
            grad[reached] += torch.where(won, grad_of_out[windows], 0.0)
    return grad.to(grad_out.dtype).contiguous(memory_format=torch.channels_last)


def _windows_in_range(num_windows: int, size: int, stride: int, shift: int) -> tuple[int, int]:
    """First and last window index o in [0, num_windows) whose tap at ``o * stride + shift`` lies in
    [0, size) (first > last when none does)."""
    first = max(0, -(shift // stride)) if shift < 0 else 0
    last = min(num_windows - 1, (size - 1 - shift) // stride)
    return first, last
