"""What `AmpPrecision` accepts from ``configure_optimizers``: `check_optimizer` refuses, naming the
fix, an optimizer that has no fused equivalent with FP32 masters (AMSGrad, ``maximize``, tensor
hyperparameters, other classes) or that was built over the model's parameters from before
conversion, before anything is replaced; `amp_fx.integrations._fused_optimizers` builds the
replacement.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from amp_fx.integrations._fused_optimizers import HYPERPARAMETERS, SUPPORTED_CLASSES, check_group_values
from amp_fx.optim.scaled_optimizer import ScaledOptimizer

SUPPORTED = SUPPORTED_CLASSES


def _params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def check_optimizer(optimizer: Any, index: int, stale_params: Iterable[Tensor]) -> None:
    """Raise TypeError/ValueError, naming the fix, unless `fused_equivalent` can take ``optimizer``.

    ``stale_params`` are the model's parameters from before conversion: an optimizer built over
    them would train tensors the converted model no longer holds.
    """
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer {index} is a {name}, not a torch.optim.Optimizer; return one of {SUPPORTED}"
        )
    stale = {id(p) for p in stale_params}
    if any(id(p) in stale for p in _params(optimizer)):
        raise ValueError(
            f"optimizer {index} ({name}) holds the model's parameters from before AmpPrecision converted it "
            "(was it built before Trainer.fit, in __init__?); build it in configure_optimizers from "
            "self.parameters()"
        )
    if isinstance(optimizer, ScaledOptimizer):
        return
    if type(optimizer) not in HYPERPARAMETERS:
        raise TypeError(
            f"optimizer {index} is a {name}, which amp_fx cannot give FP32 master weights to; return "
            f"{SUPPORTED} from configure_optimizers (or drop AmpPrecision for this run)"
        )
    if optimizer.state:
        raise ValueError(
            f"optimizer {index} ({name}) has state already (it has stepped or loaded a checkpoint); return a "
            "fresh optimizer from configure_optimizers, and resume with Trainer.fit(ckpt_path=...)"
        )
    for group_index, group in enumerate(optimizer.param_groups):
        check_group_values(group, f"optimizer {index} ({name}) param group {group_index}")
        for key in HYPERPARAMETERS[type(optimizer)]:
            values = group[key] if key == "betas" else (group[key],)
            if any(isinstance(v, Tensor) for v in values):
                plain = tuple(float(v) for v in values) if key == "betas" else float(group[key])
                raise TypeError(
                    f"optimizer {index} ({name}) param group {group_index} holds {key} as a tensor; amp_fx's "
                    f"fused kernels take Python floats: pass {key}={plain!r}"
                )
