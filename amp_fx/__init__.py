"""amp_fx: mixed-precision training for PyTorch as torch.fx graph passes.

>>> import torch, amp_fx
>>> gm = amp_fx.convert(torch.nn.Linear(4, 2), "O2")
>>> print(amp_fx.report(gm))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# `convert` and `report` share their names with the modules that define them, so they are bound
# eagerly: importing the submodule first would otherwise leave `amp_fx.convert` bound to the module.
from amp_fx.convert import convert
from amp_fx.report import Report, report

# Other public names and the module that defines each, imported lazily so that the optimizers'
# Triton kernels are only loaded when an optimizer is used.
_EXPORTS = {
    "Policy": "amp_fx.policy",
    "Rule": "amp_fx.policy",
    "preset": "amp_fx.policy",
    "LossScaler": "amp_fx.loss_scaler",
    "clip_grad_norm_": "amp_fx.clip_grad",
    "fp32_cross_entropy": "amp_fx.losses",
}
_SUBMODULES = {"optim", "testing", "amp", "passes", "kernels"}

__all__ = ["convert", "report", "Report", *_EXPORTS, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"amp_fx.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'amp_fx' has no attribute {name!r}")
