"""The Triton implementation of the kernel contract, one function per kernel.

Same names, signatures and semantics as ``amp_fx.kernels.reference``; each optimizer kernel
launches once per dtype group (never once per tensor), each cross-entropy kernel once per call,
the BatchNorm kernels three times per forward and three times per backward (two passes over the
activations and a per-channel finalize between them), the max-pool kernels once each way, the
loss-scale update once.
``advance_step_`` is a single elementwise op on a one-element tensor, so both implementations
share the reference's.

Example:
    >>> from amp_fx.kernels import triton_ops
    >>> sorted(triton_ops.__all__)  # doctest: +NORMALIZE_WHITESPACE
    ['adam_step_', 'advance_step_', 'batch_norm_act_backward', 'batch_norm_act_forward',
     'check_finite_and_norm_', 'cross_entropy_backward', 'cross_entropy_forward',
     'cross_entropy_forward_with_grad', 'max_pool2d_backward', 'max_pool2d_forward', 'sgd_step_',
     'update_loss_scale_']
"""

from amp_fx.kernels.adam import adam_step_
from amp_fx.kernels.batch_norm.triton import batch_norm_act_backward, batch_norm_act_forward
from amp_fx.kernels.cross_entropy.triton import (
    cross_entropy_backward,
    cross_entropy_forward,
    cross_entropy_forward_with_grad,
)
from amp_fx.kernels.loss_scale import update_loss_scale_
from amp_fx.kernels.max_pool.triton import max_pool2d_backward, max_pool2d_forward
from amp_fx.kernels.overflow_check import check_finite_and_norm_
from amp_fx.kernels.reference.step import advance_step_
from amp_fx.kernels.sgd import sgd_step_

__all__ = [
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
]
