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
"""

KERNELS = ("record_range_",)

# The counts kept per entry, in order.
COUNT_FIELDS = ("underflow", "nonfinite", "numel")
