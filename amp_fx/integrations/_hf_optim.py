"""What `AmpTrainer` accepts as its optimizer: `check_optim_name` for ``TrainingArguments.optim``,
`check_optimizer_class` for ``optimizer_cls_and_kwargs`` and `check_optimizer` for one passed in
``optimizers=`` (its parameters may be the model's from before conversion, mapped by name onto
the converted model's) refuse, naming the fix, what has no fused equivalent with FP32 masters;
`amp_fx.integrations._fused_optimizers` builds the replacement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from amp_fx.integrations._fused_optimizers import (
    FUSED,
    HYPERPARAMETERS,
    SUPPORTED_CLASSES,
    check_group_values,
)

# The TrainingArguments.optim values AmpTrainer trains with, and what takes their place.
SUPPORTED_OPTIM = {
    "adamw_torch_fused": "amp_fx.optim.FusedAdam (AdamW)",
    "adamw_torch": "amp_fx.optim.FusedAdam (AdamW)",
    "sgd": "amp_fx.optim.FusedSGD",
}


def check_optim_name(optim: Any) -> None:
    """Refuse a ``TrainingArguments.optim`` that has no fused equivalent, listing those that have."""
    name = getattr(optim, "value", optim)
    if name not in SUPPORTED_OPTIM:
        supported = ", ".join(f"{key!r} ({value})" for key, value in SUPPORTED_OPTIM.items())
        raise ValueError(
            f"AmpTrainer cannot give FP32 master weights to optim={name!r}; it trains with {supported}. "
            "Set TrainingArguments(optim=...) to one of them, or pass "
            "optimizers=(amp_fx.optim.FusedAdam(...), None)"
        )


def check_optimizer_class(cls: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse ``optimizer_cls_and_kwargs`` that `fused_equivalent` could not take."""
    if isinstance(cls, type) and issubclass(cls, FUSED):
        return
    if cls not in HYPERPARAMETERS:  # exactly these classes: a subclass may change the maths
        raise TypeError(
            f"optimizer_cls_and_kwargs names {getattr(cls, '__name__', cls)!r}, which amp_fx cannot give "
            f"FP32 master weights to; use {SUPPORTED_CLASSES}"
        )
    check_group_values(dict(kwargs), f"optimizer_cls_and_kwargs ({cls.__name__})")


def check_optimizer(optimizer: Any, model_param_ids: Iterable[int]) -> None:
    """Refuse an optimizer passed in ``optimizers=`` that `fused_equivalent` could not take: another
    class, maths the fused kernels lack, state (it has stepped), parameters not the model's."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizers[0] is a {name}, not a torch.optim.Optimizer; pass one of {SUPPORTED_CLASSES}"
        )
    if not isinstance(optimizer, FUSED) and type(optimizer) not in HYPERPARAMETERS:
        raise TypeError(
            f"optimizers[0] is a {name}, which amp_fx cannot give FP32 master weights to; pass one of "
            f"{SUPPORTED_CLASSES}, or leave optimizers out and set TrainingArguments(optim=...)"
        )
    if any(_has_moments(optimizer, p) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            f"optimizers[0] ({name}) has state already (it has stepped or loaded a checkpoint); pass a fresh "
            "optimizer and resume with trainer.train(resume_from_checkpoint=...)"
        )
    known = set(model_param_ids)
    for index, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        if id(param) not in known:
            raise ValueError(
                f"parameter {index} of optimizers[0] ({name}, shape {tuple(param.shape)}) is not a "
                "parameter of the model given to the trainer; build the optimizer from model.parameters()"
            )
    if not isinstance(optimizer, FUSED):
        for index, group in enumerate(optimizer.param_groups):
            check_group_values(group, f"param group {index} of optimizers[0] ({name})")


def _has_moments(optimizer: torch.optim.Optimizer, param: Tensor) -> bool:
    # A fused optimizer holds its masters from the start; anything else is state from a step.
    return any(key != "master_param" for key in optimizer.state.get(param, {}))
