"""Pure-torch reference for the kernels: the same math as the Triton kernels, one module per kernel
family (each module's docstring has its math).

This package is the definition of what the kernels compute, and what the optimizers, the loss
scaler and the ops run on a machine without CUDA. Every function in ``__all__`` has the same name,
signature and semantics as its Triton twin in ``amp_fx.kernels.triton_ops`` (the contract that
``amp_fx.kernels.implementation_for`` picks an implementation of); none of them reads a tensor
value on the host (no ``.item()``, no ``if tensor``), so a training step built on them never
synchronizes with the device. The argument checks both implementations share are in
``amp_fx.kernels.arguments``.

- ``overflow_check``: ``check_finite_and_norm_``
- ``adam``, ``sgd``: ``adam_step_``, ``sgd_step_``; ``step``: the skip rule and ``advance_step_``
- ``loss_scale``: ``update_loss_scale_``
- ``cross_entropy``: ``cross_entropy_forward`` / ``_backward`` / ``_forward_with_grad``
- ``batch_norm``: ``batch_norm_act_forward`` / ``_backward``
- ``max_pool``: ``max_pool2d_forward`` / ``_backward``

(``cross_entropy``, ``batch_norm`` and ``max_pool`` are families of their own, each with its
reference beside its Triton kernels: ``amp_fx.kernels.<family>.reference``.)

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

from amp_fx.kernels.batch_norm.reference import (
    batch_norm_act_backward,
    batch_norm_act_forward,
    update_batch_norm_running_stats_,
)
from amp_fx.kernels.cross_entropy.reference import (
    cross_entropy_backward,
    cross_entropy_forward,
    cross_entropy_forward_with_grad,
)
from amp_fx.kernels.max_pool.reference import max_pool2d_backward, max_pool2d_forward
from amp_fx.kernels.reference.adam import adam_step_
from amp_fx.kernels.reference.loss_scale import reciprocal_scale_, update_loss_scale_
from amp_fx.kernels.reference.overflow_check import check_finite_and_norm_
from amp_fx.kernels.reference.sgd import sgd_step_
from amp_fx.kernels.reference.step import advance_step_

__all__ = [
    # The kernel contract, name for name the same as amp_fx.kernels.triton_ops.__all__.
    "check_finite_and_norm_",
    "adam_step_",
    "sgd_step_",
    "advance_step_",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "cross_entropy_forward_with_grad",
    "batch_norm_act_forward",
    "batch_norm_act_backward",
    "max_pool2d_forward",
    "max_pool2d_backward",
    "update_loss_scale_",
    # Reference-only helpers the ops and the loss scaler call on any device.
    "update_batch_norm_running_stats_",
    "reciprocal_scale_",
]
