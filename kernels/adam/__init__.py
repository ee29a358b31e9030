"""Adam / AdamW with FP32 master weights, many tensors per launch: the kernel family's contract.

Two implementations take the same arguments and compute the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the hyperparameter checks both run (and `amp_fx.optim.FusedAdam` runs up
front), ``amp_fx.kernels.arguments.check_update`` the layout rule of every optimizer update, and
``amp_fx.kernels.optimizer_step`` the skip rule and step counter every optimizer kernel shares.

The math (torch.optim.Adam / AdamW), for every element of every parameter, in fp32, with
t = step - step_offset + 1 (the steps this parameter has taken, plus this one)::

    g  = grad * grad_multiplier                  grad_multiplier = 1 / loss_scale (x clip coefficient)
    g += weight_decay * w                        L2 (adam_w_mode=False)
    w *= 1 - lr * weight_decay                   decoupled (adam_w_mode=True)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g^2
    w -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    param = w.to(param.dtype)                    (round to nearest even)

w is the fp32 master when the param has one, else the param itself (read, updated in fp32, written
back in its own dtype). ``1 - beta^t`` is ``-expm1(t * ln(beta))``: no cancellation when beta is
close to 1 and t is small (beta2 = 0.999, t = 1).

The kernel (``KERNELS``): ``adam_step_(params, grads, masters, exp_avgs, exp_avg_sqs, step, *, lr,
beta1, beta2, eps, weight_decay, adam_w_mode, grad_multiplier=None, found_inf=None,
step_offsets=None) -> None``, in place. ``step`` (float32, one element) holds the steps already
taken and is not changed (``advance_step_`` does that afterwards); ``step_offsets[i]`` (None: all
0) is subtracted from it for ``params[i]`` alone: the group steps it did not take. ``masters``
(None, or None entries) are the fp32 copies of low-precision params; moments are float32 with their
param's shape and strides. When ``found_inf`` > 0 nothing is written: params, masters and moments
keep their bits. No tensor value is read on the host.
"""

KERNELS = ("adam_step_",)
