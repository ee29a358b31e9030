"""Overflow check with optional squared norm, for many gradients in one launch.

What: the family's contract, ``amp_fx.kernels.overflow_check``, in one pass over every gradient.

Why a separate launch before the update: the skip after an overflow must be all-or-nothing. If the
update kernel checked its own chunk only, chunks before the one holding the inf would already be
written. So this kernel runs first over all grads (2 bytes per fp16 parameter: the cheapest pass
of the step), and the update kernels read the flag it leaves. Its squared norm is what gradient
clipping needs, at no extra traffic.

Determinism: each program writes the partial sum of its own chunk to its own slot, and the slots
are summed by ``torch.sum`` afterwards, so the norm has the same bits on every run (atomic adds
would not).

Layout: a pointer table (``amp_fx.kernels.pointer_table``) with one column (grad); one launch per grad dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.devices import on_device
from amp_fx.kernels.overflow_check.arguments import check_grads
from amp_fx.kernels.pointer_table import LaunchConfig, group_by_dtype, pointer_table, triton_dtype

# 4 fp16 per thread (an 8-byte load), 16 iterations per program; the settings tried on an H200 were
# all within 4% of each other, at or above the copy bandwidth (benchmarks/NOTES_optimizer.md).
LAUNCH = LaunchConfig(block_size=512, chunk_size=8 * 1024, num_warps=4)


@triton.jit
def _check_block(grad_ptr, offsets, mask, other, grad_multiplier, not_finite, sum_of_squares):
    # mask and other are None for a full block (lets the compiler vectorize), else offsets < end and 0.
    grad = tl.load(grad_ptr + offsets, mask=mask, other=other).to(tl.float32)
    # |g| < inf is False exactly for inf and NaN.
    not_finite = not_finite | ~(tl.abs(grad) < float("inf"))
    grad = grad * grad_multiplier
    return not_finite, sum_of_squares + grad * grad


@triton.jit
def _check_finite_and_norm_kernel(
    tensor_table,  # int64 [T, 2]: data pointer of grad i, then its numel
    chunk_table,  # int64 [C, 2]: (tensor index, first element) of the chunk this program checks
    grad_multiplier_ptr,  # float32 [1]: multiplies every grad in the norm (read only if HAS_GRAD_MULTIPLIER)
    found_inf_ptr,  # float32 [1]: set to 1.0 by any program that sees an inf or NaN
    partial_sums_ptr,  # float32 [C]: this program's sum of squares (written only if COMPUTE_NORM)
    GRAD_DTYPE: tl.constexpr,
    HAS_GRAD_MULTIPLIER: tl.constexpr,
    COMPUTE_NORM: tl.constexpr,
    ALIGNED: tl.constexpr,  # every pointer in the table is 16-byte aligned
    CHUNK_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    tensor_index = tl.load(chunk_table + 2 * chunk)
    chunk_start = tl.multiple_of(tl.load(chunk_table + 2 * chunk + 1), CHUNK_SIZE)
    grad_ptr = tl.load(tensor_table + 2 * tensor_index).to(tl.pointer_type(GRAD_DTYPE))
    if ALIGNED:
        grad_ptr = tl.multiple_of(grad_ptr, 16)
    chunk_end = tl.minimum(chunk_start + CHUNK_SIZE, tl.load(tensor_table + 2 * tensor_index + 1))
    grad_multiplier = 1.0
    if HAS_GRAD_MULTIPLIER:
        grad_multiplier = tl.load(grad_multiplier_ptr)

    block = tl.arange(0, BLOCK_SIZE)
    not_finite = tl.zeros([BLOCK_SIZE], dtype=tl.int1)
    sum_of_squares = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    num_full_blocks = (chunk_end - chunk_start) // BLOCK_SIZE
    for i in range(num_full_blocks):
        offsets = chunk_start + i * BLOCK_SIZE + block
        not_finite, sum_of_squares = _check_block(
            grad_ptr, offsets, None, None, grad_multiplier, not_finite, sum_of_squares
        )
    offsets = chunk_start + num_full_blocks * BLOCK_SIZE + block
    # The tail block (possibly empty: then the mask is all False and nothing is read).
    not_finite, sum_of_squares = _check_block(
        grad_ptr, offsets, offsets < chunk_end, 0.0, grad_multiplier, not_finite, sum_of_squares
    )
    # Every program that saw an overflow writes the same value: the race is harmless.
    tl.store(found_inf_ptr, 1.0, mask=tl.max(not_finite.to(tl.int32), axis=0) > 0)
    if COMPUTE_NORM:
        tl.store(partial_sums_ptr + chunk, tl.sum(sum_of_squares, axis=0))


def check_finite_and_norm_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    *,
    grad_multiplier: Tensor | None = None,
    sq_norm_out: Tensor | None = None,
) -> None:
    """Set ``found_inf`` to 1.0 if any grad holds inf/NaN; optionally ``sq_norm_out += sum((g * mult)^2)``.

    One launch per grad dtype; the contract of ``amp_fx.kernels.overflow_check``.

    Example:
        >>> found_inf = torch.zeros(1, device="cuda"); sq = torch.zeros(1, device="cuda")  # doctest: +SKIP
        >>> grads = [torch.tensor([3.0, 4.0], device="cuda")]  # doctest: +SKIP
        >>> check_finite_and_norm_(grads, found_inf, sq_norm_out=sq)  # doctest: +SKIP
        >>> sq  # doctest: +SKIP
        tensor([25.], device='cuda:0')
    """
    check_grads(grads, found_inf, grad_multiplier, sq_norm_out)
    launch = LAUNCH
    groups = group_by_dtype([g.dtype for g in grads])
    tables = {
        key: pointer_table([[grads[i] for i in indices]], launch.chunk_size)
        for key, indices in groups.items()
    }
    compute_norm = sq_norm_out is not None
    partial_sums = found_inf
    if compute_norm:
        partial_sums = torch.empty(
            sum(t.num_chunks for t in tables.values()), dtype=torch.float32, device=found_inf.device
        )
    first_slot = 0
    with on_device(found_inf.device):
        for (grad_dtype,), table in tables.items():
            if table.num_chunks == 0:
                continue
            _check_finite_and_norm_kernel[(table.num_chunks,)](
                table.tensors,
                table.chunks,
                found_inf if grad_multiplier is None else grad_multiplier,
                found_inf,
                partial_sums[first_slot:] if compute_norm else found_inf,
                GRAD_DTYPE=triton_dtype(grad_dtype),
                HAS_GRAD_MULTIPLIER=grad_multiplier is not None,
                COMPUTE_NORM=compute_norm,
                ALIGNED=table.aligned,
                CHUNK_SIZE=launch.chunk_size,
                BLOCK_SIZE=launch.block_size,
                num_warps=launch.num_warps,
            )
            first_slot += table.num_chunks
    if compute_norm and first_slot > 0:
        sq_norm_out.add_(partial_sums.sum())
