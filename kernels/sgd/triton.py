"""Fused SGD step (momentum, dampening, Nesterov) for many tensors in one launch, with FP32 masters.

What: the family's contract, ``amp_fx.kernels.sgd``, which has the math.

Why fused: memory-bound, like Adam. For an fp16 param with an fp32 master and momentum it reads the
grad (2 B), master and buffer (8 B) and writes master and buffer (8 B) and the param (2 B): 20 bytes
per parameter (12 without momentum: no buffer), in one pass.

Skip: when found_inf > 0 every program runs zero iterations, so nothing is read or written
(all-or-nothing, decided on the device; ``amp_fx.kernels.overflow_check.triton`` says why the
check runs first).

Layout: a pointer table (``amp_fx.kernels.pointer_table``) with columns param, grad, master, momentum buffer,
step_offset (a pointer to the parameter's one-element offset, read once per program); one launch per
(param dtype, grad dtype, has master) group (``amp_fx.kernels.optimizer_launch``).
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.arguments import check_update
from amp_fx.kernels.optimizer_launch import launch_per_dtype_group
from amp_fx.kernels.pointer_table import LaunchConfig
from amp_fx.kernels.rounding import round_to_dtype
from amp_fx.kernels.sgd.arguments import check_sgd_hyperparameters

# As for Adam (adam.py): 4 elements per thread, one layout, 2 iterations per program; fastest of the
# settings tried on an H200 (benchmarks/NOTES_optimizer.md).
LAUNCH = LaunchConfig(block_size=1024, chunk_size=2 * 1024, num_warps=8)


@triton.jit
def _sgd_block(
    param_ptr,  # PARAM_DTYPE*: the param (also the fp32 master when HAS_MASTER is False)
    grad_ptr,  # GRAD_DTYPE*: its gradient
    master_ptr,  # float32*: fp32 master (only when HAS_MASTER)
    buffer_ptr,  # float32*: momentum buffer (only when USE_MOMENTUM)
    offsets,
    mask,  # None for a full block (lets the compiler vectorize), else offsets < end
    first_step,
    grad_multiplier,
    lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    PARAM_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    USE_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    USE_WEIGHT_DECAY: tl.constexpr,
):
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * grad_multiplier
    if HAS_MASTER:
        weight = tl.load(master_ptr + offsets, mask=mask)
    else:
        weight = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
    if USE_WEIGHT_DECAY:
        grad = grad + weight_decay * weight
    if USE_MOMENTUM:
        if first_step:
            buffer = grad
        else:
            buffer = momentum * tl.load(buffer_ptr + offsets, mask=mask) + one_minus_dampening * grad
        tl.store(buffer_ptr + offsets, buffer, mask=mask)
        if NESTEROV:
            grad = grad + momentum * buffer
        else:
            grad = buffer
    weight = weight - lr * grad
    if HAS_MASTER:
        tl.store(master_ptr + offsets, weight, mask=mask)
    tl.store(param_ptr + offsets, round_to_dtype(weight, PARAM_DTYPE), mask=mask)


@triton.jit
def _sgd_kernel(
    tensor_table,  # int64 [T, 6]: data pointers of param, grad, master (0 if none), momentum buffer,
    # step_offset (0 if none); numel
    chunk_table,  # int64 [C, 2]: (tensor index, first element) of the chunk this program updates
    step_ptr,  # float32 [1]: steps already taken; 0 means the momentum buffer starts as the grad
    grad_multiplier_ptr,  # float32 [1]: multiplies every grad (read only if HAS_GRAD_MULTIPLIER)
    found_inf_ptr,  # float32 [1]: > 0 means skip the step (read only if HAS_FOUND_INF)
    lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    PARAM_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    USE_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
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
    chunk_start = tl.multiple_of(tl.load(chunk_table + 2 * chunk + 1), CHUNK_SIZE)
    row = tensor_table + 6 * tensor_index
    param_ptr = tl.load(row + 0).to(tl.pointer_type(PARAM_DTYPE))
    grad_ptr = tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE))
    master_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    buffer_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    numel = tl.load(row + 5)
    if ALIGNED:
        param_ptr = tl.multiple_of(param_ptr, 16)
        grad_ptr = tl.multiple_of(grad_ptr, 16)
        master_ptr = tl.multiple_of(master_ptr, 16)
        buffer_ptr = tl.multiple_of(buffer_ptr, 16)
    chunk_end = tl.minimum(chunk_start + CHUNK_SIZE, numel)
    if HAS_FOUND_INF:
        # The skip: no iterations, so nothing is loaded or stored.
        chunk_end = tl.where(tl.load(found_inf_ptr) > 0, chunk_start, chunk_end)
    own_step = tl.load(step_ptr)
    if HAS_STEP_OFFSETS:
        own_step = own_step - tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float32)))
    first_step = own_step == 0
    grad_multiplier = 1.0
    if HAS_GRAD_MULTIPLIER:
        grad_multiplier = tl.load(grad_multiplier_ptr)

    block = tl.arange(0, BLOCK_SIZE)
    num_full_blocks = (chunk_end - chunk_start) // BLOCK_SIZE
    for i in range(num_full_blocks):
        offsets = chunk_start + i * BLOCK_SIZE + block
        _sgd_block(
            param_ptr,
            grad_ptr,
            master_ptr,
            buffer_ptr,
            offsets,
            None,
            first_step,
            grad_multiplier,
            lr,
            momentum,
            one_minus_dampening,
            weight_decay,
            PARAM_DTYPE,
            HAS_MASTER,
            USE_MOMENTUM,
            NESTEROV,
            USE_WEIGHT_DECAY,
        )
    tail_start = chunk_start + num_full_blocks * BLOCK_SIZE
    if tail_start < chunk_end:
        offsets = tail_start + block
        _sgd_block(
            param_ptr,
            grad_ptr,
            master_ptr,
            buffer_ptr,
            offsets,
            offsets < chunk_end,
            first_step,
            grad_multiplier,
            lr,
            momentum,
            one_minus_dampening,
            weight_decay,
            PARAM_DTYPE,
            HAS_MASTER,
            USE_MOMENTUM,
            NESTEROV,
            USE_WEIGHT_DECAY,
        )


def sgd_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    momentum_buffers: Sequence[Tensor] | None,
    step: Tensor,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
    step_offsets: Sequence[Tensor] | None = None,
) -> None:
    """One SGD step over all tensors, in one launch per dtype group; the contract of
    ``amp_fx.kernels.sgd``.

    Example:
        >>> import torch
        >>> p = torch.ones(3, dtype=torch.float16, device="cuda"); g = torch.ones_like(p)  # doctest: +SKIP
        >>> master = p.float(); buf = torch.zeros_like(master)  # doctest: +SKIP
        >>> step = torch.zeros(1, device="cuda")  # doctest: +SKIP
        >>> sgd_step_([p], [g], [master], [buf], step, lr=0.1, momentum=0.9, dampening=0.0,
        ...           weight_decay=0.0, nesterov=False)  # doctest: +SKIP
    """
    check_update(
        params,
        grads,
        masters,
        {"momentum_buffers": momentum_buffers},
        step,
        grad_multiplier,
        found_inf,
        {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay},
        step_offsets,
    )
    check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov, momentum_buffers)
    use_momentum = momentum != 0.0
    launch_per_dtype_group(
        _sgd_kernel,
        LAUNCH,
        params,
        grads,
        masters,
        [momentum_buffers if use_momentum else None],
        step,
        grad_multiplier=grad_multiplier,
        found_inf=found_inf,
        # Only the momentum buffer's first step depends on the step; without momentum nothing reads it.
        step_offsets=step_offsets if use_momentum else None,
        arguments={
            "lr": lr,
            "momentum": momentum,
            "one_minus_dampening": 1.0 - dampening,
            "weight_decay": weight_decay,
            "USE_MOMENTUM": use_momentum,
            "NESTEROV": nesterov,
            "USE_WEIGHT_DECAY": weight_decay != 0.0,
        },
    )
