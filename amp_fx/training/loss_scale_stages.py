"""Where each optimizer stands in an `amp_fx.LossScaler` iteration, and the calls refused out of order.

Between two ``update()`` calls the scaler keeps an `OptimizerRecord` per optimizer: its `Stage`, the
overflow flags its grads gave per device, and the optimizer itself (whose pending scaling ``update``
finishes). ``unscale_`` twice or after ``step``, ``step`` twice, and a step of an optimizer whose
grads were never checked are refused, as GradScaler refuses them.

    >>> record = OptimizerRecord(stage=Stage.STEPPED)
    >>> record.check_unscale()
    Traceback (most recent call last):
    ...
    RuntimeError: unscale_() is being called after step(); call it between backward() and step()
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["OptimizerRecord", "Stage"]


class Stage(enum.Enum):
    READY = 0
    DEFERRED = 1  # checked for inf/NaN, 1/scale pending in the optimizer (the fast path)
    UNSCALED = 2  # the grads hold the true gradients (unscale_)
    STEPPED = 3


@dataclass
class OptimizerRecord:
    """One optimizer's part of the current iteration."""

    stage: Stage = Stage.READY
    found_inf_per_device: dict[torch.device, Tensor] = field(default_factory=dict)
    optimizer: Any = None

    def check_unscale(self) -> None:
        """Refuse ``unscale_`` a second time, or after ``step``."""
        if self.stage is Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        if self.stage is Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(); call it between backward() and step()"
            )

    def check_step(self) -> None:
        """Refuse ``step`` a second time."""
        if self.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update()")

    def require_inf_checks(self) -> None:
        """Refuse a step whose grads gave no overflow flag (none of the optimizer's params has one)."""
        if not self.found_inf_per_device:
            raise RuntimeError(
                "no inf checks were recorded for this optimizer: none of its parameters has a gradient; call "
                "scaler.scale(loss).backward() before scaler.step(optimizer)"
            )
