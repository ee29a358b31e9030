"""Fused training-mode BatchNorm + residual add + ReLU over channels_last activations.

What: the family's contract, ``amp_fx.kernels.batch_norm``, which has the math.

Why fused: in a ResNet-50 training step BatchNorm, ReLU and the residual adds are memory-bound and
take more than half of an eager step when cuDNN's BatchNorm and separate elementwise kernels run
them. Here the forward makes two passes (statistics: read x; apply: read x [+ residual], write
out) and the backward two (reduce: read x, dy [+ out]; dx: read x, dy [+ out], write dx
[+ grad_residual]). Without a residual the ReLU mask is recomputed from x and the statistics, so
``out`` is not read again.

How: ``jit_kernels`` has the ``@triton.jit`` kernels and their tiling; this module fits a launch
to the activation's shape and launches three kernels each way (no torch op between them).

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
from amp_fx.kernels.batch_norm.jit_kernels import (
    _apply_kernel,
    _backward_finalize_kernel,
    _backward_input_kernel,
    _backward_reduce_kernel,
    _statistics_finalize_kernel,
    _statistics_kernel,
)
from amp_fx.kernels.devices import on_device
from amp_fx.kernels.pointer_table import triton_dtype

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
