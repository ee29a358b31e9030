"""FP8 matrix products with dynamic scaling: the kernel family's contract.

Hopper multiplies float8 at twice the bf16 rate. A product ``a @ b`` runs in FP8 as

    a (M, K)  ->  a_q, s_a = fp8_quantize(a, ...)      the dequantised a is a_q * s_a
    b (K, N)  ->  b_q, s_b = fp8_quantize(b, ...)
    out       =   fp8_scaled_mm(a_q, b_q, s_a, s_b)     = (a_q * s_a) @ (b_q * s_b), summed as below

Each operand is scaled along K, the dimension the product sums over, so that a scale is constant
over every sum it enters: one scale per tensor ("tensorwise"), or one per row of ``a`` and one
per column of ``b`` ("rowwise"). ``amp_fx.kernels.fp8.recipes`` says which products of a linear
layer run in FP8, in which format and with which scaling; ``amp_fx.ops.fp8_linear`` is the op built
on them.

The quantiser, per scaling group G (the whole tensor, or one row or column along K), in fp32::

    amax  = max over G of |t|                      (NaN when G holds a NaN)
    scale = FP8_MAX / max(amax, AMAX_FLOOR)        (rounded down to a power of 2 when asked)
    t_q   = fp8(clamp(t * scale, -FP8_MAX, FP8_MAX))     round to nearest even
    s     = 1 / scale                              the dequantisation scale the product takes

FP8_MAX is the format's largest finite value (448 for e4m3, 57344 for e5m2). AMAX_FLOOR (1e-12,
torchao's EPS) keeps an all-zero group finite: its scale is large and finite, its values 0, its
dequantised values 0, never ``0 * inf``. The clamp only catches a product ``t * scale`` that
rounds a hair above FP8_MAX (e5m2 would round it to inf; e4m3fn has no inf and saturates).

Non-finite values are never hidden: a plain cast to e4m3fn turns inf into 448, but here an inf in
G makes amax inf, scale 0 and s inf, so the inf itself becomes ``inf * 0 = NaN`` in t_q and every
product that reads G sums that NaN (and multiplies by s = inf): all of its outputs that read G
are NaN. A NaN in G makes amax, scale, every t_q of G and s NaN, with the same result. Nothing is
read on the host (no ``.item()``, no branch on a value), so a training step never synchronizes:
the non-finite output reaches the loss, and the loss scaler's check skips the step as it would
without FP8.

The kernels (``KERNELS``):

- ``fp8_quantize(tensor, fp8_dtype, *, along, power_of_two, column_major) -> (data, scale)``:
  ``tensor`` 2-D, fp16, bf16 or fp32, any strides; ``along`` is the dimension a scale is constant
  over (1: one scale per row, shape (rows, 1); 0: one per column, shape (1, columns); None: one for
  the tensor, shape ()); ``data`` has tensor's shape in ``fp8_dtype``, row-major, or column-major
  (its transpose contiguous) with ``column_major``, the layouts `fp8_scaled_mm` takes; ``scale``
  float32, the dequantisation scale s above.
- ``fp8_scaled_mm(a, b, scale_a, scale_b, *, bias=None, out_dtype) -> out``: ``torch._scaled_mm``
  behind CUDA's rules (``arguments``), checked on every device: a CPU run refuses what a GPU
  refuses. ``out`` (M, N) in ``out_dtype``, plus ``bias`` (N,) when given.

``reference`` implements both with torch ops; ``torch._scaled_mm`` is cuBLAS's (or CUTLASS's)
kernel on CUDA and a plain loop on the CPU. There is no Triton kernel yet: ``triton`` serves the
reference's functions, which run on CUDA as they are, until a fused quantiser (one read of t for
amax and cast) replaces ``fp8_quantize`` there. ``arguments`` holds the checks both run.

How the product sums. The CPU sums ``a_q @ b_q`` in fp32 (exactly the dequantised fp32 product
for float32 output), applies the scales and bias in fp32 and rounds once to ``out_dtype``. CUDA's
FP8 tensor cores (Ada, Hopper) sum with 13 fraction bits, not fp32's 23: each MMA instruction adds
the running sum and 32 products exactly after truncating each to 13 fraction bits below the
largest one's exponent, then truncates the sum to 13 fraction bits (the bit-accurate model of
MMA-Sim, arXiv 2511.10909; DeepSeek-V3 reports about 14 bits). cuBLAS moves the running sum to
fp32 only every few instructions: an H100's errors over 64 terms are those of no move at all. A
CUDA product of K terms thus errs by up to ``(K + 2 * ceil(K / 32)) * 2**-13 * sum |a_i b_i|``,
each FP8 subnormal counted as the least normal, before its scales, bias and rounding, in any
order and with any split of K: per instruction, under 2**-13 of the largest addend's power of 2
(a subnormal's is the least normal's) for each nonzero addend, the running sum included, and for
its result. That is well below the error of quantising the operands (e4m3's is 2**-4).
"""

import torch

KERNELS = ("fp8_quantize", "fp8_scaled_mm")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The largest finite value of each format: the scale maps a group's amax onto it.
FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in FP8_DTYPES}
# The least amax a scale is computed from (torchao's EPS): an all-zero group gets a finite scale.
AMAX_FLOOR = 1e-12
