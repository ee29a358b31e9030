"""Fused rotary position embeddings of fp16/bf16/fp32 tensors, computed in fp32.

What: the family's contract, ``amp_fx.kernels.rotary``, which has the math.

Why fused: ``q * cos + rotate_half(q) * sin`` from torch parts is six kernels (two slices copied by
the concatenation, a negation, two products and a sum), each reading and writing a tensor of q's
size, and at O2 the products run in fp32 (cos and sin are fp32), so half of that traffic is fp32;
the backward repeats it. Here one kernel reads q once and writes the result once, each way, in
the dtypes the graph asks for, and cos and sin (one row per position, shared by every head) are
read once per position from cache.

How: each tensor is seen as 4-D (A0, A1, A2, D) with its own strides, cos and sin as views
broadcast to (A0, A1, A2, R) (stride 0 where they broadcast). The wrapper puts the leading
dimension along which cos and sin do not change (the heads) at A1, so one program takes one
(i0, i2) position and loops over its heads BLOCK_H at a time: a [BLOCK_H, R/2] tile of pairs (a, b)
and the cos/sin values at both features of each pair, then the D - R pass-through features.
Loads and stores follow each tensor's strides, so the transposed q of a [batch, heads, seq, dim]
view is read in place. A query and a key that differ only in their head counts are rotated by the
same program, one after the other: one launch, and each position's table row read from memory
once for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.devices import on_device
from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.kernels.range_stats.arguments import check_kernel_record
from amp_fx.kernels.range_stats.triton import (
    add_statistics,
    block_statistics,
    record_block,
    record_constexprs,
)
from amp_fx.kernels.rotary.arguments import check_rotary_tensors
from amp_fx.kernels.rounding import round_to_dtype

__all__ = ["rotary_backward", "rotary_forward"]

# Elements of pairs per tile: 2048 pairs (4096 features) with 4 warps is 32 pairs per thread, enough
# loads in flight per program for a memory-bound kernel without spilling.
_PAIRS_PER_TILE = 2048
_NUM_WARPS = 4
_MAX_DIMS = 4


@triton.jit
def _rotate_heads(
    x_row,  # the position's first element of x: x_row + h * xs1 + f * xs3 is head h, feature f
    xs1,
    xs3,
    out_row,  # the same position of the output, with its own strides
    os1,
    os3,
    cos_row,  # the position's table rows (stride 0 along the heads when shared, as they are)
    cs1,
    cs3,
    sin_row,
    ss1,
    ss3,
    num_heads,
    width,  # D: features of x
    rotary_width,  # R: features rotated (even, <= D)
    record_amax_ptr,  # with RECORD: the range statistics' amax and counts, out's entry, its numel,
    record_counts_ptr,
    record_index,
    record_numel,
    adds_numel,  # and whether this program adds that numel (one program per tensor does)
    INTERLEAVED: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    RECORD: tl.constexpr,
    BITS_DTYPE: tl.constexpr,  # range_stats' bit_layout of OUT_DTYPE, with RECORD
    EXPONENT_MASK: tl.constexpr,
    MAGNITUDE_MASK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Rotate every head of one position, BLOCK_H heads at a time (and with RECORD, add the range
    statistics of what it stores: one atomic each per BLOCK_H heads, and per pass-through block)."""
    half = rotary_width // 2
    pairs = tl.arange(0, BLOCK_PAIRS)[None, :]
    if INTERLEAVED:
        feature_a = 2 * pairs
        feature_b = feature_a + 1
    else:
        feature_a = pairs
        feature_b = pairs + half
    heads = tl.arange(0, BLOCK_H)[:, None]
    for head_start in range(0, num_heads, BLOCK_H):
        head = (head_start + heads).to(tl.int64)
        mask = (head < num_heads) & (pairs < half)
        a = tl.load(x_row + head * xs1 + feature_a * xs3, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + head * xs1 + feature_b * xs3, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_row + head * cs1 + feature_a * cs3, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_row + head * cs1 + feature_b * cs3, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_row + head * ss1 + feature_a * ss3, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_row + head * ss1 + feature_b * ss3, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSED:
            new_a = a * c1 + b * s2
            new_b = b * c2 - a * s1
        else:
            new_a = a * c1 - b * s1
            new_b = b * c2 + a * s2
        stored_a = round_to_dtype(new_a, OUT_DTYPE)
        stored_b = round_to_dtype(new_b, OUT_DTYPE)
        tl.store(out_row + head * os1 + feature_a * os3, stored_a, mask=mask)
        tl.store(out_row + head * os1 + feature_b * os3, stored_b, mask=mask)
        if RECORD:
            largest_a, underflow_a, nonfinite_a = block_statistics(
                stored_a, mask, BITS_DTYPE, EXPONENT_MASK, MAGNITUDE_MASK
            )
            largest_b, underflow_b, nonfinite_b = block_statistics(
                stored_b, mask, BITS_DTYPE, EXPONENT_MASK, MAGNITUDE_MASK
            )
            add_statistics(
                record_amax_ptr, record_counts_ptr, record_index, tl.maximum(largest_a, largest_b),
                underflow_a + underflow_b, nonfinite_a + nonfinite_b, record_numel,
                adds_numel & (head_start == 0),
            )  # fmt: skip
        # Features past R pass through (partial rotary, GPT-NeoX and Phi), converted to OUT_DTYPE.
        for pass_start in range(rotary_width, width, BLOCK_PASS):
            feature = pass_start + tl.arange(0, BLOCK_PASS)[None, :]
            pass_mask = (head < num_heads) & (feature < width)
            value = tl.load(x_row + head * xs1 + feature * xs3, mask=pass_mask, other=0.0).to(tl.float32)
            stored = round_to_dtype(value, OUT_DTYPE)
            tl.store(out_row + head * os1 + feature * os3, stored, mask=pass_mask)
            if RECORD:
                record_block(
                    stored, pass_mask, record_amax_ptr, record_counts_ptr, record_index, record_numel,
                    False, BITS_DTYPE, EXPONENT_MASK, MAGNITUDE_MASK,
                )  # fmt: skip


# The entries are never specialized: each watched node records at an index of its own.
@triton.jit(do_not_specialize=["x_index", "y_index"])
def _rotary_kernel(
    x_ptr,  # first tensor (A0, A1, A2, D), any strides: (i0, i1, i2, f) at x_ptr + i0*xs0 + ... + f*xs3
    xs0,
    xs1,
    xs2,
    xs3,
    out_ptr,  # its output, OUT_DTYPE, with its own strides
    os0,
    os1,
    os2,
    os3,
    num_heads,  # its A1: the dimension each program loops over (the heads)
    y_ptr,  # second tensor (A0, B1, A2, D) (a key beside the query), or x again when HAS_SECOND is False
    ys0,
    ys1,
    ys2,
    ys3,
    y_out_ptr,  # its output, Y_OUT_DTYPE
    yos0,
    yos1,
    yos2,
    yos3,
    y_num_heads,  # B1
    cos_ptr,  # (A0, A1, A2, R) broadcast view: stride 0 along the dimensions cos is shared over
    cs0,
    cs1,
    cs2,
    cs3,
    sin_ptr,  # as cos, with its own strides
    ss0,
    ss1,
    ss2,
    ss3,
    size2,  # A2
    width,  # D
    rotary_width,  # R
    record_amax_ptr,  # float32*: the range statistics' amax, with RECORD_X or RECORD_Y
    record_counts_ptr,  # int64*: their counts
    x_index,  # the entry of the first output's statistics, with RECORD_X
    x_numel,  # its element count
    y_index,  # the same for the second output, with RECORD_Y
    y_numel,
    HAS_SECOND: tl.constexpr,
    INTERLEAVED: tl.constexpr,  # pairs (2j, 2j + 1) instead of (j, j + R/2)
    TRANSPOSED: tl.constexpr,  # the backward: rotation by -sin
    OUT_DTYPE: tl.constexpr,
    Y_OUT_DTYPE: tl.constexpr,
    RECORD_X: tl.constexpr,
    X_BITS_DTYPE: tl.constexpr,  # range_stats' bit_layout of OUT_DTYPE, with RECORD_X
    X_EXPONENT_MASK: tl.constexpr,
    X_MAGNITUDE_MASK: tl.constexpr,
    RECORD_Y: tl.constexpr,
    Y_BITS_DTYPE: tl.constexpr,  # of Y_OUT_DTYPE, with RECORD_Y
    Y_EXPONENT_MASK: tl.constexpr,
    Y_MAGNITUDE_MASK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    position = tl.program_id(0).to(tl.int64)
    i0 = position // size2
    i2 = position % size2
    cos_row = cos_ptr + i0 * cs0 + i2 * cs2
    sin_row = sin_ptr + i0 * ss0 + i2 * ss2
    _rotate_heads(
        x_ptr + i0 * xs0 + i2 * xs2, xs1, xs3, out_ptr + i0 * os0 + i2 * os2, os1, os3,
        cos_row, cs1, cs3, sin_row, ss1, ss3, num_heads, width, rotary_width,
        record_amax_ptr, record_counts_ptr, x_index, x_numel, position == 0,
        INTERLEAVED, TRANSPOSED, OUT_DTYPE, RECORD_X, X_BITS_DTYPE, X_EXPONENT_MASK, X_MAGNITUDE_MASK,
        BLOCK_H, BLOCK_PAIRS, BLOCK_PASS,
    )  # fmt: skip
    if HAS_SECOND:
        # The same position's table rows, still in cache.
        _rotate_heads(
            y_ptr + i0 * ys0 + i2 * ys2, ys1, ys3, y_out_ptr + i0 * yos0 + i2 * yos2, yos1, yos3,
            cos_row, cs1, cs3, sin_row, ss1, ss3, y_num_heads, width, rotary_width,
            record_amax_ptr, record_counts_ptr, y_index, y_numel, position == 0,
            INTERLEAVED, TRANSPOSED, Y_OUT_DTYPE, RECORD_Y, Y_BITS_DTYPE, Y_EXPONENT_MASK, Y_MAGNITUDE_MASK,
            BLOCK_H, BLOCK_PAIRS, BLOCK_PASS,
        )  # fmt: skip


def _four_dims(t: Tensor) -> Tensor:
    return t.reshape((1,) * (_MAX_DIMS - t.dim()) + tuple(t.shape)) if t.dim() < _MAX_DIMS else t


@dataclass(frozen=True)
class _Operand:
    """One tensor and its output as the kernel sees them: 4-D views, the loop dimension second;
    and the entry the output's range statistics go to (None: not recorded)."""

    x: Tensor
    out: Tensor
    cos: Tensor
    sin: Tensor
    record_index: int | None = None


def _operand(
    x: Tensor, cos: Tensor, sin: Tensor, out: Tensor, loop: int | None, record_index: int | None
) -> tuple[_Operand, int]:
    """x, out and the tables as (A0, A1, A2, D) views with A1 the loop dimension: ``loop`` if given,
    else the largest leading dimension cos and sin are shared over (the heads)."""
    rotated_shape = (*x.shape[:-1], cos.shape[-1])
    views = [_four_dims(t) for t in (x, out, cos.expand(rotated_shape), sin.expand(rotated_shape))]
    if loop is None:
        shared = [d for d in range(_MAX_DIMS - 1) if views[2].stride(d) == 0 and views[3].stride(d) == 0]
        loop = max(shared, key=lambda d: views[0].shape[d]) if shared else 1
    outer, inner = (d for d in range(_MAX_DIMS - 1) if d != loop)
    x4, out4, cos4, sin4 = (t.permute(outer, loop, inner, _MAX_DIMS - 1) for t in views)
    return _Operand(x4, out4, cos4, sin4, record_index), loop


def _shares_launch(first: _Operand, second: _Operand) -> bool:
    """Whether one program per position can rotate both: the same positions, and tables shared
    over the loop dimension for both (then their views agree everywhere else)."""
    same_positions = first.x.shape[0] == second.x.shape[0] and first.x.shape[2:] == second.x.shape[2:]
    # Along a loop dimension of size 1 (a single key head) the tables' stride is never used.
    shared = all(
        operand.x.shape[1] == 1 or (operand.cos.stride(1) == 0 and operand.sin.stride(1) == 0)
        for operand in (first, second)
    )
    return same_positions and shared


def _table_strides(table: Tensor, shared: bool) -> tuple[int, ...]:
    """The table's strides, 0 along the loop dimension where two tensors share it."""
    strides = table.stride()
    return (strides[0], 0, *strides[2:]) if shared else strides


def _record_arguments(operand: _Operand | None, prefix: str) -> tuple[tuple[int, int], dict[str, object]]:
    """((entry, numel), constexprs) of an operand's range record; fixed ones where it records
    none (no kernel variant per unused dtype)."""
    recorded = operand is not None and operand.record_index is not None
    layout = record_constexprs(operand.out.dtype if recorded else None, f"{prefix}_")
    constexprs = {f"RECORD_{prefix}": recorded, **layout}
    if not recorded:
        return (0, 0), constexprs
    return (operand.record_index, operand.out.numel()), constexprs


def _launch(
    first: _Operand,
    second: _Operand | None,
    interleaved: bool,
    transposed: bool,
    statistics: tuple[Tensor, Tensor] | None,
) -> None:
    size0, num_heads, size2, width = first.x.shape
    rotary_width = first.cos.shape[-1]
    heads = max(num_heads, second.x.shape[1] if second is not None else 0)
    block_pairs = triton.next_power_of_2(max(rotary_width // 2, 1))
    block_h = max(1, min(triton.next_power_of_2(heads), _PAIRS_PER_TILE // block_pairs))
    block_pass = max(16, min(triton.next_power_of_2(max(width - rotary_width, 1)), 2 * block_pairs))
    other = second if second is not None else first
    amax, counts = statistics or (first.cos, first.cos)
    x_record, x_constexprs = _record_arguments(first, "X")
    y_record, y_constexprs = _record_arguments(second, "Y")
    with on_device(first.x.device):
        _rotary_kernel[(size0 * size2,)](
            first.x, *first.x.stride(), first.out, *first.out.stride(), num_heads,
            other.x, *other.x.stride(), other.out, *other.out.stride(), other.x.shape[1],
            first.cos, *_table_strides(first.cos, second is not None),
            first.sin, *_table_strides(first.sin, second is not None),
            size2, width, rotary_width,
            amax, counts, *x_record, *y_record,
            HAS_SECOND=second is not None,
            INTERLEAVED=interleaved,
            TRANSPOSED=transposed,
            OUT_DTYPE=triton_dtype(first.out.dtype),
            Y_OUT_DTYPE=triton_dtype(other.out.dtype),
            **x_constexprs,
            **y_constexprs,
            BLOCK_H=block_h,
            BLOCK_PAIRS=block_pairs,
            BLOCK_PASS=block_pass,
            num_warps=_NUM_WARPS,
        )  # fmt: skip


def _rotate(
    xs: Sequence[Tensor],
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    out_dtypes: Sequence[torch.dtype],
    transposed: bool,
    record: KernelRecord | None = None,
) -> list[Tensor]:
    check_rotary_tensors(xs, cos, sin, interleaved, out_dtypes)
    for x in xs:
        if x.dim() > _MAX_DIMS:
            raise ValueError(
                f"the Triton rotary kernels take at most {_MAX_DIMS} dimensions, got {x.dim()}; "
                "use amp_fx.kernels.reference.rotary_forward/rotary_backward"
            )
    outs = [torch.empty_like(x, dtype=d) for x, d in zip(xs, out_dtypes, strict=True)]
    if record is not None:
        check_kernel_record(record, outs)
    indices = record[2] if record is not None else (None,) * len(xs)
    operands: list[_Operand] = []
    loop = None
    for x, out, index in zip(xs, outs, indices, strict=True):
        if out.numel() > 0:
            operand, loop = _operand(x, cos, sin, out, loop if x.dim() == xs[0].dim() else None, index)
            operands.append(operand)
    statistics = None if record is None else record[:2]
    if len(operands) == 2 and _shares_launch(*operands):
        _launch(operands[0], operands[1], interleaved, transposed, statistics)
    else:
        for operand in operands:
            _launch(operand, None, interleaved, transposed, statistics)
    return outs


def rotary_forward(
    xs: Sequence[Tensor],
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    out_dtypes: Sequence[torch.dtype],
    record: KernelRecord | None = None,
) -> list[Tensor]:
    """Each x's first ``cos.shape[-1]`` features rotated by (cos, sin), the rest passed through, in
    fp32, rounded once to its ``out_dtypes`` entry: the contract of ``amp_fx.kernels.rotary``. One
    launch for a query and a key that differ only in their head counts, which also records the
    range statistics of the outputs ``record`` asks for.

    Example:
        >>> q = torch.randn(8, 12, 2048, 128, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
        >>> k = torch.randn(8, 4, 2048, 128, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
        >>> cos = torch.randn(1, 1, 2048, 128, device="cuda"); sin = torch.randn_like(cos)  # doctest: +SKIP
        >>> q_out, k_out = rotary_forward([q, k], cos, sin, False, [torch.bfloat16] * 2)  # doctest: +SKIP
    """
    return _rotate(xs, cos, sin, interleaved, out_dtypes, transposed=False, record=record)


def rotary_backward(
    grad_outs: Sequence[Tensor],
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    out_dtypes: Sequence[torch.dtype],
) -> list[Tensor]:
    """The gradients of `rotary_forward` w.r.t. its xs (the transposed rotation), each in its
    ``out_dtypes`` entry; launched as the forward is.

    Example:
        >>> dq, dk = rotary_backward([g_q, g_k], cos, sin, False, [q.dtype, k.dtype])  # doctest: +SKIP
    """
    return _rotate(grad_outs, cos, sin, interleaved, out_dtypes, transposed=True)
