"""Fused training-mode BatchNorm + residual add + ReLU over channels_last activations.

What: the family's contract, ``amp_fx.kernels.batch_norm``, which has the math.

Why fused: in a ResNet-50 training step BatchNorm, ReLU and the residual adds are memory-bound and
take more than half of an eager step when cuDNN's BatchNorm and separate elementwise kernels run
them. Here the forward makes two passes (statistics: read x; apply: read x [+ residual], write
out) and the backward two (reduce: read x, dy [+ out]; dx: read x, dy [+ out], write dx
[+ grad_residual]). Without a residual the ReLU mask is recomputed from x and the statistics, so
``out`` is not read again.

How: a channels_last tensor (N, C, H, W) is a row-major [M, C] matrix (the kernels take the tensor
itself: no view is made). The pass kernels run on a grid of (row programs, channel blocks); a
program walks its share of rows in [BLOCK_M, BLOCK_C] tiles, each row of a tile BLOCK_C contiguous
channels (16-byte vector loads). The reductions keep a tile of fp32 accumulators per program and
write one row of partial sums per program ([programs, C]); a "finalize" kernel, one program per
block of channels, combines the partials in float64 and computes every per-channel value the next
pass needs (forward: mean, invstd, var and the running statistics, updated in place; backward:
grad_weight and grad_bias in the parameters' dtype and the two coefficients of the input
gradient), so nothing waits for the host and no torch op runs between the kernels: three launches
forward (statistics, finalize, apply), three backward (reduce, finalize, input gradient). The
pass kernels read weight and bias themselves (scale = weight * invstd is computed per program).
The statistics accumulate x - x[0, c] rather than x: shifting by a value of the channel keeps the
sum of squares from cancelling when the mean is large against the spread.

The running statistics (F.batch_norm's training update) are computed in float64 from the buffers'
values, then rounded to their dtype (through fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.batch_norm.arguments import (
    check_batch_norm_act_arguments,
    check_batch_norm_act_backward_arguments,
    check_triton_batch_norm_layout,
)
from amp_fx.kernels.devices import on_device
from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.rounding import round_to_dtype

__all__ = [
    "BatchNormLaunch",
    "LAUNCH",
    "batch_norm_act_forward",
    "batch_norm_act_backward",
    "finalize_statistics",
    "finalize_backward",
]


@dataclass(frozen=True)
class BatchNormLaunch:
    """How the kernels split an [M, C] activation: channels per tile (``block_channels``), elements
    per tile (``tile_elements``: rows per tile = tile_elements // channels per tile), warps per
    program, and about how many programs one pass launch has (rows are split to reach it). The
    finalize kernels take ``finalize_block_channels`` channels per program and read the partial
    sums ``finalize_block_programs`` rows at a time."""

    block_channels: int
    tile_elements: int
    num_warps: int
    target_programs: int
    finalize_block_channels: int = 32
    finalize_block_programs: int = 32


# 128 channels x 32 rows per tile (64 x 64 for C = 64), 4 warps: 32 elements per thread, four
# 16-byte fp16 loads, and two 32-register fp32 accumulator tiles in the reductions. 1024 programs
# per launch fit an H200 (132 SMs x up to 16 resident 4-warp programs) in one wave with equal work
# each, and keep the partial sums small: at most 1024 x C floats against M x C activations. The
# finalize kernels read those partials (at most ~1024 x 128 floats per row of channel blocks) with
# 32-channel programs: a few programs for C = 64, 64 for C = 2048, each a few microseconds.
LAUNCH = BatchNormLaunch(block_channels=128, tile_elements=4096, num_warps=4, target_programs=1024)


class _Grid(NamedTuple):
    block_rows: int
    block_channels: int
    tiles_per_program: int
    row_programs: int
    channel_programs: int


@functools.lru_cache(maxsize=1024)
def _fitted_grid(
    num_rows: int,
    num_channels: int,
    block_channels: int,
    tile_elements: int,
    target_programs: int,
) -> _Grid:
    """A launch configuration fitted to an [num_rows, num_channels] activation (cached: a model
    has a few dozen distinct shapes, and each call would otherwise redo this arithmetic)."""
    block_channels = min(block_channels, triton.next_power_of_2(num_channels))
    block_rows = max(1, tile_elements // block_channels)
    channel_programs = triton.cdiv(num_channels, block_channels)
    row_tiles = triton.cdiv(num_rows, block_rows)
    wanted = max(1, min(row_tiles, target_programs // channel_programs))
    tiles_per_program = triton.cdiv(row_tiles, wanted)
    return _Grid(
        block_rows=block_rows,
        block_channels=block_channels,
        tiles_per_program=tiles_per_program,
        row_programs=triton.cdiv(row_tiles, tiles_per_program),
        channel_programs=channel_programs,
    )


@functools.lru_cache(maxsize=1024)
def _finalize_grid(num_channels: int, block_channels: int) -> tuple[int]:
    """One finalize program per block of channels (cached: triton.cdiv costs microseconds)."""
    return (triton.cdiv(num_channels, block_channels),)


def _grid(num_rows: int, num_channels: int) -> _Grid:
    """LAUNCH fitted to an [num_rows, num_channels] activation."""
    launch = LAUNCH
    return _fitted_grid(
        num_rows,
        num_channels,
        launch.block_channels,
        launch.tile_elements,
        launch.target_programs,
    )


@triton.jit
def _tile(
    pid_rows, tile, num_rows, num_channels, channels, channel_mask, tiles_per_program, BLOCK_M: tl.constexpr
):
    """Offsets into the [M, C] matrix and the in-bounds mask of a program's tile."""
    rows = (pid_rows * tiles_per_program + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    offsets = rows.to(tl.int64)[:, None] * num_channels + channels[None, :]
    mask = (rows < num_rows)[:, None] & channel_mask[None, :]
    return offsets, mask


@triton.jit
def _channel_affine(
    weight_ptr,
    bias_ptr,
    invstd_ptr,
    channels,
    channel_mask,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """[1, BLOCK_C] fp32 scale = weight * invstd and bias (weight 1, bias 0 when absent): the same
    fp32 product in every kernel, so a recomputed ReLU mask is the forward's bit for bit."""
    invstd = tl.load(invstd_ptr + channels, mask=channel_mask, other=0.0)
    scale = invstd
    if HAS_WEIGHT:
        scale = tl.load(weight_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32) * invstd
    bias = tl.zeros_like(invstd)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
    return scale[None, :], bias[None, :]


@triton.jit
def _sum_partials(
    partials_ptr,
    num_programs,
    num_channels,
    channels,
    channel_mask,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Column sums, in float64, of the two [P, C] partial-sum matrices stored back to back at
    ``partials_ptr``, for the BLOCK_C channels ``channels``. P x C stays far below 2**31 (P is
    at most about LAUNCH.target_programs / channel blocks), so int32 offsets do."""
    first = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float64)
    second = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float64)
    second_ptr = partials_ptr + num_programs * num_channels
    for start in range(0, num_programs, BLOCK_P):
        programs = start + tl.arange(0, BLOCK_P)
        offsets = programs[:, None] * num_channels + channels[None, :]
        mask = (programs < num_programs)[:, None] & channel_mask[None, :]
        first += tl.load(partials_ptr + offsets, mask=mask, other=0.0).to(tl.float64)
        second += tl.load(second_ptr + offsets, mask=mask, other=0.0).to(tl.float64)
    return tl.sum(first, axis=0), tl.sum(second, axis=0)


@triton.jit
def _statistics_kernel(
    x_ptr,  # DTYPE* [M, C] row-major: the channels_last input; row 0 is the shift
    partials_ptr,  # float32* [2, P, C] out: per program, sums of x - x[0], then of (x - x[0])^2
    num_rows,
    num_channels,
    tiles_per_program,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_rows = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    shift = tl.load(x_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
    sums = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    squares = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for tile in range(0, tiles_per_program):
        offsets, mask = _tile(
            pid_rows, tile, num_rows, num_channels, channels, channel_mask, tiles_per_program, BLOCK_M
        )
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        shifted = tl.where(mask, x - shift[None, :], 0.0)
        sums += shifted
        squares += shifted * shifted
    out = pid_rows.to(tl.int64) * num_channels + channels
    tl.store(partials_ptr + out, tl.sum(sums, axis=0), mask=channel_mask)
    squares_ptr = partials_ptr + tl.num_programs(0) * num_channels
    tl.store(squares_ptr + out, tl.sum(squares, axis=0), mask=channel_mask)


@triton.jit
def _statistics_finalize_kernel(
    x_ptr,  # DTYPE* [M, C]: the input; row 0 is the shift of the partial sums
    partials_ptr,  # float32* [2, P, C]: the statistics kernel's partial sums
    mean_ptr,  # float32* [C] out
    invstd_ptr,  # float32* [C] out: 1 / sqrt(var + eps)
    var_ptr,  # float32* [C] out: biased variance
    running_mean_ptr,  # RUNNING_DTYPE* [C] in/out (only when HAS_RUNNING_STATS)
    running_var_ptr,  # RUNNING_DTYPE* [C] in/out: updated with the unbiased variance
    num_programs,
    num_rows,
    num_channels,
    eps,
    momentum,
    HAS_RUNNING_STATS: tl.constexpr,
    RUNNING_DTYPE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    sums, squares = _sum_partials(
        partials_ptr, num_programs, num_channels, channels, channel_mask, BLOCK_P, BLOCK_C
    )
    shifted_mean = sums / num_rows
    var = squares / num_rows - shifted_mean * shifted_mean
    var = tl.where(var < 0.0, 0.0, var)  # rounding can make it slightly negative; NaN stays NaN
    mean = tl.load(x_ptr + channels, mask=channel_mask, other=0.0).to(tl.float64) + shifted_mean
    invstd = 1.0 / tl.sqrt(var + eps)
    tl.store(mean_ptr + channels, mean.to(tl.float32), mask=channel_mask)
    tl.store(invstd_ptr + channels, invstd.to(tl.float32), mask=channel_mask)
    tl.store(var_ptr + channels, var.to(tl.float32), mask=channel_mask)
    if HAS_RUNNING_STATS:
        keep = 1.0 - momentum
        running_mean = tl.load(running_mean_ptr + channels, mask=channel_mask, other=0.0).to(tl.float64)
        running_mean = keep * running_mean + momentum * mean
        tl.store(
            running_mean_ptr + channels,
            round_to_dtype(running_mean.to(tl.float32), RUNNING_DTYPE),
            mask=channel_mask,
        )
        unbiased_var = var * num_rows / (num_rows - 1)
        running_var = tl.load(running_var_ptr + channels, mask=channel_mask, other=0.0).to(tl.float64)
        running_var = keep * running_var + momentum * unbiased_var
        tl.store(
            running_var_ptr + channels,
            round_to_dtype(running_var.to(tl.float32), RUNNING_DTYPE),
            mask=channel_mask,
        )


@triton.jit
def _apply_kernel(
    x_ptr,  # DTYPE* [M, C]: the input
    residual_ptr,  # DTYPE* [M, C]: added after the normalization (only when HAS_RESIDUAL)
    out_ptr,  # DTYPE* [M, C] out
    mean_ptr,  # float32* [C]
    invstd_ptr,  # float32* [C]
    weight_ptr,  # [C] fp16/bf16/fp32 (only when HAS_WEIGHT)
    bias_ptr,  # [C] fp16/bf16/fp32 (only when HAS_BIAS)
    num_rows,
    num_channels,
    tiles_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    RELU: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_rows = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    mean = tl.load(mean_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    scale, bias = _channel_affine(
        weight_ptr, bias_ptr, invstd_ptr, channels, channel_mask, HAS_WEIGHT, HAS_BIAS
    )
    for tile in range(0, tiles_per_program):
        offsets, mask = _tile(
            pid_rows, tile, num_rows, num_channels, channels, channel_mask, tiles_per_program, BLOCK_M
        )
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * scale + bias
        if HAS_RESIDUAL:
            y += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if RELU:
            # Not tl.maximum: NaN stays NaN, as torch.relu keeps it.
            y = tl.where(y < 0, 0.0, y)
        tl.store(out_ptr + offsets, round_to_dtype(y, DTYPE), mask=mask)


@triton.jit
def _kept_gradient(
    dy,
    x_centered,
    out_ptr,
    offsets,
    mask,
    scale,
    bias,
    RELU: tl.constexpr,
    HAS_OUT: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """dy' = dy where the ReLU kept the element (its output is not <= 0, torch's test), else 0.
    Without the stored output, the output is recomputed from x in DTYPE (the same rounding)."""
    if RELU:
        if HAS_OUT:
            out = tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            out = round_to_dtype(x_centered * scale + bias, DTYPE).to(tl.float32)
        dy = tl.where(out <= 0, 0.0, dy)
    return dy


@triton.jit
def _backward_reduce_kernel(
    grad_out_ptr,  # DTYPE* [M, C]: dy
    x_ptr,  # DTYPE* [M, C]: the forward's input
    out_ptr,  # DTYPE* [M, C]: the forward's output (only when HAS_OUT: residual and ReLU)
    mean_ptr,  # float32* [C]
    invstd_ptr,  # float32* [C]
    weight_ptr,  # [C] (only when HAS_WEIGHT)
    bias_ptr,  # [C] (only when HAS_BIAS)
    partials_ptr,  # float32* [2, P, C] out: per program, sums of dy', then of dy' * (x - mean)
    num_rows,
    num_channels,
    tiles_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    HAS_OUT: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_rows = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    mean = tl.load(mean_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    scale, bias = _channel_affine(
        weight_ptr, bias_ptr, invstd_ptr, channels, channel_mask, HAS_WEIGHT, HAS_BIAS
    )
    sum_dy = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    sum_dy_centered = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for tile in range(0, tiles_per_program):
        offsets, mask = _tile(
            pid_rows, tile, num_rows, num_channels, channels, channel_mask, tiles_per_program, BLOCK_M
        )
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        centered = x - mean
        dy = _kept_gradient(dy, centered, out_ptr, offsets, mask, scale, bias, RELU, HAS_OUT, DTYPE)
        dy = tl.where(mask, dy, 0.0)
        sum_dy += dy
        sum_dy_centered += tl.where(mask, dy * centered, 0.0)
    out = pid_rows.to(tl.int64) * num_channels + channels
    tl.store(partials_ptr + out, tl.sum(sum_dy, axis=0), mask=channel_mask)
    centered_ptr = partials_ptr + tl.num_programs(0) * num_channels
    tl.store(centered_ptr + out, tl.sum(sum_dy_centered, axis=0), mask=channel_mask)


@triton.jit
def _backward_finalize_kernel(
    partials_ptr,  # float32* [2, P, C]: the reduce kernel's partial sums
    invstd_ptr,  # float32* [C]
    grad_weight_ptr,  # WEIGHT_DTYPE* [C] out: invstd * sum(dy' * (x - mean))
    grad_bias_ptr,  # BIAS_DTYPE* [C] out: sum(dy')
    mean_dy_ptr,  # float32* [C] out: grad_bias / M
    centered_coefficient_ptr,  # float32* [C] out: invstd * grad_weight / M
    num_programs,
    num_rows,
    num_channels,
    WEIGHT_DTYPE: tl.constexpr,
    BIAS_DTYPE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    sum_dy, sum_dy_centered = _sum_partials(
        partials_ptr, num_programs, num_channels, channels, channel_mask, BLOCK_P, BLOCK_C
    )
    invstd = tl.load(invstd_ptr + channels, mask=channel_mask, other=0.0).to(tl.float64)
    grad_weight = invstd * sum_dy_centered
    grad_weight_rounded = round_to_dtype(grad_weight.to(tl.float32), WEIGHT_DTYPE)
    tl.store(grad_weight_ptr + channels, grad_weight_rounded, mask=channel_mask)
    grad_bias_rounded = round_to_dtype(sum_dy.to(tl.float32), BIAS_DTYPE)
    tl.store(grad_bias_ptr + channels, grad_bias_rounded, mask=channel_mask)
    tl.store(mean_dy_ptr + channels, (sum_dy / num_rows).to(tl.float32), mask=channel_mask)
    coefficient = invstd * grad_weight / num_rows
    tl.store(centered_coefficient_ptr + channels, coefficient.to(tl.float32), mask=channel_mask)


@triton.jit
def _backward_input_kernel(
    grad_out_ptr,  # DTYPE* [M, C]: dy
    x_ptr,  # DTYPE* [M, C]: the forward's input
    out_ptr,  # DTYPE* [M, C]: the forward's output (only when HAS_OUT)
    mean_ptr,  # float32* [C]
    invstd_ptr,  # float32* [C]
    weight_ptr,  # [C] (only when HAS_WEIGHT)
    bias_ptr,  # [C] (only when HAS_BIAS)
    # Two pointers, not one [2, C] buffer: with one, ptxas gives the residual variant ~20 more
    # registers (3 -> 2 resident programs per SM on sm_90).
    mean_dy_ptr,  # float32* [C]: grad_bias / M
    centered_coefficient_ptr,  # float32* [C]: invstd * grad_weight / M
    grad_input_ptr,  # DTYPE* [M, C] out
    grad_residual_ptr,  # DTYPE* [M, C] out: dy' (only when HAS_RESIDUAL)
    num_rows,
    num_channels,
    tiles_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    HAS_OUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_rows = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    mean = tl.load(mean_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    scale, bias = _channel_affine(
        weight_ptr, bias_ptr, invstd_ptr, channels, channel_mask, HAS_WEIGHT, HAS_BIAS
    )
    mean_dy = tl.load(mean_dy_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    coefficient = tl.load(centered_coefficient_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    for tile in range(0, tiles_per_program):
        offsets, mask = _tile(
            pid_rows, tile, num_rows, num_channels, channels, channel_mask, tiles_per_program, BLOCK_M
        )
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        centered = x - mean
        dy = _kept_gradient(dy, centered, out_ptr, offsets, mask, scale, bias, RELU, HAS_OUT, DTYPE)
        grad_input = (dy - mean_dy - centered * coefficient) * scale
        tl.store(grad_input_ptr + offsets, round_to_dtype(grad_input, DTYPE), mask=mask)
        if HAS_RESIDUAL:
            tl.store(grad_residual_ptr + offsets, round_to_dtype(dy, DTYPE), mask=mask)


def _contiguous(vector: Tensor | None) -> Tensor | None:
    """A (C,) parameter the kernels can index by channel (their pointer + c)."""
    return None if vector is None else vector.contiguous()


def finalize_statistics(
    input: Tensor,
    partials: Tensor,
    eps: float,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    momentum: float = 0.1,
) -> tuple[Tensor, Tensor, Tensor]:
    """One launch: the statistics kernel's partial sums ``partials`` (float32 [2, P, C]: per
    program, sums of x - x[0, c], then of their squares) -> ``(mean, invstd, var)`` float32 (C,),
    and the running statistics updated in place when given. ``input`` supplies x[0, c] and M.
    Launched on the current device (callers wrap it in the input's).

    Example:
        >>> partials = torch.zeros(2, 1, 3, device="cuda")  # doctest: +SKIP
        >>> mean, invstd, var = finalize_statistics(x, partials, 1e-5)  # doctest: +SKIP
    """
    num_channels = input.shape[1]
    num_rows = input.numel() // num_channels
    device = input.device
    mean = torch.empty(num_channels, dtype=torch.float32, device=device)
    invstd = torch.empty(num_channels, dtype=torch.float32, device=device)
    var = torch.empty(num_channels, dtype=torch.float32, device=device)
    has_running_stats = running_mean is not None
    launch = LAUNCH
    _statistics_finalize_kernel[_finalize_grid(num_channels, launch.finalize_block_channels)](
        input,
        partials,
        mean,
        invstd,
        var,
        running_mean if has_running_stats else mean,
        running_var if has_running_stats else var,
        partials.shape[1],
        num_rows,
        num_channels,
        float(eps),  # an int 1 would be specialized as a constant and typed as an integer
        float(momentum),
        HAS_RUNNING_STATS=has_running_stats,
        RUNNING_DTYPE=triton_dtype(running_mean.dtype) if has_running_stats else tl.float32,
        BLOCK_P=launch.finalize_block_programs,
        BLOCK_C=launch.finalize_block_channels,
        num_warps=launch.num_warps,
    )
    if has_running_stats:
        # Written through their data pointers: tell autograd, as an in-place torch op would.
        torch.autograd.graph.increment_version(running_mean)
        torch.autograd.graph.increment_version(running_var)
    return mean, invstd, var


def finalize_backward(
    partials: Tensor,
    invstd: Tensor,
    num_rows: int,
    weight_dtype: torch.dtype,
    bias_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One launch: the reduce kernel's partial sums ``partials`` (float32 [2, P, C]: per program,
    sums of dy', then of dy' * (x - mean)) -> ``(grad_weight, grad_bias, mean_dy,
    centered_coefficient)``: grad_weight = invstd * sum(dy' * (x - mean)) and grad_bias = sum(dy')
    in the given dtypes, and the input gradient's per-channel coefficients, float32 (C,):
    grad_bias / M and invstd * grad_weight / M (M = ``num_rows``). Launched on the current
    device.

    Example:
        >>> grad_weight, grad_bias, mean_dy, coefficient = finalize_backward(
        ...     partials, invstd, 98, torch.float32, torch.float32)  # doctest: +SKIP
    """
    num_channels = partials.shape[2]
    device = partials.device
    grad_weight = torch.empty(num_channels, dtype=weight_dtype, device=device)
    grad_bias = torch.empty(num_channels, dtype=bias_dtype, device=device)
    mean_dy = torch.empty(num_channels, dtype=torch.float32, device=device)
    centered_coefficient = torch.empty(num_channels, dtype=torch.float32, device=device)
    launch = LAUNCH
    _backward_finalize_kernel[_finalize_grid(num_channels, launch.finalize_block_channels)](
        partials,
        invstd,
        grad_weight,
        grad_bias,
        mean_dy,
        centered_coefficient,
        partials.shape[1],
        num_rows,
        num_channels,
        WEIGHT_DTYPE=triton_dtype(weight_dtype),
        BIAS_DTYPE=triton_dtype(bias_dtype),
        BLOCK_P=launch.finalize_block_programs,
        BLOCK_C=launch.finalize_block_channels,
        num_warps=launch.num_warps,
    )
    return grad_weight, grad_bias, mean_dy, centered_coefficient


def batch_norm_act_forward(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    relu: bool,
    *,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    momentum: float = 0.1,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm (+ residual) (+ ReLU) of a channels_last ``input``; same contract as
    the reference (``amp_fx.kernels.batch_norm``): ``(out, mean, invstd, var)``, and the running
    statistics updated in place when given. Three launches: statistics, finalize, apply.

    Example:
        >>> x = torch.randn(8, 64, 7, 7, device="cuda", dtype=torch.float16)  # doctest: +SKIP
        >>> x = x.to(memory_format=torch.channels_last)  # doctest: +SKIP
        >>> out, mean, invstd, var = batch_norm_act_forward(x, None, None, None, 1e-5, True)  # doctest: +SKIP
    """
    if validate:
        check_batch_norm_act_arguments(
            input, weight, bias, residual, running_mean=running_mean, running_var=running_var
        )
        check_triton_batch_norm_layout("input", input)
        if residual is not None:
            check_triton_batch_norm_layout("residual", residual)
        weight, bias = _contiguous(weight), _contiguous(bias)
    num_channels = input.shape[1]
    num_rows = input.numel() // num_channels
    grid = _grid(num_rows, num_channels)
    launch = (grid.row_programs, grid.channel_programs)
    device = input.device
    partials = torch.empty((2, grid.row_programs, num_channels), dtype=torch.float32, device=device)
    out = torch.empty_like(input)
    with on_device(device):
        _statistics_kernel[launch](
            input,
            partials,
            num_rows,
            num_channels,
            grid.tiles_per_program,
            BLOCK_M=grid.block_rows,
            BLOCK_C=grid.block_channels,
            num_warps=LAUNCH.num_warps,
        )
        mean, invstd, var = finalize_statistics(input, partials, eps, running_mean, running_var, momentum)
        _apply_kernel[launch](
            input,
            input if residual is None else residual,
            out,
            mean,
            invstd,
            mean if weight is None else weight,
            mean if bias is None else bias,
            num_rows,
            num_channels,
            grid.tiles_per_program,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            HAS_RESIDUAL=residual is not None,
            RELU=relu,
            DTYPE=triton_dtype(input.dtype),
            BLOCK_M=grid.block_rows,
            BLOCK_C=grid.block_channels,
            num_warps=LAUNCH.num_warps,
        )
    return out, mean, invstd, var


def batch_norm_act_backward(
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    out: Tensor | None,
    has_residual: bool,
    relu: bool,
    *,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `batch_norm_act_forward`; same contract as
    the reference (``amp_fx.kernels.batch_norm``): ``(grad_input, grad_weight, grad_bias,
    grad_residual)``. ``grad_out`` in another layout is copied to channels_last first. Three
    launches: reduce, finalize, input gradient.

    Example:
        >>> grads = batch_norm_act_backward(torch.ones_like(out), x, None, None, mean, invstd,
        ...                                 None, False, True)  # doctest: +SKIP
    """
    has_out = relu and out is not None
    if validate:
        check_batch_norm_act_backward_arguments(
            grad_out, input, weight, bias, mean, invstd, out, has_residual, relu
        )
        check_triton_batch_norm_layout("input", input)
        if has_out:
            check_triton_batch_norm_layout("out", out)
        weight, bias = _contiguous(weight), _contiguous(bias)
        mean, invstd = mean.contiguous(), invstd.contiguous()
    memory_format = torch.channels_last if input.dim() == 4 else torch.contiguous_format
    grad_out = grad_out.contiguous(memory_format=memory_format)
    num_channels = input.shape[1]
    num_rows = input.numel() // num_channels
    grid = _grid(num_rows, num_channels)
    launch = (grid.row_programs, grid.channel_programs)
    device = input.device
    dtype = triton_dtype(input.dtype)
    partials = torch.empty((2, grid.row_programs, num_channels), dtype=torch.float32, device=device)
    grad_input = torch.empty_like(input)
    grad_residual = torch.empty_like(input) if has_residual else input.new_empty((0,))
    affine = {"HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None}
    with on_device(device):
        _backward_reduce_kernel[launch](
            grad_out,
            input,
            out if has_out else input,
            mean,
            invstd,
            mean if weight is None else weight,
            mean if bias is None else bias,
            partials,
            num_rows,
            num_channels,
            grid.tiles_per_program,
            **affine,
            RELU=relu,
            HAS_OUT=has_out,
            DTYPE=dtype,
            BLOCK_M=grid.block_rows,
            BLOCK_C=grid.block_channels,
            num_warps=LAUNCH.num_warps,
        )
        grad_weight, grad_bias, mean_dy, centered_coefficient = finalize_backward(
            partials,
            invstd,
            num_rows,
            torch.float32 if weight is None else weight.dtype,
            torch.float32 if bias is None else bias.dtype,
        )
        _backward_input_kernel[launch](
            grad_out,
            input,
            out if has_out else input,
            mean,
            invstd,
            mean if weight is None else weight,
            mean if bias is None else bias,
            mean_dy,
            centered_coefficient,
            grad_input,
            grad_residual if has_residual else input,
            num_rows,
            num_channels,
            grid.tiles_per_program,
            **affine,
            RELU=relu,
            HAS_OUT=has_out,
            HAS_RESIDUAL=has_residual,
            DTYPE=dtype,
            BLOCK_M=grid.block_rows,
            BLOCK_C=grid.block_channels,
            num_warps=LAUNCH.num_warps,
        )
    return grad_input, grad_weight, grad_bias, grad_residual
