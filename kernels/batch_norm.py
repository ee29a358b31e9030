"""Fused training-mode BatchNorm + residual add + ReLU over channels_last activations.

What (``amp_fx.kernels.reference`` has the full math): per channel c, over the M = N * H * W values
of a channels_last input x, in fp32::

    mean_c, var_c (biased)     invstd_c = 1 / sqrt(var_c + eps)     scale_c = w_c * invstd_c
    out = relu((x - mean_c) * scale_c + b_c + residual)            (rounded once to x's dtype)

    dy'           = dy where out > 0 (ReLU), else 0
    grad_bias_c   = sum(dy')          grad_weight_c = invstd_c * sum(dy' * (x - mean_c))
    grad_input    = scale_c * (dy' - grad_bias_c / M - (x - mean_c) * invstd_c * grad_weight_c / M)
    grad_residual = dy'

Why fused: in a ResNet-50 training step BatchNorm, ReLU and the residual adds are memory-bound and
take more than half of an eager step when cuDNN's BatchNorm and separate elementwise kernels run
them. Here the forward makes two passes (statistics: read x; apply: read x [+ residual], write
out) and the backward two (reduce: read x, dy [+ out]; dx: read x, dy [+ out], write dx
[+ grad_residual]). Without a residual the ReLU mask is recomputed from x and the statistics, so
``out`` is not read again.

How: a channels_last tensor (N, C, H, W) is a row-major [M, C] matrix. Every kernel runs on a grid
of (row programs, channel blocks); a program walks its share of rows in [BLOCK_M, BLOCK_C] tiles,
each row of a tile BLOCK_C contiguous channels (16-byte vector loads). The reductions keep a tile
of fp32 accumulators per program and write one row of partial sums per program ([programs, C]);
torch ops on the device combine the partials, in float64, so nothing waits for the host. The
statistics accumulate x - x[0, c] rather than x: shifting by a value of the channel keeps the
sum of squares from cancelling when the mean is large against the spread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.reference import check_batch_norm_act_arguments
from amp_fx.kernels.rounding import round_to_dtype

__all__ = ["BatchNormLaunch", "LAUNCH", "batch_norm_act_forward", "batch_norm_act_backward"]


@dataclass(frozen=True)
class BatchNormLaunch:
    """How the kernels split an [M, C] activation: channels per tile (``block_channels``), elements
    per tile (``tile_elements``: rows per tile = tile_elements // channels per tile), warps per
    program, and about how many programs one launch has (rows are split to reach it)."""

    block_channels: int
    tile_elements: int
    num_warps: int
    target_programs: int


# 128 channels x 32 rows per tile (64 x 64 for C = 64), 4 warps: 32 elements per thread, four
# 16-byte fp16 loads, and two 32-register fp32 accumulator tiles in the reductions. 1024 programs
# per launch fit an H200 (132 SMs x up to 16 resident 4-warp programs) in one wave with equal work
# each, and keep the partial sums small: at most 1024 x C floats against M x C activations.
LAUNCH = BatchNormLaunch(block_channels=128, tile_elements=4096, num_warps=4, target_programs=1024)


@dataclass(frozen=True)
class _Grid:
    block_rows: int
    block_channels: int
    tiles_per_program: int
    row_programs: int
    channel_programs: int


def _grid(num_rows: int, num_channels: int) -> _Grid:
    """LAUNCH fitted to an [num_rows, num_channels] activation."""
    block_channels = min(LAUNCH.block_channels, triton.next_power_of_2(num_channels))
    block_rows = max(1, LAUNCH.tile_elements // block_channels)
    channel_programs = triton.cdiv(num_channels, block_channels)
    row_tiles = triton.cdiv(num_rows, block_rows)
    wanted = max(1, min(row_tiles, LAUNCH.target_programs // channel_programs))
    tiles_per_program = triton.cdiv(row_tiles, wanted)
    return _Grid(
        block_rows=block_rows,
        block_channels=block_channels,
        tiles_per_program=tiles_per_program,
        row_programs=triton.cdiv(row_tiles, tiles_per_program),
        channel_programs=channel_programs,
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
def _statistics_kernel(
    x_ptr,  # DTYPE* [M, C] row-major: the channels_last input
    shift_ptr,  # float32* [C]: x[0, c], subtracted before summing
    partial_sum_ptr,  # float32* [P, C] out: per program, sum of x - shift over its rows
    partial_sq_ptr,  # float32* [P, C] out: per program, sum of (x - shift)^2
    num_rows,
    num_channels,
    tiles_per_program,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_rows = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < num_channels
    shift = tl.load(shift_ptr + channels, mask=channel_mask, other=0.0)
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
    tl.store(partial_sum_ptr + out, tl.sum(sums, axis=0), mask=channel_mask)
    tl.store(partial_sq_ptr + out, tl.sum(squares, axis=0), mask=channel_mask)


@triton.jit
def _apply_kernel(
    x_ptr,  # DTYPE* [M, C]: the input
    residual_ptr,  # DTYPE* [M, C]: added after the normalization (only when HAS_RESIDUAL)
    out_ptr,  # DTYPE* [M, C] out
    mean_ptr,  # float32* [C]
    scale_ptr,  # float32* [C]: weight * invstd
    bias_ptr,  # float32* [C]: bias (zeros without one)
    num_rows,
    num_channels,
    tiles_per_program,
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
    scale = tl.load(scale_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0)[None, :]
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
    scale_ptr,  # float32* [C]: weight * invstd
    bias_ptr,  # float32* [C]
    partial_dy_ptr,  # float32* [P, C] out: per program, sum of dy'
    partial_dy_centered_ptr,  # float32* [P, C] out: per program, sum of dy' * (x - mean)
    num_rows,
    num_channels,
    tiles_per_program,
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
    scale = tl.load(scale_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0)[None, :]
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
    tl.store(partial_dy_ptr + out, tl.sum(sum_dy, axis=0), mask=channel_mask)
    tl.store(partial_dy_centered_ptr + out, tl.sum(sum_dy_centered, axis=0), mask=channel_mask)


@triton.jit
def _backward_input_kernel(
    grad_out_ptr,  # DTYPE* [M, C]: dy
    x_ptr,  # DTYPE* [M, C]: the forward's input
    out_ptr,  # DTYPE* [M, C]: the forward's output (only when HAS_OUT)
    mean_ptr,  # float32* [C]
    scale_ptr,  # float32* [C]: weight * invstd
    bias_ptr,  # float32* [C]
    mean_dy_ptr,  # float32* [C]: grad_bias / M
    centered_coefficient_ptr,  # float32* [C]: invstd * grad_weight / M
    grad_input_ptr,  # DTYPE* [M, C] out
    grad_residual_ptr,  # DTYPE* [M, C] out: dy' (only when HAS_RESIDUAL)
    num_rows,
    num_channels,
    tiles_per_program,
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
    scale = tl.load(scale_ptr + channels, mask=channel_mask, other=0.0)[None, :]
    bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0)[None, :]
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


def _rows(tensor: Tensor) -> Tensor:
    """The [M, C] row-major view of a channels_last (N, C, H, W) or a contiguous (M, C) tensor."""
    if tensor.dim() == 2 and tensor.is_contiguous():
        return tensor
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return tensor.permute(0, 2, 3, 1).reshape(-1, tensor.shape[1])
    layout = "contiguous 2-D" if tensor.dim() == 2 else f"{tensor.dim()}-D, strides {tensor.stride()}"
    raise ValueError(
        f"the Triton BatchNorm kernels read (N, C, H, W) tensors in torch.channels_last or contiguous "
        f"(M, C) tensors, got {layout}; call .contiguous(memory_format=torch.channels_last) or use "
        f"amp_fx.kernels.reference"
    )


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    """Launch on the tensors' GPU, not the current one (Triton launches on the current device)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def _scale_and_bias(weight: Tensor | None, bias: Tensor | None, invstd: Tensor) -> tuple[Tensor, Tensor]:
    scale = invstd if weight is None else weight.float() * invstd
    shift = torch.zeros_like(invstd) if bias is None else bias.float().contiguous()
    return scale.contiguous(), shift


def batch_norm_act_forward(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    relu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm (+ residual) (+ ReLU) of a channels_last ``input``; same contract as
    ``amp_fx.kernels.reference.batch_norm_act_forward``: ``(out, mean, invstd, var)``.

    Example:
        >>> x = torch.randn(8, 64, 7, 7, device="cuda", dtype=torch.float16)  # doctest: +SKIP
        >>> x = x.to(memory_format=torch.channels_last)  # doctest: +SKIP
        >>> out, mean, invstd, var = batch_norm_act_forward(x, None, None, None, 1e-5, True)  # doctest: +SKIP
    """
    check_batch_norm_act_arguments(input, weight, bias, residual)
    x = _rows(input)
    residual_rows = _rows(residual) if residual is not None else None
    num_rows, num_channels = x.shape
    grid = _grid(num_rows, num_channels)
    launch = (grid.row_programs, grid.channel_programs)
    partials = torch.empty((2, grid.row_programs, num_channels), dtype=torch.float32, device=input.device)
    shift = x[0].float().contiguous()
    with _on_device(input.device):
        _statistics_kernel[launch](
            x,
            shift,
            partials[0],
            partials[1],
            num_rows,
            num_channels,
            grid.tiles_per_program,
            BLOCK_M=grid.block_rows,
            BLOCK_C=grid.block_channels,
            num_warps=LAUNCH.num_warps,
        )
    sums = partials.double().sum(dim=1)
    shifted_mean = sums[0] / num_rows
    var = (sums[1] / num_rows - shifted_mean * shifted_mean).clamp_min(0.0).float()
    mean = (shift.double() + shifted_mean).float()
    invstd = torch.rsqrt(var + eps)
    scale, shift_after = _scale_and_bias(weight, bias, invstd)
    out = torch.empty_like(input)
    with _on_device(input.device):
        _apply_kernel[launch](
            x,
            x if residual_rows is None else residual_rows,
            _rows(out),
            mean,
            scale,
            shift_after,
            num_rows,
            num_channels,
            grid.tiles_per_program,
            HAS_RESIDUAL=residual_rows is not None,
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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `batch_norm_act_forward`; same contract as
    ``amp_fx.kernels.reference.batch_norm_act_backward``: ``(grad_input, grad_weight, grad_bias,
    grad_residual)`` (grad_residual empty without a residual). ``grad_out`` in another layout is
    copied to channels_last first.

    Example:
        >>> grads = batch_norm_act_backward(torch.ones_like(out), x, None, None, mean, invstd,
        ...                                 None, False, True)  # doctest: +SKIP
    """
    check_batch_norm_act_arguments(
        input, weight, bias, None, grad_out=grad_out, mean=mean, invstd=invstd, out=out
    )
    if relu and has_residual and out is None:
        raise ValueError("with a residual and relu=True the backward needs the forward's output (out)")
    x = _rows(input)
    memory_format = torch.channels_last if input.dim() == 4 else torch.contiguous_format
    dy = _rows(grad_out.contiguous(memory_format=memory_format))
    has_out = relu and out is not None
    out_rows = _rows(out) if has_out else x
    num_rows, num_channels = x.shape
    grid = _grid(num_rows, num_channels)
    launch = (grid.row_programs, grid.channel_programs)
    scale, shift = _scale_and_bias(weight, bias, invstd)
    mean = mean.contiguous()
    partials = torch.empty((2, grid.row_programs, num_channels), dtype=torch.float32, device=input.device)
    dtype = triton_dtype(input.dtype)
    with _on_device(input.device):
        _backward_reduce_kernel[launch](
            dy,
            x,
            out_rows,
            mean,
            scale,
            shift,
            partials[0],
            partials[1],
            num_rows,
            num_channels,
            grid.tiles_per_program,
            RELU=relu,
            HAS_OUT=has_out,
            DTYPE=dtype,
            BLOCK_M=grid.block_rows,
            BLOCK_C=grid.block_channels,
            num_warps=LAUNCH.num_warps,
        )
    grad_bias = partials[0].double().sum(dim=0).float()
    sum_dy_centered = partials[1].double().sum(dim=0).float()
    grad_weight = invstd * sum_dy_centered
    mean_dy = grad_bias / num_rows
    centered_coefficient = (invstd * grad_weight / num_rows).contiguous()
    grad_input = torch.empty_like(input)
    grad_residual = torch.empty_like(input) if has_residual else input.new_empty((0,))
    with _on_device(input.device):
        _backward_input_kernel[launch](
            dy,
            x,
            out_rows,
            mean,
            scale,
            shift,
            mean_dy,
            centered_coefficient,
            _rows(grad_input),
            _rows(grad_residual) if has_residual else x,
            num_rows,
            num_channels,
            grid.tiles_per_program,
            RELU=relu,
            HAS_OUT=has_out,
            HAS_RESIDUAL=has_residual,
            DTYPE=dtype,
            BLOCK_M=grid.block_rows,
            BLOCK_C=grid.block_channels,
            num_warps=LAUNCH.num_warps,
        )
    return (
        grad_input,
        grad_weight.to(torch.float32 if weight is None else weight.dtype),
        grad_bias.to(torch.float32 if bias is None else bias.dtype),
        grad_residual,
    )
