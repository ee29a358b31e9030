"""The ``@triton.jit`` kernels of the BatchNorm + act family; ``triton`` fits and launches them.

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
"""

import triton
import triton.language as tl

from amp_fx.kernels.rounding import round_to_dtype


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
