"""Cross-entropy over rows of fp16/bf16/fp32 logits, computed in fp32: the kernel family's contract.

Two implementations take the same arguments and return the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the checks both run. ``amp_fx.ops.cross_entropy`` is the op built on them
(``fp32_cross_entropy``, and ``linear_cross_entropy`` through ``cross_entropy_forward_with_grad``).

The math. For logits x (N, C) in fp16, bf16 or fp32 and int64 class indices t (N,), in fp32::

    lse_i  = logsumexp(x_i)                              (returned, and saved for the backward)
    loss_i = lse_i - x_i,t_i                             (0 where t_i == ignore_index)
    dx_ij  = g_i * exp(x_ij - lse_i) - g_i * [j == t_i]  (0 where t_i == ignore_index)
    dx     = dx.to(x.dtype)                              (rounded once)

g_i is the upstream gradient of loss_i (for a mean it already holds 1 / n_valid). A target
outside [0, C) that is not ``ignore_index`` is never used as an address: that row's loss and
gradient are NaN (torch raises instead, which would need a host synchronization).

The kernels (``KERNELS``):

- ``cross_entropy_forward(logits, target, ignore_index) -> (losses, lse)``: both float32 (N,).
- ``cross_entropy_backward(grad_losses, logits, target, lse, ignore_index, out=None) -> grad``:
  ``lse`` is the forward's; ``grad_losses`` float32 (N,), any stride. The gradient is contiguous,
  in the logits' dtype, written to ``out`` when given (contiguous, the logits' shape and dtype;
  ``out=logits`` overwrites the logits).
- ``cross_entropy_forward_with_grad(logits, target, ignore_index) -> losses``: the forward's
  float32 losses, with the gradient for g_i = 1 (``softmax(x_i) - onehot(t_i)``, unscaled)
  written over the logits, which must be contiguous. The caller applies the real g_i later (a
  fused linear + loss scales the matmuls' outputs instead of this [N, C] tensor).

Neither implementation reads a tensor value on the host.
"""

KERNELS = ("cross_entropy_forward", "cross_entropy_backward", "cross_entropy_forward_with_grad")
