"""The fused optimizer a trainer integration trains with: the `amp_fx.optim` equivalent, with FP32
masters, of the torch optimizer the trainer or the user built (used by `amp_fx.integrations.
transformers` and `amp_fx.integrations.lightning`).

``torch.optim.AdamW`` / ``Adam`` become `FusedAdam` (decoupled decay or Adam's L2 penalty),
``torch.optim.SGD`` becomes `FusedSGD`, with the same param groups, the same hyperparameters per
group and every other key a group holds (``initial_lr`` from a scheduler, a group's name). Each
master is set to the FP32 value its parameter had before conversion, not its rounded copy, as
``amp.initialize`` makes them (`set_masters`), and LR schedulers built over the torch optimizer
follow its replacement (`retarget_schedulers`).

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

__all__ = [
    "FUSED",
    "HYPERPARAMETERS",
    "SUPPORTED_CLASSES",
    "check_group_values",
    "fused_equivalent",
    "retarget_schedulers",
    "set_masters",
]

SUPPORTED_CLASSES = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, amp_fx.optim.FusedAdam or FusedSGD"
FUSED = (FusedAdam, FusedSGD)
# The hyperparameters each torch optimizer shares with its fused equivalent.
HYPERPARAMETERS = {
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.Adam: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}
# Keys of torch's param groups that pick an implementation (the fused kernel replaces it), and the
# maths the fused optimizers do not have, with the value they must hold.
_IMPLEMENTATION_KEYS = ("foreach", "capturable", "fused", "decoupled_weight_decay")
_UNSUPPORTED_VALUES = {"amsgrad": False, "maximize": False, "differentiable": False}


def check_group_values(group: Mapping[str, Any], where: str) -> None:
    """Refuse a param group (or optimizer arguments) asking for maths the fused kernels lack."""
    for key, allowed in _UNSUPPORTED_VALUES.items():
        if group.get(key, allowed) != allowed:
            raise ValueError(
                f"{where} has {key}={group[key]!r}, which amp_fx's fused optimizers do not implement; use "
                f"{key}={allowed!r}"
            )


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
    if isinstance(optimizer, FUSED) and all(param_map(p) is p for p in params):
        return optimizer
    groups = []
    for group in optimizer.param_groups:
        kept = {
            key: _plain(key, value)
            for key, value in group.items()
            if key not in (*_IMPLEMENTATION_KEYS, *_UNSUPPORTED_VALUES, "params", "step")
        }
        groups.append({**kept, "params": [param_map(p) for p in group["params"]]})
    if isinstance(optimizer, FUSED):
        return type(optimizer)(groups, **optimizer.defaults)
    cls = type(optimizer)
    defaults = {key: _plain(key, optimizer.defaults[key]) for key in HYPERPARAMETERS[cls]}
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


def retarget_schedulers(schedulers: Iterable[Any], replacements: Mapping[int, torch.optim.Optimizer]) -> None:
    """Point each LR scheduler (and those a SequentialLR / ChainedScheduler holds) built over a
    replaced optimizer at its replacement: ``replacements`` maps id(old optimizer) to the new one."""
    for scheduler in schedulers:
        old = getattr(scheduler, "optimizer", None)
        new = replacements.get(id(old))
        if new is not None:
            scheduler.optimizer = new
            if hasattr(old.step, "_wrapped_by_lr_sched"):
                _track_step_calls(new)
        retarget_schedulers(getattr(scheduler, "_schedulers", ()), replacements)


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
