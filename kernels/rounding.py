"""fp32 -> param dtype with round-to-nearest-even, the same bits as torch's ``tensor.to(dtype)``.

Why not ``x.to(tl.bfloat16)`` alone: on the GPU it rounds to nearest even (``cvt.rn.bf16.f32``),
but Triton's CPU interpreter truncates, so the kernels tested on CPU would not match torch. This
helper rounds fp32 -> bf16 with integer arithmetic, which is exact everywhere and costs a few
integer operations per element in a memory-bound kernel:

    bits(bf16) = (bits(x) + 0x7FFF + lowest kept bit) >> 16        (ties go to the even neighbour)

NaN keeps a quiet NaN (the carry could otherwise turn a NaN with only low mantissa bits into inf).
fp16 and fp32 use the plain cast, which rounds to nearest even on the GPU and in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """Round the fp32 tensor x to DTYPE (fp16, bf16 or fp32), to nearest, ties to even."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
