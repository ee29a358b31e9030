"""Apex's ``amp`` API on amp_fx: code written for NVIDIA Apex runs by changing one import.

    from amp_fx import amp          # was: from apex import amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}

- `initialize`: Apex's arguments, defaults, property checks and return shapes; converts the
  model(s) with `amp_fx.convert` and gives any torch.optim optimizer FP32 master weights where the
  opt level asks for them. May be called again for other models (Apex could not).
- `scale_loss`: one dynamic scaler per loss, overflow checks and skipped steps on the device;
  Apex's overflow message is logged (logger "amp_fx.amp") without a host sync per step.
- `master_params`, `state_dict` / `load_state_dict` (Apex's format), `register_half_function`,
  `register_float_function`, `register_promote_function`, `disable_casts`.

Differences from Apex, each deliberate: the casts live in the model's graph (at O1, as in Apex,
torch's FP32 functions also run in FP32 outside the model while the session is current:
`amp_fx.amp._fp32_functions`); model checkpoints are FP32 at every opt level and optimizer
checkpoints include the FP32 masters, so a resumed run continues bit for bit; a step that
overflowed under a static loss scale is skipped too; ``disable_casts`` runs the converted
models in FP32 (see `amp_fx.amp._model`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp._amp_optimizer import amp_optimizer_of
from amp_fx.amp._initialize import initialize
from amp_fx.amp._model import disable_casts
from amp_fx.amp._properties import AmpConfigError, Properties
from amp_fx.amp._registry import (
    clear_registered_functions,
    register_float_function,
    register_half_function,
    register_promote_function,
    registered_functions,
)
from amp_fx.amp._scale_loss import scale_loss
from amp_fx.amp._state import require_session
from amp_fx.core.opt_levels import OPT_LEVELS

__all__ = [
    "initialize",
    "scale_loss",
    "master_params",
    "state_dict",
    "load_state_dict",
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "registered_functions",
    "clear_registered_functions",
    "disable_casts",
    "AmpConfigError",
    "Properties",
    "OPT_LEVELS",
]


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Yield the tensors `optimizer` updates, with unscaled grads: the FP32 masters where it keeps some.

    Use it to clip as in Apex: ``torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)``
    between ``scale_loss`` and ``optimizer.step()``.

    Example:
        >>> import torch
        >>> from amp_fx import amp
        >>> model = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        >>> [p.dtype for p in amp.master_params(optimizer)]
        [torch.float32, torch.float32]
    """
    amp_optimizer = amp_optimizer_of(optimizer)
    if amp_optimizer is not None:
        yield from amp_optimizer.master_params()
        return
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers of the latest `initialize`, in Apex's format.

    ``{"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}, ...}``; plain Python numbers, so
    it loads with ``torch.load(..., weights_only=True)``. Reads the device (call it at checkpoint
    time, not every step).
    """
    session = require_session("amp.state_dict()")
    result: dict[str, Any] = OrderedDict() if destination is None else destination
    result.update(session.state_dict())
    return result


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Load loss-scaler state saved by `state_dict` (or by Apex) into the latest `initialize`'s scalers."""
    require_session("amp.load_state_dict()").load_state_dict(state_dict)
