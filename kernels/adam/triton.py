"""Fused Adam / AdamW step for many tensors in one launch, with FP32 master weights.

What: the family's contract, ``amp_fx.kernels.adam``, which has the math.

Why fused: the step is memory-bound. For an fp16 param with an fp32 master it must read the grad
(2 B), master, m and v (12 B) and write master, m, v (12 B) and the param (2 B): 28 bytes per
parameter, and nothing else. One pass does exactly that; the same step from torch parts makes
several passes (grad to fp32, unscale, the update, the copy back) and moves about twice as much.

Skip: when found_inf > 0 (an overflow found by ``check_finite_and_norm_``, launched before this
kernel) every program sets its loop count to zero, so nothing is read or written: params, masters
and moments keep their exact bits and no NaN reaches a master. The decision is made on the device,
per program, from the same flag, so it is all-or-nothing.

Layout: a pointer table (``amp_fx.kernels.pointer_table``) with columns param, grad, master, exp_avg,
exp_avg_sq, step_offset (a pointer to the parameter's one-element offset, read once per program,
so an offset changed in place on the device is seen without rebuilding the table); one launch per
(param dtype, grad dtype, has master) group, never one per tensor (``amp_fx.kernels.optimizer_launch``).
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.adam.arguments import check_adam_hyperparameters, log_beta
from amp_fx.kernels.arguments import check_update
from amp_fx.kernels.optimizer_launch import launch_per_dtype_group
from amp_fx.kernels.pointer_table import LaunchConfig
from amp_fx.kernels.rounding import round_to_dtype

# 4 elements per thread (1024 per iteration, 8 warps): one 16-byte load per fp32 operand and one
# layout for every operand (8 per thread would suit fp16 but costs a shared-memory layout change
# for the fp32 ones); 2 iterations per program. Fastest of the settings tried on an H200
# (benchmarks/NOTES_optimizer.md).
LAUNCH = LaunchConfig(block_size=1024, chunk_size=2 * 1024, num_warps=8)


@triton.jit
def one_minus_pow(log_base, exponent):
    """1 - base**exponent = -expm1(exponent * ln(base)) for a scalar, accurate when the result is small."""
    x = exponent * log_base
    # expm1 by its Taylor series where |x| < 0.5 (truncation error < 1e-9 relative), exp(x) - 1 elsewhere.
    taylor = x * (
        1
        + x
        / 2
        * (1 + x / 3 * (1 + x / 4 * (1 + x / 5 * (1 + x / 6 * (1 + x / 7 * (1 + x / 8 * (1 + x / 9)))))))
    )
    small = tl.abs(x) < 0.5
    return -tl.where(small, taylor, tl.exp(tl.where(small, 0.0, x)) - 1)


@triton.jit
def _adam_block(
    param_ptr,  # PARAM_DTYPE*: the param (also the fp32 master when HAS_MASTER is False)
    grad_ptr,  # GRAD_DTYPE*: its gradient
    master_ptr,  # float32*: fp32 master (only when HAS_MASTER)
    exp_avg_ptr,  # float32*: first moment m
    exp_avg_sq_ptr,  # float32*: second moment v
    offsets,
    mask,  # None for a full block (lets the compiler vectorize), else offsets < end
    grad_multiplier,
    lr,
    step_size,
    bias_correction2_sqrt,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    decay_factor,
    PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    ADAM_W_MODE: tl.constexpr,
    USE_WEIGHT_DECAY: tl.constexpr,
):
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * grad_multiplier
    if HAS_MASTER:
        weight = tl.load(master_ptr + offsets, mask=mask)
    else:
        weight = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    if USE_WEIGHT_DECAY:
        if ADAM_W_MODE:
            weight = weight * decay_factor
        else:
            grad = grad + weight_decay * weight
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denom = tl.sqrt_rn(exp_avg_sq) / bias_correction2_sqrt + eps
    weight = weight - step_size * tl.div_rn(exp_avg, denom)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offsets, weight, mask=mask)
    tl.store(param_ptr + offsets, round_to_dtype(weight, PARAM_DTYPE), mask=mask)


@triton.jit
def _adam_kernel(
    tensor_table,  # int64 [T, 7]: pointers to param, grad, master (0: none), exp_avg, exp_avg_sq,
    # step_offset (0: none); numel
    chunk_table,  # int64 [C, 2]: (tensor index, first element) of the chunk this program updates
    step_ptr,  # float32 [1]: steps already taken; this step is t = step + 1
    grad_multiplier_ptr,  # float32 [1]: multiplies every grad (read only if HAS_GRAD_MULTIPLIER)
    found_inf_ptr,  # float32 [1]: > 0 means skip the step (read only if HAS_FOUND_INF)
    lr,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    log_beta1,
    log_beta2,
    eps,
    weight_decay,
    decay_factor,  # 1 - lr * weight_decay, for adam_w_mode
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    ADAM_W_MODE: tl.constexpr,
    USE_WEIGHT_DECAY: tl.constexpr,
    HAS_GRAD_MULTIPLIER: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_STEP_OFFSETS: tl.constexpr,
    ALIGNED: tl.constexpr,  # every vector pointer in the table is 16-byte aligned
    CHUNK_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    tensor_index = tl.load(chunk_table + 2 * chunk)
    chunk_start = tl.load(chunk_table + 2 * chunk + 1)
    row = tensor_table + 7 * tensor_index
    param_ptr = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE))
    grad_ptr = tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE))
    master_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    exp_avg_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    exp_avg_sq_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    numel = tl.load(row + 6)
    if ALIGNED:
        param_ptr = tl.multiple_of(param_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        master_ptr = tl.multiple_of(master_ptr, 16)
        exp_avg_ptr = tl.multiple_of(exp_avg_ptr, 16)
        exp_avg_sq_ptr = tl.multiple_of(exp_avg_sq_ptr, 16)
    chunk_start = tl.multiple_of(chunk_start, CHUNK_SIZE)
    chunk_end = tl.minimum(chunk_start + CHUNK_SIZE, numel)
    if HAS_FOUND_INF:
        # The skip: no iterations, so nothing is loaded or stored.
        chunk_end = tl.where(tl.load(found_inf_ptr) > 0, chunk_start, chunk_end)

    own_step = tl.load(step_ptr)
    if HAS_STEP_OFFSETS:
        own_step = own_step - tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))
    t = own_step + 1.0
    step_size = lr / one_minus_pow(log_beta1, t)
    bias_correction2_sqrt = tl.sqrt_rn(one_minus_pow(log_beta2, t))
    grad_multiplier = 1.0
    if HAS_GRAD_MULTIPLIER:
        grad_multiplier = tl.load(grad_multiplier_ptr)

    block = tl.arange(0, BLOCK_SIZE)
    num_full_blocks = (chunk_end - chunk_start) // BLOCK_SIZE
    for i in range(num_full_blocks):
        offsets = chunk_start + i * BLOCK_SIZE + block
        _adam_block(
            param_ptr,
            grad_ptr,
            master_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            offsets,
            None,
            grad_multiplier,
            lr,
            step_size,
            bias_correction2_sqrt,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            decay_factor,
            PARAM_DTYPE,
            HAS_MASTER,
            ADAM_W_MODE,
            USE_WEIGHT_DECAY,
        )
    tail_start = chunk_start + num_full_blocks * BLOCK_SIZE
    if tail_start < chunk_end:
        offsets = tail_start + block
        _adam_block(
            param_ptr,
            grad_ptr,
            master_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            offsets,
            offsets < chunk_end,
            grad_multiplier,
            lr,
            step_size,
            bias_correction2_sqrt,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            decay_factor,
            PARAM_DTYPE,
            HAS_MASTER,
            ADAM_W_MODE,
            USE_WEIGHT_DECAY,
        )


def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    grad_multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
    step_offsets: Sequence[Tensor] | None = None,
) -> None:
    """One Adam/AdamW step over all tensors, in one launch per dtype group; the contract of
    ``amp_fx.kernels.adam``.

    Example:
        >>> import torch
        >>> p = torch.ones(3, dtype=torch.float16, device="cuda"); g = torch.ones_like(p)  # doctest: +SKIP
        >>> master = p.float(); m, v = torch.zeros_like(master), torch.zeros_like(master)  # doctest: +SKIP
        >>> step = torch.zeros(1, device="cuda")  # doctest: +SKIP
        >>> adam_step_([p], [g], [master], [m], [v], step, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
        ...            weight_decay=0.0, adam_w_mode=True)  # doctest: +SKIP
    """
    check_update(
        params,
        grads,
        masters,
        {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        step,
        grad_multiplier,
        found_inf,
        {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay},
        step_offsets,
    )
    check_adam_hyperparameters(lr, beta1, beta2, eps, weight_decay)
    launch_per_dtype_group(
        _adam_kernel,
        LAUNCH,
        params,
        grads,
        masters,
        [exp_avgs, exp_avg_sqs],
        step,
        grad_multiplier=grad_multiplier,
        found_inf=found_inf,
        step_offsets=step_offsets,
        arguments={
            "lr": lr,
            "beta1": beta1,
            "one_minus_beta1": 1.0 - beta1,
            "beta2": beta2,
            "one_minus_beta2": 1.0 - beta2,
            "log_beta1": log_beta(beta1),
            "log_beta2": log_beta(beta2),
            "eps": eps,
            "weight_decay": weight_decay,
            "decay_factor": 1.0 - lr * weight_decay,
            "ADAM_W_MODE": adam_w_mode,
            "USE_WEIGHT_DECAY": weight_decay != 0.0,
        },
    )
