"""The pure-torch implementation of every kernel, under one name: the definition of what the
kernels compute, and what the optimizers, the loss scaler and the ops run without CUDA.

Each function comes from its family's ``reference`` module (``amp_fx.kernels.<family>.reference``,
the family's ``__init__`` states its contract), bound here by ``amp_fx.kernels.families``, and has
the same name, signature and semantics as its Triton twin in ``amp_fx.kernels.triton_ops``:
``amp_fx.kernels.implementation_for`` picks one of the two modules. None of them reads a tensor
value on the host (no ``.item()``, no ``if tensor``), so a training step built on them never
synchronizes with the device.

Example:
    >>> import torch
    >>> from amp_fx.kernels import reference
    >>> p = torch.ones(3, dtype=torch.float16); g = torch.full((3,), 2.0, dtype=torch.float16)
    >>> master = p.float(); m = torch.zeros(3); v = torch.zeros(3); step = torch.zeros(1)
    >>> found_inf = torch.zeros(1)
    >>> reference.check_finite_and_norm_([g], found_inf)
    >>> reference.adam_step_([p], [g], [master], [m], [v], step, lr=0.1, beta1=0.9, beta2=0.999,
    ...                      eps=1e-8, weight_decay=0.0, adam_w_mode=True, found_inf=found_inf)
    >>> reference.advance_step_(step, found_inf)
    >>> p
    tensor([0.8999, 0.8999, 0.8999], dtype=torch.float16)
"""

from amp_fx.kernels.batch_norm.reference import update_batch_norm_running_stats_
from amp_fx.kernels.families import KERNEL_NAMES, kernels_of
from amp_fx.kernels.loss_scale.reference import reciprocal_scale_

# Every family's reference kernels, bound here under their names.
globals().update(kernels_of("reference"))

__all__ = [
    *KERNEL_NAMES,
    # Reference-only helpers the ops and the loss scaler call on any device.
    "update_batch_norm_running_stats_",
    "reciprocal_scale_",
]
