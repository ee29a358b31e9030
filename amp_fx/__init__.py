"""amp_fx: mixed-precision training for PyTorch as torch.fx graph passes.

    >>> import torch, amp_fx
    >>> gm = amp_fx.convert(torch.nn.Linear(4, 2), "O2")
    >>> print(amp_fx.report(gm))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the module that defines each. Imported lazily so that `import amp_fx`
# stays cheap and so that the Triton kernels are only compiled when an optimizer is used.
_EXPORTS = {
    "convert": "amp_fx.convert",
    "Policy": "amp_fx.policy",
    "Rule": "amp_fx.policy",
    "preset": "amp_fx.policy",
    "report": "amp_fx.report",
    "Report": "amp_fx.report",
    "LossScaler": "amp_fx.loss_scaler",
    "clip_grad_norm_": "amp_fx.clip_grad",
}
_SUBMODULES = {"optim", "testing", "amp", "passes", "kernels"}

__all__ = [*_EXPORTS, *_SUBMODULES]


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
