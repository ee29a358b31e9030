"""amp_fx: mixed-precision training for PyTorch as torch.fx graph passes.

>>> import torch, amp_fx
>>> gm = amp_fx.convert(torch.nn.Linear(4, 2), "O2", device_type="cpu")
>>> print(amp_fx.report(gm).summary())
1 ops, 2 casts inserted
ops per rule: lower 1 (linear×1)
parameters and buffers: fp16 2 tensors (10 elements)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# Public names and the module that defines each, imported on first use: importing a pass or a
# kernel (which runs this file first) does not load the user API above it, and the optimizers'
# Triton kernels load only when an optimizer is used.
_EXPORTS = {
    "convert": "amp_fx.convert",
    "report": "amp_fx.inspect.report",
    "Report": "amp_fx.inspect.report",
    "capture_summary": "amp_fx.inspect.capture_summary",
    "captured_graphs": "amp_fx.inspect.capture_summary",
    "Policy": "amp_fx.core.policy",
    "Rule": "amp_fx.core.policy",
    "preset": "amp_fx.core.policy",
    "LossScaler": "amp_fx.training.loss_scaler",
    "clip_grad_norm_": "amp_fx.training.clip_grad",
    "fp32_cross_entropy": "amp_fx.ops.cross_entropy",
    "master_state_dict": "amp_fx.training.saving",
    "CudaGraphStep": "amp_fx.training.cuda_graph_step",
    "watch": "amp_fx.inspect.ranges",
    "watching": "amp_fx.inspect.ranges",
    "RangeWatch": "amp_fx.inspect.ranges",
    "find_overflow": "amp_fx.inspect.overflow",
    "Overflow": "amp_fx.inspect.overflow",
    "propose_policy": "amp_fx.inspect.proposals",
    "PolicyProposal": "amp_fx.inspect.proposals",
}
_SUBMODULES = {
    "optim",
    "testing",
    "amp",
    "passes",
    "kernels",
    "core",
    "ops",
    "capture",
    "training",
    "inspect",
}

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


class _Package(types.ModuleType):
    """amp_fx's module type: importing the submodule ``amp_fx.convert`` does not hide the function
    ``amp_fx.convert`` (Python binds a submodule to the package attribute of its name)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
