"""The Triton implementation of every kernel, under one name: each function comes from its family's
``triton`` module (``amp_fx.kernels.<family>.triton``).

Same names (``amp_fx.kernels.families.KERNEL_NAMES``), signatures and semantics as
``amp_fx.kernels.reference``; each optimizer kernel
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

# Each family's kernels, bound here under their own names; __all__ lists them from the families
# (KERNEL_NAMES), so the imports are re-exports a linter cannot see.
from amp_fx.kernels.adam.triton import adam_step_  # noqa: F401
from amp_fx.kernels.batch_norm.triton import batch_norm_act_backward, batch_norm_act_forward  # noqa: F401
from amp_fx.kernels.cross_entropy.triton import (  # noqa: F401
    cross_entropy_backward,
    cross_entropy_forward,
    cross_entropy_forward_with_grad,
)
from amp_fx.kernels.families import KERNEL_NAMES
from amp_fx.kernels.loss_scale.triton import update_loss_scale_  # noqa: F401
from amp_fx.kernels.max_pool.triton import max_pool2d_backward, max_pool2d_forward  # noqa: F401
from amp_fx.kernels.optimizer_step import advance_step_  # noqa: F401
from amp_fx.kernels.overflow_check.triton import check_finite_and_norm_  # noqa: F401
from amp_fx.kernels.sgd.triton import sgd_step_  # noqa: F401

__all__ = list(KERNEL_NAMES)
