"""2-D max pooling of channels_last activations with 1-byte argmax offsets: the kernel family's
contract.

Two implementations take the same arguments and return the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the checks both run. ``amp_fx.ops.max_pool`` is the op built on them.

The math. For a 4-D channels_last input x (N, C, H, W) in fp16, bf16 or fp32 and a window of
KH x KW taps (kernel size, stride, padding, dilation: pairs of ints, as F.max_pool2d normalizes
them), output (oh, ow) looks at the taps (kh, kw) at::

    ih = oh * SH - PH + kh * DH        iw = ow * SW - PW + kw * DW
    out[n, c, oh, ow] = max over in-range taps of x[n, c, ih, iw]

scanning kh outer, kw inner. Padding taps never win. torch's rule picks the tap: the first
in-range tap is taken, then a later tap replaces it when ``val > best or isnan(val)`` (so the
first maximum wins, and the last NaN when there are NaNs). The forward writes the value and the
tap's offset ``kh * KW + kw`` as uint8 (1 byte where torch stores an int64 flat index; windows of
at most 256 taps). The backward gathers::

    dx[n, c, ih, iw] = sum over windows (oh, ow) whose winning tap is (ih, iw)
                       of grad_out[n, c, oh, ow]          (fp32, in (oh, ow) order, rounded once)

The kernels (``KERNELS``):

- ``max_pool2d_forward(input, kernel_size, stride, padding, dilation, ceil_mode, *, validate=True)
  -> (out, offsets)``: both channels_last (N, C, OH, OW), out in input's dtype, offsets uint8.
- ``max_pool2d_backward(grad_out, offsets, input_size, kernel_size, stride, padding, dilation, *,
  validate=True) -> grad_input``: grad_out in any strides; grad_input channels_last in
  grad_out's dtype.

``validate=False`` skips the argument checks, for callers that made them (``amp_fx.ops.max_pool``).
Neither implementation reads a tensor value on the host.
"""

KERNELS = ("max_pool2d_forward", "max_pool2d_backward")
