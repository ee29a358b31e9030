"""Checks at an optimizer's first step: does it train the model that `amp_fx.convert` returned?

`amp_fx.convert` returns a model with parameters of its own (both front ends), so two recipes that
people copy would train nothing, or train less than they think, with nothing said:

- Apex's order (model, optimizer, then convert): the optimizer holds the original's parameters,
  which the converted model never reads. ``record_conversion`` notes, weakly, each source
  parameter and the converted model; at an optimizer's step, if it holds source parameters with
  no grad while the converted model's parameters have grads (the user ran backward through the
  converted model), the step is refused with the fix before anything changes.
  ``amp.initialize(model, optimizer)`` points the optimizer at the converted parameters itself, so
  Apex's order works there.
- A torch.optim optimizer over fp16/bf16 parameters of a converted model steps them in low
  precision: an update smaller than half a unit in the last place of a weight is lost (at lr
  2e-5 most bf16 weights never move). It warns once per optimizer, naming the fused optimizers
  and ``amp.initialize``, which keep FP32 masters. amp_fx's optimizers and those ``amp.initialize``
  set up (it decides on masters itself) are left alone.

The checks run in a global ``torch.optim`` step pre-hook, once per optimizer (after the first step
that had grads); they read only Python objects and metadata, never tensor values.

Example:
    >>> import torch, amp_fx
    >>> model = torch.nn.Linear(4, 2)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # built before convert
    >>> converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    >>> converted(torch.randn(3, 4)).float().sum().backward()
    >>> optimizer.step()
    Traceback (most recent call last):
    ...
    RuntimeError: this optimizer holds the parameters of the Linear that amp_fx.convert converted ...
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.optim.fused_optimizer import is_fused_optimizer

logger = logging.getLogger(__name__)

__all__ = ["record_conversion"]

# Source parameter -> weak reference to the model converted from it.
_CONVERTED_FROM: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Low-precision parameter of a converted model -> weak reference to that model.
_LOW_PRECISION_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Optimizers already checked (weakly: an optimizer's lifetime is the user's).
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_hook_handle: Any = None

# amp.initialize marks the optimizers it manages with this attribute (amp_fx.amp._amp_optimizer).
_AMP_OPTIMIZER_ATTR = "_amp_fx_amp_optimizer"


def record_conversion(source: nn.Module, converted: nn.Module) -> nn.Module:
    """Note that ``converted`` was converted from ``source`` (for the step checks); return ``converted``.

    Example:
        >>> import torch
        >>> source = torch.nn.Linear(2, 2)
        >>> record_conversion(source, torch.nn.Linear(2, 2).half()) is not source
        True
    """
    global _hook_handle
    if not isinstance(source, nn.Module) or not isinstance(converted, nn.Module):
        return converted
    converted_params = {id(p) for p in converted.parameters()}
    model_ref = weakref.ref(converted)
    for param in source.parameters():
        if id(param) not in converted_params:
            _CONVERTED_FROM[param] = model_ref
    for param in converted.parameters():
        if param.dtype in LOW_PRECISION_DTYPES:
            _LOW_PRECISION_OF[param] = model_ref
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_check_before_step)
    return converted


def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if isinstance(p, Tensor)]


def _check_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _CHECKED:
        return
    params = _params(optimizer)
    if not any(p.grad is not None for p in params) and not _grads_elsewhere(params):
        return  # nothing to decide yet: checked again at the next step
    _CHECKED[optimizer] = True
    _refuse_stale_parameters(optimizer, params)
    _warn_low_precision_steps(optimizer, params)


def _grads_elsewhere(params: list[Tensor]) -> bool:
    for param in params:
        model_ref = _CONVERTED_FROM.get(param)
        model = model_ref() if model_ref is not None else None
        if model is not None and any(p.grad is not None for p in model.parameters()):
            return True
    return False


def _refuse_stale_parameters(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> None:
    stale = [p for p in params if p in _CONVERTED_FROM and p.grad is None]
    if not stale or any(p.grad is not None for p in params):
        return  # the optimizer's parameters have grads: it trains the model they belong to
    model = next((ref() for p in stale if (ref := _CONVERTED_FROM[p])() is not None), None)
    if model is None or not any(p.grad is not None for p in model.parameters()):
        return
    _CHECKED.pop(optimizer, None)  # refused again at every step until it is rebuilt
    raise RuntimeError(
        f"this optimizer holds the parameters of the {type(model).__name__} that amp_fx.convert converted "
        f"({len(stale)} of them, none with a gradient), but the backward ran through the converted model, "
        "whose parameters are its own: the step would train nothing. Build the optimizer after convert, "
        "from the converted model: optimizer = ...(converted.parameters()), or use "
        "amp_fx.amp.initialize(model, optimizer), which points the optimizer at the converted model"
    )


def _warn_low_precision_steps(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> None:
    # amp.initialize decided on masters for the optimizers it set up (imported here: amp imports convert).
    from amp_fx.amp import amp_optimizer_of

    if is_fused_optimizer(optimizer) or amp_optimizer_of(optimizer) is not None:
        return
    low = [p for p in params if p in _LOW_PRECISION_OF and p.dtype in LOW_PRECISION_DTYPES]
    if not low:
        return
    dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in low}))
    warnings.warn(
        f"{type(optimizer).__name__} steps {len(low)} {dtypes} parameters of a model amp_fx.convert "
        f"converted, in {dtypes}: an update smaller than half a unit in the last place of a weight is "
        "lost, so small learning rates leave most weights unchanged. Use amp_fx.optim.FusedAdam / "
        "FusedSGD (FP32 master weights, 4 more bytes per parameter) or amp_fx.amp.initialize(model, "
        "optimizer), which gives a torch optimizer FP32 masters",
        UserWarning,
        stacklevel=3,
    )
