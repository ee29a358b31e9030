"""Fused cross-entropy over rows of fp16/bf16/fp32 logits, computed in fp32.

What: the family's contract, ``amp_fx.kernels.cross_entropy``, which has the math.

Why fused: at O2 the loss runs in fp32, as under torch.autocast, whose cross_entropy is on the
fp32 list. From torch parts that is ``F.cross_entropy(x16.float(), t)``: an fp32 copy of the logits,
an fp32 log_softmax, and in the backward an fp32 gradient cast back to fp16. For a GPT
(16 x 1024 rows, 50304 classes) each of those is 3.3 GB. Here the forward reads the fp16 logits
once (1.6 GB) and the backward reads them once and writes the fp16 gradient (3.3 GB); the math
is the same fp32 math, so the result equals the cast path's up to fp32 summation order.

How: one program per row loops over the row in BLOCK_SIZE chunks with an online logsumexp: a
running max m and a running sum s of exp(x - m), rescaled by exp(m_old - m_new) when the max
grows. The max and sum are per chunk (one exp per element, not two as per-lane accumulators need:
on an H100/H200 the exp units, not memory, would bound a fp16 kernel doing two).

Targets: a target outside [0, C) that is not ``ignore_index`` is never used as an address (the
logit is read at column 0 and discarded); that row's loss and gradient are NaN. torch raises an
error for such a target instead, which needs a host synchronization; a NaN loss is the signal here.

Layout: logits rows may be strided, but each row must be contiguous (the wrappers call
``.contiguous()`` otherwise); targets, ``lse`` and ``grad_losses`` may have any stride (an
expanded ``grad_losses`` from a sum or mean is read in place). The gradient is allocated contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.cross_entropy.arguments import check_cross_entropy_arguments, check_logits_overwritable
from amp_fx.kernels.devices import on_device
from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.rounding import round_to_dtype


@dataclass(frozen=True)
class CrossEntropyLaunch:
    """Columns per loop iteration (block) and warps per program, for the widest rows."""

    block_size: int
    num_warps: int


# 4096 columns per iteration with 8 warps: 16 elements per thread (two 16-byte fp16 loads), so one
# iteration has 8 KB of fp16 in flight per program and, with 8 programs resident per SM, 64 KB per
# SM, above the ~40 KB an H200 needs to cover memory latency at full bandwidth. A row of 50304
# classes takes 13 iterations, the last one 28% full (5.6% of the lanes idle overall, against 12%
# for 8192). Narrower rows get a narrower block and fewer warps (`_launch_shape`). Chosen from
# these counts; on an H200 forward + backward on GPT-2's fp16 logits then run at 3.8 TB/s of a
# 4.3 TB/s copy ceiling (benchmarks/bench_cross_entropy.py, BENCHMARKS.md).
LAUNCH = CrossEntropyLaunch(block_size=4096, num_warps=8)

# Fewest elements per thread before a program drops warps: below that, threads mostly idle.
_MIN_ELEMENTS_PER_THREAD = 16


@triton.jit
def _row_logsumexp(row_ptr, num_classes, BLOCK_SIZE: tl.constexpr):
    """logsumexp of one contiguous row, in fp32, with one pass and one exp per element."""
    columns = tl.arange(0, BLOCK_SIZE)
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, num_classes, BLOCK_SIZE):
        offsets = start + columns
        x = tl.load(row_ptr + offsets, mask=offsets < num_classes, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # While every logit seen is -inf the shift is 0, not -inf (-inf - -inf would be NaN); the
        # sum stays 0 and the row's lse comes out -inf, as torch.logsumexp gives.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        running_max = new_max
    return running_max + tl.log(running_sum)


@triton.jit
def _row_loss(row_ptr, target, lse, num_classes, ignore_index):
    """lse - x[target]; 0 for an ignored row, NaN for a target outside [0, C) (never an address)."""
    in_range = (target >= 0) & (target < num_classes)
    target_logit = tl.load(row_ptr + tl.where(in_range, target, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - target_logit, float("nan"))
    return tl.where(target == ignore_index, 0.0, loss)


@triton.jit
def _row_gradient_block(
    row_ptr, out_ptr, offsets, num_classes, target, lse, grad_loss, ignore_index, DTYPE: tl.constexpr
):
    """One block of a row's gradient, g * softmax - g * onehot, computed in fp32 from the logits
    at ``row_ptr`` and stored at ``out_ptr`` rounded once to DTYPE (0 for an ignored row)."""
    in_row = offsets < num_classes
    # An ignored row's gradient is 0 whatever its logits hold, so they are not read.
    x = tl.load(row_ptr + offsets, mask=in_row & (target != ignore_index), other=0.0).to(tl.float32)
    # g * p - g at the target, in the order torch's log_softmax backward computes it.
    grad = grad_loss * tl.exp(x - lse) - tl.where(offsets == target, grad_loss, 0.0)
    grad = tl.where(target == ignore_index, 0.0, grad)
    tl.store(out_ptr + offsets, round_to_dtype(grad, DTYPE), mask=in_row)


@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr,  # DTYPE* (N, C): row i starts at logits_ptr + i * logits_row_stride, columns contiguous
    logits_row_stride,
    target_ptr,  # int64* (N,): class index of row i at target_ptr + i * target_stride
    target_stride,
    losses_ptr,  # float32* (N,) out: loss per row (0 for ignored rows, NaN for out-of-range targets)
    lse_ptr,  # float32* (N,) out: logsumexp per row
    num_classes,
    ignore_index,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row * target_stride)
    lse = _row_logsumexp(row_ptr, num_classes, BLOCK_SIZE)
    tl.store(losses_ptr + row, _row_loss(row_ptr, target, lse, num_classes, ignore_index))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_forward_with_grad_kernel(
    logits_ptr,  # DTYPE* (N, C) contiguous, in: the logits; out: softmax - onehot, rounded to DTYPE
    target_ptr,  # int64* (N,): class index of row i at target_ptr + i * target_stride
    target_stride,
    losses_ptr,  # float32* (N,) out: loss per row, as _cross_entropy_forward_kernel's
    num_classes,
    ignore_index,
    DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * num_classes
    target = tl.load(target_ptr + row * target_stride)
    lse = _row_logsumexp(row_ptr, num_classes, BLOCK_SIZE)
    # The target's logit is read here, before the loop below overwrites the row.
    tl.store(losses_ptr + row, _row_loss(row_ptr, target, lse, num_classes, ignore_index))
    # Every warp reads that logit, and in the loop below one of them writes its gradient there:
    # without this barrier a warp running ahead did so before a slower one had read it, in about 2
    # rows in a million on an H200 (their loss then held the gradient's value). It costs nothing
    # measurable: 1.144 ms with and without it on GPT-2's fp16 logits.
    tl.debug_barrier()

    in_range = (target >= 0) & (target < num_classes)
    # The backward kernel's math with an upstream gradient of 1 (NaN for an out-of-range target).
    unit = tl.where(in_range, 1.0, float("nan"))
    columns = tl.arange(0, BLOCK_SIZE)
    # Last block first: the end of the row, read last by the logsumexp pass, is the part most
    # likely still in L2 (a GPT row is 100 KB in fp16). On an H200, GPT-2's logits took 1.17 ms
    # this way against 1.23 ms in row order; the order changes no value.
    num_blocks = tl.cdiv(num_classes, BLOCK_SIZE)
    for block in range(0, num_blocks):
        offsets = (num_blocks - 1 - block) * BLOCK_SIZE + columns
        # Each element is read before it is written, by this program only.
        _row_gradient_block(row_ptr, row_ptr, offsets, num_classes, target, lse, unit, ignore_index, DTYPE)


@triton.jit
def _cross_entropy_backward_kernel(
    grad_losses_ptr,  # float32* (N,): upstream gradient of row i's loss at grad_losses_ptr + i * stride
    grad_losses_stride,  # 0 for an expanded gradient (the backward of a sum or mean)
    logits_ptr,  # DTYPE* (N, C): as in the forward
    logits_row_stride,
    target_ptr,  # int64* (N,)
    target_stride,
    lse_ptr,  # float32* (N,): the forward's logsumexp of row i at lse_ptr + i * lse_stride
    lse_stride,
    grad_logits_ptr,  # DTYPE* (N, C) out, contiguous
    num_classes,
    ignore_index,
    DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    out_ptr = grad_logits_ptr + row * num_classes
    target = tl.load(target_ptr + row * target_stride)
    lse = tl.load(lse_ptr + row * lse_stride)
    in_range = (target >= 0) & (target < num_classes)
    grad_loss = tl.load(grad_losses_ptr + row * grad_losses_stride)
    grad_loss = tl.where(in_range, grad_loss, float("nan"))
    columns = tl.arange(0, BLOCK_SIZE)

    for start in range(0, num_classes, BLOCK_SIZE):
        offsets = start + columns
        _row_gradient_block(
            row_ptr, out_ptr, offsets, num_classes, target, lse, grad_loss, ignore_index, DTYPE
        )


def _launch_shape(num_classes: int) -> tuple[int, int]:
    """(block size, num_warps) for rows of ``num_classes``: LAUNCH, shrunk to fit narrow rows."""
    block_size = min(LAUNCH.block_size, triton.next_power_of_2(num_classes))
    num_warps = max(1, min(LAUNCH.num_warps, block_size // (32 * _MIN_ELEMENTS_PER_THREAD)))
    return block_size, num_warps


def _rows_contiguous(logits: Tensor) -> Tensor:
    return logits if logits.stride(1) == 1 or logits.shape[1] == 1 else logits.contiguous()


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy of ``logits`` (N, C; fp16, bf16 or fp32) against class indices
    ``target`` (N,; int64), computed in fp32: ``(losses, lse)``, the contract of
    ``amp_fx.kernels.cross_entropy``.

    Example:
        >>> logits = torch.randn(4, 50304, dtype=torch.float16, device="cuda")  # doctest: +SKIP
        >>> target = torch.tensor([3, 7, -100, 50303], device="cuda")  # doctest: +SKIP
        >>> losses, lse = cross_entropy_forward(logits, target, -100)  # doctest: +SKIP
    """
    check_cross_entropy_arguments(logits, target, ignore_index)
    logits = _rows_contiguous(logits)
    num_rows, num_classes = logits.shape
    losses = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return losses, lse
    block_size, num_warps = _launch_shape(num_classes)
    with on_device(logits.device):
        _cross_entropy_forward_kernel[(num_rows,)](
            logits,
            logits.stride(0),
            target,
            target.stride(0),
            losses,
            lse,
            num_classes,
            ignore_index,
            BLOCK_SIZE=block_size,
            num_warps=num_warps,
        )
    return losses, lse


