"""Value-range statistics of one tensor, accumulated into a slot of a statistics row: the kernel
family's contract. `amp_fx.ops.range_record` (what `amp_fx.watch` puts into a converted graph)
calls it on each watched value, in the forward and on its gradient in the backward.

Two implementations take the same arguments and compute the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``; one launch
reading the value once); ``arguments`` holds the checks both run.

The kernel (``KERNELS``): ``record_range_(value, amax, counts, index) -> None``. ``value`` is a
float16, bfloat16 or float32 tensor of any shape and strides; ``amax`` is a contiguous float32
tensor and ``counts`` a contiguous int64 tensor holding three counts per entry of ``amax``, on
the value's device. With ``tiny`` the smallest normal number of the value's dtype::

    amax.view(-1)[index]       = max(that, max over k of |value[k]| where value[k] is not NaN)
    counts.view(-1)[3 * index] += #{k : 0 < |value[k]| < tiny}            (underflowing values)
    counts.view(-1)[3 * index + 1] += #{k : value[k] is inf or NaN}
    counts.view(-1)[3 * index + 2] += value.numel()

An inf counts in the largest magnitude (it is inf then) and as non-finite; a NaN only as
non-finite. The maximum and the integer sums do not depend on the order the elements are read in,
so both implementations give the same bits. Neither reads a tensor value on the host.

Recorded by the kernel that writes the value: a fused kernel of another family (``norms``,
``activations``, ``rotary``) takes an optional ``record=(amax, counts, indices)``
(`KernelRecord`), ``indices`` holding one entry per value the kernel writes, in its contract's
order (None: that one is not recorded). It then adds to each entry what ``record_range_(value,
amax, counts, index)`` would add for the value as stored (rounded to its dtype), in the same
launch that writes it: the reference calls this family's reference on its outputs, the Triton
kernels use this family's Triton helpers on the blocks they store
(`amp_fx.kernels.range_stats.triton.record_block`), so both give the same bits.
``arguments.check_kernel_record`` holds its checks.
"""

from __future__ import annotations

from torch import Tensor

# A fused kernel's ``record`` argument: the statistics' amax and counts, and the entry of each value
# the kernel writes (None: not recorded).
KernelRecord = tuple[Tensor, Tensor, tuple[int | None, ...]]

KERNELS = ("record_range_",)

# The counts kept per entry, in order.
COUNT_FIELDS = ("underflow", "nonfinite", "numel")
