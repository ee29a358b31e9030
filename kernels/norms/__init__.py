"""RMSNorm and LayerNorm over the last dimension, with an optional residual add before them,
reading fp16/bf16/fp32 and computing in fp32: the kernel family's contract.

Two implementations take the same arguments and return the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the checks both run. ``amp_fx.ops.norms`` is the op built on them.

The math, per row of D values, in fp32. With a residual, the row normalized is their sum, rounded
to ``sum_dtype`` as torch's add rounds it (and returned); without one it is x::

    s     = round_sum(x + residual)                          (or x)
    mean  = sum(s) / D        c = s - mean                   (LayerNorm: subtract_mean)
                              c = s                          (RMSNorm)
    rstd  = 1 / sqrt(sum(c^2) / D + eps)
    n     = round_mid(c * rstd)                              (only with a mid_dtype)
    w'    = round_w(w + weight_offset)                       (only with an offset: Gemma's 1 + w)
    y     = round_product(w' * n + b)                        (w' = 1, b = 0 when absent)
    out   = y.to(out_dtype)

``round_X`` rounds an fp32 value to that dtype and back, as the graph's cast or op in that dtype
did; so the kernels compute, up to fp32 summation order, what the chain of torch ops they replace
computed. With a ``mid_dtype`` that order can show: mean and rstd summed in another order differ
in their last bits, an n at a rounding midpoint of ``mid_dtype`` then rounds to the other
neighbour, and ``out`` and ``grad_weight`` differ by one unit of ``mid_dtype`` at that n (about
one element in 10^4 for bf16). The backward (dy the upstream gradient of out in fp32, g_s that of
the returned sum from its other readers, zero when none), with the roundings taken as identities::

    dn            = dy * w'
    grad_weight   = sum over rows of dy * n      grad_bias = sum over rows of dy     (in fp32)
    ds            = rstd * (dn - mean(dn) - n * mean(dn * n)) + g_s     (RMSNorm: no mean(dn))
    grad_x        = ds.to(grad dtype)            grad_residual = ds.to(residual grad dtype)

The kernels (``KERNELS``), on 2-D (rows, D) tensors whose rows are contiguous:

- ``norm_forward(x, weight, bias, eps, *, residual=None, subtract_mean=False, weight_offset=0.0,
  mid_dtype=None, product_dtype=torch.float32, out_dtype=None, sum_dtype=None, record=None)
  -> (out, summed, mean, rstd)``: ``out`` (rows, D) in ``out_dtype`` (x's when None); ``summed``
  the (rows, D) sum in ``sum_dtype`` (torch's promotion of x and residual when None), None
  without a residual; ``mean`` float32 (rows,) for LayerNorm, None for RMSNorm; ``rstd`` float32
  (rows,). weight and bias are (D,) vectors of any float dtype, or None. ``record``: None, or
  ``(amax, counts, (out_index, sum_index))`` (``amp_fx.kernels.range_stats``' ``KernelRecord``):
  the range statistics of out and of the sum (an index None: not recorded) added to those entries
  by the same launch, as ``record_range_`` of each would add them.
- ``norm_backward(grad_out, grad_sum, normalized, weight, mean, rstd, *, bias_dtype=None,
  subtract_mean=False, weight_offset=0.0, mid_dtype=None, grad_dtype, residual_grad_dtype=None)
  -> (grad_x, grad_residual, grad_weight, grad_bias)``: ``normalized`` is the forward's s (x, or
  the returned sum); ``grad_sum`` (rows, D) or None. grad_x in ``grad_dtype``; grad_residual in
  ``residual_grad_dtype``, None when that is None; grad_weight in weight's dtype (None without a
  weight), grad_bias in ``bias_dtype`` (None when that is None).

Every output is a tensor of its own: none shares memory with an input or another output (the
op returns them as a custom op's outputs, which may alias nothing). Neither implementation reads a
tensor value on the host.
"""

KERNELS = ("norm_forward", "norm_backward")
