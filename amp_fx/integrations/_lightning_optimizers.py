"""The optimizers `AmpPrecision` trains with: the fused equivalent of the one the user built.

Lightning's ``configure_optimizers`` returns a torch optimizer over the converted model's fp16/bf16
parameters. `fused_equivalent` builds the `amp_fx.optim` optimizer that does the same maths with
FP32 masters: ``torch.optim.Adam`` / ``AdamW`` become `FusedAdam` (Adam's L2 penalty or AdamW's
decoupled decay), ``torch.optim.SGD`` becomes `FusedSGD`, with the same param groups, the same
hyperparameters per group and every other key a group holds (``initial_lr`` from a scheduler, a
group's name). Each master is the FP32 value the parameter had before conversion, not its rounded
copy, as ``amp.initialize`` makes them. A `FusedAdam` / `FusedSGD` the user built is kept, its
masters set the same way. `check_optimizer` refuses what has no fused equivalent (AMSGrad,
``maximize``, other optimizer classes) before anything is built.

`retarget_schedulers` points the LR schedulers built over the torch optimizer at its fused
equivalent, so they set the learning rate the fused kernels read.

    >>> import torch
    >>> model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    >>> torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    >>> fused = fused_equivalent(torch_opt, originals={})
    >>> type(fused).__name__, fused.param_groups[0]["weight_decay"], fused.param_groups[0]["adam_w_mode"]
    ('FusedAdam', 0.1, True)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.optim.scaled_optimizer import ScaledOptimizer

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, amp_fx.optim.FusedAdam or FusedSGD"

# Keys of torch's param groups that pick an implementation (the fused kernel replaces it) and the
# maths each fused optimizer does not have, with the value it must hold.
_IMPLEMENTATION_KEYS = ("foreach", "capturable", "fused")
_UNSUPPORTED_VALUES = {"amsgrad": False, "maximize": False, "differentiable": False}
_HYPERPARAMETERS = {
    torch.optim.Adam: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
}


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
    if type(optimizer) not in _HYPERPARAMETERS:
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
        for key, allowed in _UNSUPPORTED_VALUES.items():
            if group.get(key, allowed) != allowed:
                raise ValueError(
                    f"optimizer {index} ({name}) param group {group_index} has {key}={group[key]!r}, which "
                    f"amp_fx's fused optimizers do not implement; use {key}={allowed!r}"
                )
        for key in _HYPERPARAMETERS[type(optimizer)]:
            values = group[key] if key == "betas" else (group[key],)
            if any(isinstance(v, Tensor) for v in values):
                plain = tuple(float(v) for v in values) if key == "betas" else float(group[key])
                raise TypeError(
                    f"optimizer {index} ({name}) param group {group_index} holds {key} as a tensor; amp_fx's "
                    f"fused kernels take Python floats: pass {key}={plain!r}"
                )


def fused_equivalent(
    optimizer: torch.optim.Optimizer, originals: Mapping[int, Tensor], master_weights: bool = True
) -> torch.optim.Optimizer:
    """The amp_fx fused optimizer doing ``optimizer``'s maths with FP32 masters (`check_optimizer` first).

    ``originals`` maps id(converted parameter) to its FP32 value before conversion, which becomes
    its master (parameters not in it keep the masters made from their own values).
    ``master_weights=False`` (the opt levels without masters, O3) updates fp16/bf16 parameters in
    place, in FP32 arithmetic. An amp_fx fused optimizer is returned itself, as the user built it,
    its masters set the same way.
    """
    if isinstance(optimizer, ScaledOptimizer):
        fused = optimizer
    else:
        dropped = set(_IMPLEMENTATION_KEYS) | set(_UNSUPPORTED_VALUES) | {"decoupled_weight_decay"}
        groups = [{k: v for k, v in group.items() if k not in dropped} for group in optimizer.param_groups]
        defaults = {k: optimizer.defaults[k] for k in _HYPERPARAMETERS[type(optimizer)]}
        if type(optimizer) is torch.optim.SGD:
            fused = FusedSGD(groups, **defaults, master_weights=master_weights)
        else:
            # torch's Adam does AdamW's decoupled decay when it has decoupled_weight_decay=True.
            for group, source in zip(groups, optimizer.param_groups, strict=True):
                group["adam_w_mode"] = type(optimizer) is torch.optim.AdamW or bool(
                    source.get("decoupled_weight_decay", False)
                )
            adam_w_mode = groups[0]["adam_w_mode"] if groups else True
            fused = FusedAdam(groups, **defaults, adam_w_mode=adam_w_mode, master_weights=master_weights)
    with torch.no_grad():
        for param, master in zip(_params(fused), master_params(fused), strict=True):
            original = originals.get(id(param))
            if master is not param and original is not None and original.shape == master.shape:
                master.copy_(original)
    return fused


def retarget_schedulers(schedulers: Iterable[Any], replacements: Mapping[int, torch.optim.Optimizer]) -> None:
    """Point each scheduler (and those a SequentialLR / ChainedScheduler holds) built over a replaced
    optimizer at its replacement: ``replacements`` maps id(old optimizer) to the new one."""
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
