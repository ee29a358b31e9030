"""Fused-optimizer and loss kernels: Triton kernels beside their pure-torch reference; installed as
`amp_fx.kernels`.

Two modules implement one contract (see ``reference``'s docstring for the math): the optimizer
kernels ``check_finite_and_norm_``, ``adam_step_``, ``sgd_step_``, ``advance_step_``, the loss
kernels ``cross_entropy_forward`` / ``cross_entropy_backward`` (fp32 cross-entropy over rows of
fp16/bf16/fp32 logits, behind ``amp_fx.ops.losses.fp32_cross_entropy``) and
``cross_entropy_forward_with_grad`` (the loss and its unscaled gradient in one pass, behind
``amp_fx.ops.losses.linear_cross_entropy``), and the normalization kernels
``batch_norm_act_forward`` / ``batch_norm_act_backward`` (training-mode BatchNorm + residual add +
ReLU over channels_last activations, behind ``amp_fx.ops.batch_norm.batch_norm_act``), and the pooling
kernels ``max_pool2d_forward`` / ``max_pool2d_backward`` (2-D max pooling of channels_last
activations with 1-byte argmax offsets, behind ``amp_fx.ops.max_pool.max_pool2d``), and the loss-scale
kernel ``update_loss_scale_`` (the dynamic scale rule in one launch, behind ``amp_fx.LossScaler``):

- ``reference``: plain torch; runs on any device and is what the optimizers use without CUDA.
- ``triton_ops``: Triton kernels, one launch per dtype group; run on CUDA tensors, or on CPU
  tensors under ``TRITON_INTERPRET=1`` (slow; for tests). None when Triton is not installed.

``implementation_for(tensors)`` picks one.

Example:
    >>> import torch
    >>> from amp_fx.kernels import implementation_for, reference
    >>> implementation_for([torch.zeros(2)]) is reference  # CPU tensors, AMP_FX_FORCE_TRITON unset
    True
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from types import ModuleType

from torch import Tensor

from amp_fx.kernels import reference

if importlib.util.find_spec("triton") is not None:
    from amp_fx.kernels import triton_ops
else:  # e.g. macOS or Windows: no Triton wheel; the reference serves everything
    triton_ops = None

__all__ = ["reference", "triton_ops", "implementation_for"]

FORCE_TRITON_ENV = "AMP_FX_FORCE_TRITON"


def implementation_for(tensors: Iterable[Tensor]) -> ModuleType:
    """The module to run these tensors' kernels with: ``triton_ops`` for CUDA tensors (or when the
    environment sets ``AMP_FX_FORCE_TRITON=1``, e.g. to test the kernels on CPU under
    ``TRITON_INTERPRET=1``), else ``reference``.

    Example:
        >>> import torch
        >>> implementation_for([]).__name__
        'amp_fx.kernels.reference'
    """
    if triton_ops is None:
        return reference
    if os.environ.get(FORCE_TRITON_ENV) == "1":
        return triton_ops
    first = next(iter(tensors), None)
    return triton_ops if first is not None and first.is_cuda else reference
