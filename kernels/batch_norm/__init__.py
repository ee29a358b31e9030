"""Training-mode BatchNorm + residual add + ReLU: the kernel family's contract.

Two implementations take the same arguments and return the same values: ``reference`` (plain
torch, any device) and ``triton`` (channels_last CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the checks both run. ``amp_fx.ops.batch_norm`` is the op built on them.

The math. For an input x (N, C, ...) in fp16, bf16 or fp32, statistics per channel c over the
M = N * H * W values of that channel, in fp32; w = 1 and b = 0 when weight / bias are None::

    mean_c   = sum(x) / M                  var_c = sum((x - mean_c)^2) / M     (biased)
    invstd_c = 1 / sqrt(var_c + eps)       scale_c = w_c * invstd_c
    y        = (x - mean_c) * scale_c + b_c (+ residual)                       (fp32)
    out      = relu(y).to(x.dtype)                                             (rounded once)

and, with dy the upstream gradient and a kept element one whose output is not <= 0 (torch's ReLU
backward; every element without ReLU), dy' = dy where kept, else 0::

    grad_bias_c   = sum(dy')               grad_weight_c = invstd_c * sum(dy' * (x - mean_c))
    grad_input    = scale_c * (dy' - grad_bias_c / M - (x - mean_c) * invstd_c * grad_weight_c / M)
    grad_residual = dy'

Without a residual the ReLU mask is recomputed from x and the statistics, as
``((x - mean_c) * scale_c + b_c).to(x.dtype) <= 0``: the same test as on the stored output, without
reading it. Given ``running_mean`` / ``running_var``, the forward also updates them in place as
F.batch_norm does::

    running_stat = (1 - momentum) * running_stat + momentum * batch_stat   (var: x M / (M - 1))

The kernels (``KERNELS``):

- ``batch_norm_act_forward(input, weight, bias, residual, eps, relu, *, running_mean=None,
  running_var=None, momentum=0.1, validate=True) -> (out, mean, invstd, var)``: ``out`` in
  input's dtype and strides; the batch mean, ``1 / sqrt(var + eps)`` and the biased variance,
  float32 (C,).
- ``batch_norm_act_backward(grad_out, input, weight, bias, mean, invstd, out, has_residual, relu,
  *, validate=True) -> (grad_input, grad_weight, grad_bias, grad_residual)``: ``mean`` and
  ``invstd`` are the forward's; ``out`` is the forward's output, needed only with a residual and
  ReLU (the mask then depends on the residual), else None. grad_input in input's dtype and
  strides, grad_weight / grad_bias in weight's / bias's dtype (float32 when None), grad_residual
  like grad_input when ``has_residual``, else an empty tensor.

``validate=False`` skips the argument checks, for callers that made them (``amp_fx.ops.batch_norm``).
Neither implementation reads a tensor value on the host.
"""

KERNELS = ("batch_norm_act_forward", "batch_norm_act_backward")
