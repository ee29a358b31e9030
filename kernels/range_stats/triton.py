"""Range statistics of one tensor in one launch.

What: the family's contract, ``amp_fx.kernels.range_stats``: each program reads a run of
consecutive blocks of the value (its storage span, when the value is dense at any strides: the
statistics do not depend on the order), keeps the largest magnitude and the two counts in
registers, and adds them to the entry with one atomic each. The value is read once, in its own
dtype and widened to fp32 (exactly: fp16 and bf16 hold no value fp32 cannot).

Why atomics: a watched training step records a few hundred values, one launch each; a second
launch to combine partial results per value would double the launches. A maximum and integer sums
are the same whatever order the atomics land in, so the results are deterministic.

Grid: at most ``_PROGRAMS_PER_SM`` programs per streaming multiprocessor (each then loops over
``blocks_per_program`` blocks), so a large value costs a few hundred atomics per entry, not one
per block.

`record_block` (its constexprs from `record_constexprs`) is the same statistics for a fused kernel that
writes a watched value (``record=`` in the family's contract): each program adds its stored block
(or sums its blocks with `block_statistics` and adds them once, with `add_statistics`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.arguments import is_dense
from amp_fx.kernels.devices import on_device
from amp_fx.kernels.range_stats.arguments import check_record_range

__all__ = [
    "add_statistics",
    "bit_layout",
    "block_statistics",
    "record_block",
    "record_constexprs",
    "record_range_",
]

# Per value dtype: the integer type of its width, its exponent bits, every bit but the sign.
_BIT_LAYOUTS = {
    torch.float16: (torch.int16, tl.float16, 0x7C00, 0x7FFF),
    torch.bfloat16: (torch.int16, tl.bfloat16, 0x7F80, 0x7FFF),
    torch.float32: (torch.int32, tl.float32, 0x7F800000, 0x7FFFFFFF),
}
_BLOCK_SIZE = 1024
_NUM_WARPS = 4
_PROGRAMS_PER_SM = 4
# Programs for a launch on the CPU (the interpreter): few, so a test runs quickly.
_CPU_PROGRAMS = 4


@triton.jit
def _block_range(bits, VALUE_DTYPE: tl.constexpr, EXPONENT_MASK: tl.constexpr, MAGNITUDE_MASK: tl.constexpr):
    """Per element of a block of values given by their bits: (|value| widened to fp32, NaN as 0;
    1 where subnormal; 1 where inf or NaN)."""
    magnitude = tl.abs(bits.to(VALUE_DTYPE, bitcast=True).to(tl.float32))
    largest = tl.where(magnitude != magnitude, 0.0, magnitude)
    # |v| < inf is False exactly for inf and NaN.
    nonfinite = (~(magnitude < float("inf"))).to(tl.int32)
    # Subnormal: no exponent bits and not zero. Read from the bits, not compared as floats: a GPU
    # may flush an fp32 subnormal to zero in arithmetic.
    underflow = (((bits & EXPONENT_MASK) == 0) & ((bits & MAGNITUDE_MASK) != 0)).to(tl.int32)
    return largest, underflow, nonfinite


@triton.jit
def add_statistics(amax_ptr, counts_ptr, index, largest, underflow, nonfinite, numel, adds_numel):
    """Add one program's statistics (scalars: largest magnitude, underflow and inf/NaN counts) to
    entry ``index``: an atomic each, the counts only where not zero (most programs then pay one
    atomic, the maximum); a program with ``adds_numel`` (one per value) adds ``numel``, the value's
    element count."""
    tl.atomic_max(amax_ptr + index, largest)
    counts_ptr += 3 * index
    underflow = underflow.to(tl.int64)
    tl.atomic_add(counts_ptr, underflow, mask=underflow != 0)
    nonfinite = nonfinite.to(tl.int64)
    tl.atomic_add(counts_ptr + 1, nonfinite, mask=nonfinite != 0)
    if adds_numel:
        tl.atomic_add(counts_ptr + 2, numel.to(tl.int64))


@triton.jit
def block_statistics(
    value, inside, BITS_DTYPE: tl.constexpr, EXPONENT_MASK: tl.constexpr, MAGNITUDE_MASK: tl.constexpr
):
    """(largest magnitude, underflow count, inf/NaN count) of a block a fused kernel stores
    (``value`` in the value's dtype, lanes outside ``inside`` counting nothing), as scalars for
    `add_statistics`. The constexprs are `bit_layout`'s for the value's dtype."""
    bits = value.to(BITS_DTYPE, bitcast=True)
    bits = tl.where(inside, bits, tl.zeros_like(bits))
    largest, underflow, nonfinite = _block_range(bits, value.dtype, EXPONENT_MASK, MAGNITUDE_MASK)
    return tl.max(largest, axis=None), tl.sum(underflow, axis=None), tl.sum(nonfinite, axis=None)


@triton.jit
def record_block(
    value,
    inside,
    amax_ptr,
    counts_ptr,
    index,
    numel,
    adds_numel,
    BITS_DTYPE: tl.constexpr,
    EXPONENT_MASK: tl.constexpr,
    MAGNITUDE_MASK: tl.constexpr,
):
    """For a fused kernel that writes a value: add the statistics of the block it stores to entry
    ``index`` (`block_statistics`, then `add_statistics`)."""
    largest, underflow, nonfinite = block_statistics(value, inside, BITS_DTYPE, EXPONENT_MASK, MAGNITUDE_MASK)
    add_statistics(amax_ptr, counts_ptr, index, largest, underflow, nonfinite, numel, adds_numel)


def bit_layout(dtype: torch.dtype) -> dict[str, object]:
    """`record_block`'s constexprs for values of ``dtype``, by their names there.

    Example:
        >>> bit_layout(torch.float16)["EXPONENT_MASK"]
        31744
    """
    _, _, exponent_mask, magnitude_mask = _BIT_LAYOUTS[dtype]
    bits = tl.int32 if dtype == torch.float32 else tl.int16
    return {"BITS_DTYPE": bits, "EXPONENT_MASK": exponent_mask, "MAGNITUDE_MASK": magnitude_mask}


def record_constexprs(dtype: torch.dtype | None, prefix: str = "") -> dict[str, object]:
    """A fused kernel's `bit_layout` constexprs for the value it records, of ``dtype``, each name
    after ``prefix``; None (a value it does not record): float32's, so that no kernel variant is
    compiled per dtype of a value nothing records.

    Example:
        >>> record_constexprs(None, "OUT_") == record_constexprs(torch.float32, "OUT_")
        True
    """
    layout = bit_layout(torch.float32 if dtype is None else dtype)
    return {f"{prefix}{name}": value for name, value in layout.items()}


# numel is never specialized (a one-element value would make it a constant, which has no ``.to``),
# nor the entry: each watched node records at an index of its own, and one compiled kernel serves them.
@triton.jit(do_not_specialize=["numel", "index"])
def _record_range_kernel(
    bits_ptr,  # the value's storage span: numel elements, read as integers of their width
    numel,
    blocks_per_program,
    amax_ptr,  # float32: the statistics' largest magnitudes (atomic max into entry ``index``)
    counts_ptr,  # int64: three counts per entry: underflow, non-finite, elements (atomic adds)
    index,
    VALUE_DTYPE: tl.constexpr,  # fp16, bf16 or fp32: the value's element type
    EXPONENT_MASK: tl.constexpr,  # the bits of its exponent
    MAGNITUDE_MASK: tl.constexpr,  # every bit but the sign
    BLOCK_SIZE: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    block = tl.arange(0, BLOCK_SIZE)
    largest = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    underflow = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    nonfinite = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    first = program * blocks_per_program * BLOCK_SIZE
    for i in range(blocks_per_program):
        offsets = first + i * BLOCK_SIZE + block
        bits = tl.load(bits_ptr + offsets, mask=offsets < numel, other=0)
        block_largest, block_underflow, block_nonfinite = _block_range(
            bits, VALUE_DTYPE, EXPONENT_MASK, MAGNITUDE_MASK
        )
        largest = tl.maximum(largest, block_largest)
        underflow += block_underflow
        nonfinite += block_nonfinite
    add_statistics(
        amax_ptr,
        counts_ptr,
        index,
        tl.max(largest, axis=0),
        tl.sum(underflow, axis=0),
        tl.sum(nonfinite, axis=0),
        numel,
        program == 0,
    )


@functools.cache
def _max_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_PROGRAMS
    return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def record_range_(value: Tensor, amax: Tensor, counts: Tensor, index: int) -> None:
    """Accumulate the largest magnitude and the underflow, non-finite and element counts of
    ``value`` into entry ``index``: the contract of ``amp_fx.kernels.range_stats``."""
    check_record_range(value, amax, counts, index)
    numel = value.numel()
    if numel == 0:
        return  # adds 0 to every count and leaves the maximum
    # A dense value at any strides is read as its storage span; another (a slice) is copied.
    flat = value.as_strided((numel,), (1,)) if is_dense(value) else value.reshape(-1)
    blocks = triton.cdiv(numel, _BLOCK_SIZE)
    programs = min(blocks, _max_programs(value.device))
    blocks_per_program = triton.cdiv(blocks, programs)
    programs = triton.cdiv(blocks, blocks_per_program)
    bits_dtype, value_dtype, exponent_mask, magnitude_mask = _BIT_LAYOUTS[value.dtype]
    with on_device(value.device):
        _record_range_kernel[(programs,)](
            flat.view(bits_dtype),
            numel,
            blocks_per_program,
            amax,
            counts,
            index,
            VALUE_DTYPE=value_dtype,
            EXPONENT_MASK=exponent_mask,
            MAGNITUDE_MASK=magnitude_mask,
            BLOCK_SIZE=_BLOCK_SIZE,
            num_warps=_NUM_WARPS,
        )
