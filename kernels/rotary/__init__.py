"""Rotary position embeddings of fp16/bf16/fp32 tensors, computed in fp32: the kernel family's
contract.

Two implementations take the same arguments and return the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the checks both run. ``amp_fx.ops.rotary`` is the op built on them, and
``amp_fx.passes.fuse_rotary`` puts it in graphs.

The math. For x (..., D) (a query or key, heads anywhere among the leading dimensions) and
cos, sin (..., R) broadcastable to x[..., :R] (R even, R <= D; typically [batch or 1, seq, 1, R]
or [batch or 1, 1, seq, R]), the first R features are rotated in pairs (a, b) and the other D - R
pass through. The pairs are, for j < R / 2:

    halves      (``interleaved=False``, Llama's ``rotate_half``): a = x[j],    b = x[j + R/2]
    interleaved (``interleaved=True``, GPT-J's ``rotate_every_two``): a = x[2j], b = x[2j + 1]

with c1, s1 = cos, sin at a's feature and c2, s2 at b's. In fp32::

    forward     a' = a * c1 - b * s1        b' = b * c2 + a * s2
    backward    a' = a * c1 + b * s2        b' = b * c2 - a * s1      (the transpose: rotation by -sin)

The forward is exactly ``x * cos + rotate_half(x) * sin`` (or its interleaved twin) for any cos
and sin, not only the duplicated tables rotary embeddings build (cos[j] == cos[j + R/2]), so a
graph's chain can be replaced whatever values its cos and sin hold; the backward, applied to the
upstream gradient, is that map's transpose, the gradient w.r.t. x. Each result is rounded once to
the output dtype.

The kernels (``KERNELS``) take one or two tensors that share cos and sin (a query and a key):

- ``rotary_forward(xs, cos, sin, interleaved, out_dtypes, record=None) -> outs``: each x in ``xs``,
  cos and sin in fp16, bf16 or fp32 (each its own), any strides; each out in its ``out_dtypes``
  entry (fp16, bf16 or fp32), its x's shape, strides as ``torch.empty_like(x)`` gives them. A
  list. ``record``: None, or ``(amax, counts, indices)`` with an index (or None) per out
  (``amp_fx.kernels.range_stats``' ``KernelRecord``): the outs' range statistics added to those
  entries by the launch that writes them, as ``record_range_`` of each would add them.
- ``rotary_backward(grad_outs, cos, sin, interleaved, out_dtypes) -> grad_xs``: the same with the
  transposed rotation; ``out_dtypes`` are the xs' dtypes.

The Triton kernels take tensors of at most 4 dimensions, and rotate two tensors in one launch
when they differ only in the dimension cos and sin are shared over (a query's and a key's heads).
Neither implementation reads a tensor value on the host.
"""

KERNELS = ("rotary_forward", "rotary_backward")
