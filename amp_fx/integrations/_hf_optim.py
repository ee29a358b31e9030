"""The optimizer `AmpTrainer` steps: the fused equivalent, with FP32 masters, of the one the Trainer
would build or the user passed.

``TrainingArguments.optim`` names a torch optimizer; the Trainer builds it as always (its param
groups: decay and no-decay by ``get_decay_parameter_names``, trainable parameters only; learning
rate, betas, eps, weight decay, ``optim_args``), and `fused_equivalent` turns it into the
`amp_fx.optim` optimizer doing the same maths: ``AdamW`` / ``Adam`` become `FusedAdam`
(decoupled decay or Adam's L2 penalty), ``SGD`` becomes `FusedSGD`, with the same groups, the same
hyperparameters per group and every other key a group holds (``initial_lr`` from a scheduler, a
group's name). A torch optimizer passed in ``optimizers=`` goes the same way; its parameters may
be the model's from before conversion, which are mapped by name onto the converted model's. Each
master is the FP32 value its parameter had before conversion, not its rounded copy, as
``amp.initialize`` makes them.

    >>> import torch
    >>> model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    >>> torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    >>> fused = fused_equivalent(torch_opt, master_weights=True)
    >>> type(fused).__name__, fused.param_groups[0]["weight_decay"], fused.param_groups[0]["adam_w_mode"]
    ('FusedAdam', 0.1, True)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from amp_fx.optim import FusedAdam, FusedSGD, master_params

# The TrainingArguments.optim values AmpTrainer trains with, and what takes their place.
SUPPORTED_OPTIM = {
    "adamw_torch_fused": "amp_fx.optim.FusedAdam (AdamW)",
    "adamw_torch": "amp_fx.optim.FusedAdam (AdamW)",
    "sgd": "amp_fx.optim.FusedSGD",
}
SUPPORTED_CLASSES = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, amp_fx.optim.FusedAdam or FusedSGD"

_FUSED = (FusedAdam, FusedSGD)
# The hyperparameters each torch optimizer shares with its fused equivalent.
_HYPERPARAMETERS = {
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.Adam: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}
# Keys of torch's param groups that pick an implementation (the fused kernel replaces it), and the
# maths the fused optimizers do not have, with the value they must hold.
_IMPLEMENTATION_KEYS = ("foreach", "capturable", "fused", "decoupled_weight_decay")
_UNSUPPORTED_VALUES = {"amsgrad": False, "maximize": False, "differentiable": False}


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
    if isinstance(cls, type) and issubclass(cls, _FUSED):
        return
    if cls not in _HYPERPARAMETERS:  # exactly these classes: a subclass may change the maths
        raise TypeError(
            f"optimizer_cls_and_kwargs names {getattr(cls, '__name__', cls)!r}, which amp_fx cannot give "
            f"FP32 master weights to; use {SUPPORTED_CLASSES}"
        )
    _check_values(dict(kwargs), f"optimizer_cls_and_kwargs ({cls.__name__})")


def _check_values(group: Mapping[str, Any], where: str) -> None:
    for key, allowed in _UNSUPPORTED_VALUES.items():
        if group.get(key, allowed) != allowed:
            raise ValueError(
                f"{where} has {key}={group[key]!r}, which amp_fx's fused optimizers do not implement; use "
                f"{key}={allowed!r}"
            )


def check_optimizer(optimizer: Any, model_param_ids: Iterable[int]) -> None:
    """Refuse an optimizer passed in ``optimizers=`` that `fused_equivalent` could not take: another
    class, maths the fused kernels lack, state (it has stepped), parameters not the model's."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizers[0] is a {name}, not a torch.optim.Optimizer; pass one of {SUPPORTED_CLASSES}"
        )
    if not isinstance(optimizer, _FUSED) and type(optimizer) not in _HYPERPARAMETERS:
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
    if not isinstance(optimizer, _FUSED):
        for index, group in enumerate(optimizer.param_groups):
            _check_values(group, f"param group {index} of optimizers[0] ({name})")


