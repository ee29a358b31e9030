"""2-D max pooling of channels_last activations with 1-byte argmax offsets.

What: the family's contract, ``amp_fx.kernels.max_pool``, which has the math.

Why: torch's ``max_pool2d_with_indices`` keeps an int64 index per output element (8 bytes, four
times the fp16 output) and its channels_last backward scatters into a zeroed gradient. On an
H200, ResNet-50's stem max-pool ((256, 64, 112, 112) fp16, 3x3, stride 2, padding 1) took 0.84 ms
forward and 1.94 ms backward per step (0.6 and 0.3 TB/s of a ~4 TB/s copy); these kernels 0.28
and 0.33 ms (benchmarks/bench_max_pool.py). Here the forward
reads x once and writes out and 1-byte offsets; the backward reads grad_out and the offsets of the
at most ceil(((KH-1)*DH+1)/SH) x ceil(((KW-1)*DW+1)/SW) windows that reach each input element (4
for the stem, which read 2x2 neighbouring output pixels: mostly cache hits) and writes dx once,
with no zero-fill pass and no atomics.

How: a program owns a tile of BLOCK_PIXELS pixels (of the output forward, of the input backward)
by BLOCK_CHANNELS channels; channels are the contiguous dimension, so every load and store of a
pixel's channels is one coalesced segment. The window loops are unrolled (constexpr bounds).

Layout: x and the offsets are channels_last; grad_out may have any strides (an expanded gradient
is read in place). Outputs are allocated channels_last, as torch's max-pool allocates them for a
channels_last input. Pixel indices (n, h, w) are int32 (at most 2**31 pixels, checked); element
addresses are int64.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.devices import on_device
from amp_fx.kernels.max_pool.arguments import (
    check_channels_last,
    check_max_pool2d_arguments,
    check_max_pool2d_backward_arguments,
    check_triton_max_pool2d_pixels,
    max_pool2d_output_size,
)
from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.rounding import round_to_dtype

__all__ = ["max_pool2d_forward", "max_pool2d_backward", "MaxPoolLaunch", "LAUNCH"]


@dataclass(frozen=True)
class MaxPoolLaunch:
    """Elements per program (pixels x channels), widest channel block and warps per program."""

    block_elements: int
    max_block_channels: int
    num_warps: int


# 2048 elements per program with 4 warps: 16 per thread, i.e. two 16-byte fp16 loads per tap per
# thread. The stem (C = 64) gets 32 pixels x 64 channels: each pixel's channels are one 128-byte
# segment; a 3x3 window issues 9 such loads per thread before the first max, enough bytes in
# flight per SM to cover memory latency. Chosen from these counts; not tuned (the stem ran at 1.8
# TB/s forward and 1.6 TB/s backward on an H200: room left).
LAUNCH = MaxPoolLaunch(block_elements=2048, max_block_channels=128, num_warps=4)

# Backward: windows reaching one input element beyond which the loop over window rows is not
# unrolled (unrolled, a dilated 3x3 with stride 1, 25 candidate windows, spilled on sm_90).
_MAX_UNROLLED_WINDOWS = 9


@triton.jit
def _max_pool2d_forward_kernel(
    x_ptr,  # DTYPE* (N, C, H, W) channels_last: x[n, c, h, w] at ((n * H + h) * W + w) * C + c
    out_ptr,  # DTYPE* (N, C, OH, OW) channels_last out: the maxima
    offsets_ptr,  # uint8* (N, C, OH, OW) channels_last out: kh * KW + kw of each window's winner
    num_out_pixels,  # N * OH * OW
    channels,
    height,
    width,
    out_height,
    out_width,
    KERNEL_H: tl.constexpr,
    KERNEL_W: tl.constexpr,
    STRIDE_H: tl.constexpr,
    STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    DILATION_H: tl.constexpr,
    DILATION_W: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_PIXELS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
):
    pixels = tl.program_id(0) * BLOCK_PIXELS + tl.arange(0, BLOCK_PIXELS)
    channel = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    pixel_in_range = pixels < num_out_pixels
    channel_in_range = channel < channels
    ow = pixels % out_width
    oh = (pixels // out_width) % out_height
    n = pixels // (out_width * out_height)
    h_start = oh * STRIDE_H - PAD_H
    w_start = ow * STRIDE_W - PAD_W

    # Compared in fp32 (exact for every input dtype): Triton's CPU interpreter compares bf16 values
    # by their bits.
    best = tl.full((BLOCK_PIXELS, BLOCK_CHANNELS), float("-inf"), tl.float32)
    best_tap = tl.full((BLOCK_PIXELS, BLOCK_CHANNELS), -1, tl.int32)
    for kh in tl.static_range(KERNEL_H):
        ih = h_start + kh * DILATION_H
        row_valid = pixel_in_range & (ih >= 0) & (ih < height)
        row = n * height + ih
        for kw in tl.static_range(KERNEL_W):
            iw = w_start + kw * DILATION_W
            valid = row_valid & (iw >= 0) & (iw < width)
            pixel_offset = (row * width + iw).to(tl.int64) * channels
            mask = valid[:, None] & channel_in_range[None, :]
            value = tl.load(x_ptr + pixel_offset[:, None] + channel[None, :], mask=mask, other=0.0)
            value = value.to(tl.float32)
            # torch's rule; the first in-range tap is taken whatever it holds (an all -inf window
            # reports its first in-range tap, never a padding tap).
            take = mask & ((value > best) | (value != value) | (best_tap < 0))
            best = tl.where(take, value, best)
            best_tap = tl.where(take, kh * KERNEL_W + kw, best_tap)

    out_offset = pixels.to(tl.int64)[:, None] * channels + channel[None, :]
    store_mask = pixel_in_range[:, None] & channel_in_range[None, :]
    # The maximum is one of the inputs, so the rounding back to DTYPE is exact.
    tl.store(out_ptr + out_offset, round_to_dtype(best, DTYPE), mask=store_mask)
    tl.store(offsets_ptr + out_offset, best_tap.to(tl.uint8), mask=store_mask)


@triton.jit
def _add_window_row(
    total,  # float32 (BLOCK_PIXELS, BLOCK_CHANNELS): the gradient summed so far
    i,  # which of the windows' rows that reach ih: oh = first_oh + i
    first_oh,
    first_ow,
    ih,
    iw,
    n,
    pixel_in_range,
    channel,
    channel_mask,
    grad_out_channel,
    batch_offset,
    grad_out_ptr,
    grad_out_stride_h,
    grad_out_stride_w,
    offsets_ptr,
    channels,
    out_height,
    out_width,
    KERNEL_H: tl.constexpr,
    KERNEL_W: tl.constexpr,
    STRIDE_H: tl.constexpr,
    STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    DILATION_H: tl.constexpr,
    DILATION_W: tl.constexpr,
    WINDOWS_W: tl.constexpr,
):
    """Add to `total` the gradients of the windows in output row first_oh + i that chose (ih, iw)."""
    oh = first_oh + i
    # The window's tap on row ih, if it has one: distance_h = kh * DH with 0 <= kh < KH.
    distance_h = ih + PAD_H - oh * STRIDE_H
    kh = distance_h // DILATION_H
    row_valid = (
        pixel_in_range
        & (oh < out_height)
        & (distance_h >= 0)
        & (distance_h % DILATION_H == 0)
        & (kh < KERNEL_H)
    )
    for j in tl.static_range(WINDOWS_W):
        ow = first_ow + j
        distance_w = iw + PAD_W - ow * STRIDE_W
        kw = distance_w // DILATION_W
        valid = (
            row_valid
            & (ow < out_width)
            & (distance_w >= 0)
            & (distance_w % DILATION_W == 0)
            & (kw < KERNEL_W)
        )
        mask = valid[:, None] & channel_mask
        out_pixel = (n * out_height + oh) * out_width + ow
        tap = tl.load(
            offsets_ptr + out_pixel.to(tl.int64)[:, None] * channels + channel[None, :], mask=mask, other=255
        )
        won = mask & (tap.to(tl.int32) == (kh * KERNEL_W + kw)[:, None])
        grad_offset = batch_offset + oh.to(tl.int64) * grad_out_stride_h + ow.to(tl.int64) * grad_out_stride_w
        grad = tl.load(grad_out_ptr + grad_offset[:, None] + grad_out_channel, mask=won, other=0.0)
        total += grad.to(tl.float32)
    return total


@triton.jit
def _max_pool2d_backward_kernel(
    grad_out_ptr,  # DTYPE* (N, C, OH, OW): grad_out[n, c, oh, ow] at n*s_n + c*s_c + oh*s_h + ow*s_w
    grad_out_stride_n,
    grad_out_stride_c,
    grad_out_stride_h,
    grad_out_stride_w,
    offsets_ptr,  # uint8* (N, C, OH, OW) channels_last: the forward's offsets
    grad_in_ptr,  # DTYPE* (N, C, H, W) channels_last out: the input gradient, every element written
    num_in_pixels,  # N * H * W
    channels,
    height,
    width,
    out_height,
    out_width,
    KERNEL_H: tl.constexpr,
    KERNEL_W: tl.constexpr,
    STRIDE_H: tl.constexpr,
    STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    DILATION_H: tl.constexpr,
    DILATION_W: tl.constexpr,
    WINDOWS_H: tl.constexpr,  # most windows that reach one input row: ceil(((KH-1)*DH+1) / SH)
    WINDOWS_W: tl.constexpr,
    UNROLL_ROWS: tl.constexpr,  # unroll the loop over window rows (small windows)
    DTYPE: tl.constexpr,
    BLOCK_PIXELS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
):
    pixels = tl.program_id(0) * BLOCK_PIXELS + tl.arange(0, BLOCK_PIXELS)
    channel = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    pixel_in_range = pixels < num_in_pixels
    channel_in_range = channel < channels
    iw = pixels % width
    ih = (pixels // width) % height
    n = pixels // (width * height)
    # The first window whose last tap reaches ih: oh >= (ih + PH - (KH-1)*DH) / SH, rounded up.
    reach_h = ih + PAD_H - (KERNEL_H - 1) * DILATION_H
    reach_w = iw + PAD_W - (KERNEL_W - 1) * DILATION_W
    first_oh = tl.where(reach_h > 0, (reach_h + STRIDE_H - 1) // STRIDE_H, 0)
    first_ow = tl.where(reach_w > 0, (reach_w + STRIDE_W - 1) // STRIDE_W, 0)
    channel_mask = channel_in_range[None, :]
    grad_out_channel = channel.to(tl.int64)[None, :] * grad_out_stride_c
    batch_offset = n.to(tl.int64) * grad_out_stride_n

    total = tl.zeros((BLOCK_PIXELS, BLOCK_CHANNELS), tl.float32)
    # Windows in (oh, ow) order: each input element adds its windows' gradients in torch's order.
    # Small windows unroll fully (4 windows for the stem); larger ones loop over window rows, which
    # keeps a dilated 3x3 (25 candidate windows) from spilling registers on sm_90.
    row = (
        first_oh,
        first_ow,
        ih,
        iw,
        n,
        pixel_in_range,
        channel,
        channel_mask,
        grad_out_channel,
        batch_offset,
    )
    if UNROLL_ROWS:
        for i in tl.static_range(WINDOWS_H):
            total = _add_window_row(
                total,
                i,
                *row,
                grad_out_ptr,
                grad_out_stride_h,
                grad_out_stride_w,
                offsets_ptr,
                channels,
                out_height,
                out_width,
                KERNEL_H,
                KERNEL_W,
                STRIDE_H,
                STRIDE_W,
                PAD_H,
                PAD_W,
                DILATION_H,
                DILATION_W,
                WINDOWS_W,
            )
    else:
        for i in range(WINDOWS_H):
            total = _add_window_row(
                total,
                i,
                *row,
                grad_out_ptr,
                grad_out_stride_h,
                grad_out_stride_w,
                offsets_ptr,
                channels,
                out_height,
                out_width,
                KERNEL_H,
                KERNEL_W,
                STRIDE_H,
                STRIDE_W,
                PAD_H,
                PAD_W,
                DILATION_H,
                DILATION_W,
                WINDOWS_W,
            )

    in_offset = pixels.to(tl.int64)[:, None] * channels + channel[None, :]
    tl.store(
        grad_in_ptr + in_offset,
        round_to_dtype(total, DTYPE),
        mask=pixel_in_range[:, None] & channel_mask,
    )


@functools.lru_cache(maxsize=256)
def _launch_shape(num_pixels: int, channels: int, launch: MaxPoolLaunch) -> tuple[int, int, tuple[int, int]]:
    """(block pixels, block channels, grid) for a pass over ``num_pixels`` x ``channels``; cached
    (``triton.cdiv`` and friends cost microseconds per call)."""
    block_channels = min(launch.max_block_channels, triton.next_power_of_2(channels))
    block_pixels = max(1, launch.block_elements // block_channels)
    block_pixels = min(block_pixels, triton.next_power_of_2(num_pixels))
    grid = (triton.cdiv(num_pixels, block_pixels), triton.cdiv(channels, block_channels))
    return block_pixels, block_channels, grid


def _windows_reaching(kernel: int, stride: int, dilation: int) -> int:
    """Most windows whose span ((kernel - 1) * dilation + 1 elements) covers one input element."""
    return triton.cdiv((kernel - 1) * dilation + 1, stride)


def _window_constants(kernel_size, stride, padding, dilation) -> dict[str, int]:
    return {
        "KERNEL_H": kernel_size[0],
        "KERNEL_W": kernel_size[1],
        "STRIDE_H": stride[0],
        "STRIDE_W": stride[1],
        "PAD_H": padding[0],
        "PAD_W": padding[1],
        "DILATION_H": dilation[0],
        "DILATION_W": dilation[1],
    }


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
    """2-D max pooling of a channels_last ``input`` (N, C, H, W; fp16, bf16 or fp32) with window
    pairs (height, width): ``(out, offsets)``, the contract of ``amp_fx.kernels.max_pool``. With
    ``validate=False`` the output size is still computed here.

    Example:
        >>> x = torch.randn(256, 64, 112, 112, dtype=torch.float16, device="cuda")  # doctest: +SKIP
        >>> x = x.to(memory_format=torch.channels_last)  # doctest: +SKIP
        >>> out, offsets = max_pool2d_forward(x, (3, 3), (2, 2), (1, 1), (1, 1), False)  # doctest: +SKIP
    """
    if validate:
        check_channels_last("input", input)
        out_h, out_w = check_max_pool2d_arguments(
            input.shape, input.dtype, kernel_size, stride, padding, dilation, ceil_mode
        )
    else:
        out_h, out_w = _output_size(
            tuple(input.shape[2:]),
            tuple(kernel_size),
            tuple(stride),
            tuple(padding),
            tuple(dilation),
            ceil_mode,
        )
    batch, channels, height, width = input.shape
    shape = (batch, channels, out_h, out_w)
    out = torch.empty(shape, dtype=input.dtype, device=input.device, memory_format=torch.channels_last)
    offsets = torch.empty(shape, dtype=torch.uint8, device=input.device, memory_format=torch.channels_last)
    num_out_pixels = batch * out_h * out_w
    if out.numel() == 0:
        return out, offsets
    check_triton_max_pool2d_pixels(batch * height * width, num_out_pixels)
    block_pixels, block_channels, grid = _launch_shape(num_out_pixels, channels, LAUNCH)
    with on_device(input.device):
        _max_pool2d_forward_kernel[grid](
            input,
            out,
            offsets,
            num_out_pixels,
            channels,
            height,
            width,
            out_h,
            out_w,
            **_window_constants(kernel_size, stride, padding, dilation),
            DTYPE=triton_dtype(input.dtype),
            BLOCK_PIXELS=block_pixels,
            BLOCK_CHANNELS=block_channels,
            num_warps=LAUNCH.num_warps,
        )
    return out, offsets


@functools.lru_cache(maxsize=256)
def _output_size(
    size: tuple[int, int],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    ceil_mode: bool,
) -> tuple[int, int]:
    """The output's (OH, OW), cached: computed on every unchecked call."""
    return tuple(
        max_pool2d_output_size(size[i], kernel_size[i], stride[i], padding[i], dilation[i], ceil_mode)
        for i in range(2)
    )


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
    """Gradient of `max_pool2d_forward` w.r.t. its input of size ``input_size`` (N, C, H, W), from
    ``grad_out`` (any strides) and the forward's ``offsets``: the contract of
    ``amp_fx.kernels.max_pool``, every element written once.

    Example:
        >>> grad_input = max_pool2d_backward(torch.ones_like(out), offsets, x.shape, (3, 3), (2, 2),
        ...                                  (1, 1), (1, 1))  # doctest: +SKIP
    """
    if validate:
        check_max_pool2d_backward_arguments(
            grad_out, offsets, input_size, kernel_size, stride, padding, dilation
        )
    batch, channels, height, width = input_size
    grad_input = torch.empty(
        tuple(input_size), dtype=grad_out.dtype, device=grad_out.device, memory_format=torch.channels_last
    )
    num_in_pixels = batch * height * width
    if grad_input.numel() == 0:
        return grad_input
    out_h, out_w = offsets.shape[2:]
    check_triton_max_pool2d_pixels(num_in_pixels, batch * out_h * out_w)
    block_pixels, block_channels, grid = _launch_shape(num_in_pixels, channels, LAUNCH)
    windows_h = _windows_reaching(kernel_size[0], stride[0], dilation[0])
    windows_w = _windows_reaching(kernel_size[1], stride[1], dilation[1])
    with on_device(grad_out.device):
        _max_pool2d_backward_kernel[grid](
            grad_out,
            *grad_out.stride(),
            offsets,
            grad_input,
            num_in_pixels,
            channels,
            height,
            width,
            out_h,
            out_w,
            **_window_constants(kernel_size, stride, padding, dilation),
            WINDOWS_H=windows_h,
            WINDOWS_W=windows_w,
            UNROLL_ROWS=windows_h * windows_w <= _MAX_UNROLLED_WINDOWS,
            DTYPE=triton_dtype(grad_out.dtype),
            BLOCK_PIXELS=block_pixels,
            BLOCK_CHANNELS=block_channels,
            num_warps=LAUNCH.num_warps,
        )
    return grad_input
