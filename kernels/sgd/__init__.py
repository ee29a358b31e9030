"""SGD (momentum, dampening, Nesterov) with FP32 master weights, many tensors per launch: the kernel
family's contract.

Two implementations take the same arguments and compute the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the hyperparameter checks both run (and `amp_fx.optim.FusedSGD` runs up
front). The layout, master and skip rules are Adam's (``amp_fx.kernels.adam``).

The math (torch.optim.SGD), for every element of every parameter, in fp32::

    g   = grad * grad_multiplier + weight_decay * w
    buf = g                                        the param's first step (step - step_offset == 0),
                                                   as torch creates the buffer
    buf = momentum * buf + (1 - dampening) * g     later steps
    g   = g + momentum * buf  (nesterov)   or   buf      (when momentum != 0)
    w  -= lr * g
    param = w.to(param.dtype)

w is the fp32 master when the param has one, else the param itself.

The kernel (``KERNELS``): ``sgd_step_(params, grads, masters, momentum_buffers, step, *, lr,
momentum, dampening, weight_decay, nesterov, grad_multiplier=None, found_inf=None,
step_offsets=None) -> None``, in place; ``momentum_buffers`` (float32) may be None when
``momentum`` == 0. No tensor value is read on the host.
"""

KERNELS = ("sgd_step_",)