def cross_entropy_backward(
    grad_losses: Tensor,
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    out: Tensor | None = None,
) -> Tensor:
    """Gradient of the per-row losses w.r.t. ``logits``, in the logits' dtype: the contract of
    ``amp_fx.kernels.cross_entropy``. With ``out=logits`` each element is read before it is
    written, by the same program.

    Example:
        >>> grad_losses = torch.ones_like(losses)  # doctest: +SKIP
        >>> grad = cross_entropy_backward(grad_losses, logits, target, lse, -100)  # doctest: +SKIP
    """
    check_cross_entropy_arguments(logits, target, ignore_index, lse=lse, grad_losses=grad_losses, out=out)
    logits = _rows_contiguous(logits)
    num_rows, num_classes = logits.shape
    grad_logits = out if out is not None else torch.empty_like(logits, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return grad_logits
    block_size, num_warps = _launch_shape(num_classes)
    with on_device(logits.device):
        _cross_entropy_backward_kernel[(num_rows,)](
            grad_losses,
            grad_losses.stride(0),
            logits,
            logits.stride(0),
            target,
            target.stride(0),
            lse,
            lse.stride(0),
            grad_logits,
            num_classes,
            ignore_index,
            DTYPE=triton_dtype(logits.dtype),
            BLOCK_SIZE=block_size,
            num_warps=num_warps,
        )
    return grad_logits


def cross_entropy_forward_with_grad(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """`cross_entropy_forward`'s losses, and the unscaled gradient written over ``logits``: the
    contract of ``amp_fx.kernels.cross_entropy``. One kernel: a pass for the logsumexp, a second
    that reads each element and writes its gradient in its place.

    Example:
        >>> logits = torch.randn(4, 50304, dtype=torch.float16, device="cuda")  # doctest: +SKIP
        >>> losses = cross_entropy_forward_with_grad(logits, target, -100)  # doctest: +SKIP
    """
    check_cross_entropy_arguments(logits, target, ignore_index)
    check_logits_overwritable(logits)
    num_rows, num_classes = logits.shape
    losses = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return losses
    block_size, num_warps = _launch_shape(num_classes)
    with on_device(logits.device):
        _cross_entropy_forward_with_grad_kernel[(num_rows,)](
            logits,
            target,
            target.stride(0),
            losses,
            num_classes,
            ignore_index,
            DTYPE=triton_dtype(logits.dtype),
            BLOCK_SIZE=block_size,
            num_warps=num_warps,
        )
    return losses