def _has_moments(optimizer: torch.optim.Optimizer, param: Tensor) -> bool:
    # A fused optimizer holds its masters from the start; anything else is state from a step.
    return any(key != "master_param" for key in optimizer.state.get(param, {}))


def _plain(key: str, value: Any) -> Any:
    """A hyperparameter as the fused kernels take it: Python floats, also where torch allows tensors."""
    if key == "betas":
        return tuple(float(v) for v in value)
    return float(value) if isinstance(value, Tensor) else value


def fused_equivalent(
    optimizer: torch.optim.Optimizer,
    master_weights: bool,
    param_map: Callable[[Tensor], Tensor] = lambda p: p,
) -> torch.optim.Optimizer:
    """The amp_fx fused optimizer doing ``optimizer``'s maths (`check_optimizer` first).

    ``param_map`` gives the converted model's parameter for each of ``optimizer``'s. A torch
    optimizer's groups keep every key but those naming torch's implementation; a fused optimizer
    built over other parameters is built again over the mapped ones (same groups), one built over
    them is returned itself.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if isinstance(optimizer, _FUSED) and all(param_map(p) is p for p in params):
        return optimizer
    groups = []
    for group in optimizer.param_groups:
        kept = {
            key: _plain(key, value)
            for key, value in group.items()
            if key not in (*_IMPLEMENTATION_KEYS, *_UNSUPPORTED_VALUES, "params", "step")
        }
        groups.append({**kept, "params": [param_map(p) for p in group["params"]]})
    if isinstance(optimizer, _FUSED):
        return type(optimizer)(groups, **optimizer.defaults)
    cls = type(optimizer)
    defaults = {key: _plain(key, optimizer.defaults[key]) for key in _HYPERPARAMETERS[cls]}
    for group in groups:
        group["master_weights"] = master_weights
    if cls is torch.optim.SGD:
        return FusedSGD(groups, **defaults, master_weights=master_weights)
    # torch's Adam does AdamW's decoupled decay when it holds decoupled_weight_decay=True.
    for group, source in zip(groups, optimizer.param_groups, strict=True):
        group["adam_w_mode"] = cls is torch.optim.AdamW or bool(source.get("decoupled_weight_decay", False))
    adam_w_mode = cls is torch.optim.AdamW or bool(optimizer.defaults.get("decoupled_weight_decay", False))
    return FusedAdam(groups, **defaults, adam_w_mode=adam_w_mode, master_weights=master_weights)


def set_masters(optimizer: torch.optim.Optimizer, originals: Mapping[int, Tensor]) -> int:
    """Set each master of ``optimizer`` to the FP32 value its parameter had before conversion
    (``originals``: id(converted parameter) -> that value), where the parameter still holds that value
    rounded (a checkpoint loaded since would have changed it); returns how many were set."""
    count = 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        for param, master in zip(params, master_params(optimizer), strict=True):
            original = originals.get(id(param))
            if master is param or original is None or original.shape != param.shape:
                continue
            if torch.equal(original.to(param.device, param.dtype), param):
                master.copy_(original)
                count += 1
    return count


def retarget_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point an LR scheduler built over ``old`` (and the schedulers a SequentialLR / ChainedScheduler
    holds) at ``new``, which took its place."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        if hasattr(old.step, "_wrapped_by_lr_sched"):
            _track_step_calls(new)
    for inner in getattr(scheduler, "_schedulers", ()):
        retarget_scheduler(inner, old, new)


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` calls as torch's LRScheduler does on the optimizer it is built with,
    so that the scheduler's first ``step()`` does not warn that the optimizer never stepped."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    optimizer_ref = weakref.ref(optimizer)  # the instance attribute must not keep its owner alive

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        owner = optimizer_ref()
        owner._opt_called = True
        return step(owner, *args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True
    optimizer.step = tracked_step
