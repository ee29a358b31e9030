"""The Triton implementation of every kernel, under one name: each function comes from its family's
``triton`` module (``amp_fx.kernels.<family>.triton``), bound here by ``amp_fx.kernels.families``.

Same names (``amp_fx.kernels.families.KERNEL_NAMES``), signatures and semantics as
``amp_fx.kernels.reference``; each optimizer kernel
launches once per dtype group (never once per tensor), each cross-entropy kernel once per call,
the BatchNorm kernels three times per forward and three times per backward (two passes over the
activations and a per-channel finalize between them), the max-pool, activation and norm kernels
once each way, the loss-scale update and the range statistics of a value once.
``advance_step_`` is a single elementwise op on a one-element tensor, so both implementations
share the reference's.

Example:
    >>> from amp_fx.kernels import triton_ops
    >>> sorted(triton_ops.__all__)  # doctest: +NORMALIZE_WHITESPACE
    ['activation_backward', 'activation_forward', 'adam_step_', 'advance_step_',
     'batch_norm_act_backward', 'batch_norm_act_forward', 'check_finite_and_norm_',
     'cross_entropy_backward', 'cross_entropy_forward', 'cross_entropy_forward_with_grad',
     'fp8_quantize', 'fp8_scaled_mm',
     'gated_activation_backward', 'gated_activation_forward', 'max_pool2d_backward',
     'max_pool2d_forward', 'norm_backward', 'norm_forward', 'record_range_', 'rotary_backward',
     'rotary_forward', 'sgd_step_', 'update_loss_scale_']
"""

from amp_fx.kernels.families import KERNEL_NAMES, kernels_of

# Every family's Triton kernels, bound here under their names.
globals().update(kernels_of("triton"))

__all__ = list(KERNEL_NAMES)
