"""Loss scaling for optimizers that are no `ScaledOptimizer` (torch.optim's): GradScaler's way.

Their grads are unscaled in place, and each device's overflow flag decides whether the step runs:

- an optimizer with ``_step_supports_amp_scaling`` (torch's ``Adam(fused=True)``) reads the flag
  itself from its ``found_inf`` attribute (and the scale from ``grad_scale``), on the device;
- any other optimizer is skipped on the host: the flags are read, one sync per step (as in
  torch.amp.GradScaler).

`amp_fx.LossScaler` and `amp_fx.amp` (after each backward) both go through these functions.
Flags are float32 tensors, one per device, that only ever accumulate here (never cleared), as
``torch._amp_foreach_non_finite_check_and_unscale_`` does::

    >>> import torch
    >>> flags = {}
    >>> grads = [torch.tensor([4.0, float("inf")])]
    >>> unscale_and_check_(grads, torch.tensor(0.25), flags)
    >>> grads[0], flags[torch.device("cpu")]
    (tensor([1., inf]), tensor([1.]))
    >>> any_overflow_on_host(flags)
    True
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FoundInf",
    "any_overflow_on_host",
    "flag_for",
    "reads_found_inf",
    "step_reading_found_inf",
    "total_found_inf",
    "unscale_and_check_",
    "unscale_grads_in_place_",
]

# Overflow flags per device (float32; > 0 where a grad held inf or NaN).
FoundInf = dict[torch.device, Tensor]


def flag_for(found: FoundInf, device: torch.device, shape: tuple[int, ...] = (1,)) -> Tensor:
    """The overflow flag of `device` in `found`, created (zero, float32 of `shape`) on first use."""
    flag = found.get(device)
    if flag is None:
        flag = found[device] = torch.zeros(shape, dtype=torch.float32, device=device)
    return flag


def unscale_and_check_(
    grads: Sequence[Tensor], inv_scale: Tensor, found: FoundInf, flag_shape: tuple[int, ...] = (1,)
) -> None:
    """grads *= inv_scale in place; found[device] > 0 afterwards if a grad on it held inf or NaN.

    One foreach call per (device, dtype). Dense tensors only (a sparse grad's ``_values()`` will
    do). A device with no flag in `found` gets a new zero one of `flag_shape` (GradScaler's are
    0-dim); an existing flag accumulates.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for grad in grads:
        groups[(grad.device, grad.dtype)].append(grad)
    inv_per_device: dict[torch.device, Tensor] = {}
    for (device, _), tensors in groups.items():
        if device not in inv_per_device:
            inv_per_device[device] = inv_scale.to(device, torch.float32, non_blocking=True).reshape(())
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, flag_for(found, device, flag_shape), inv_per_device[device]
        )


def total_found_inf(found: FoundInf, device: torch.device) -> Tensor | None:
    """All flags of `found` summed onto `device` (None when there are none)."""
    flags = [flag.to(device, non_blocking=True) for flag in found.values()]
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).sum(0)


def any_overflow_on_host(found: FoundInf) -> bool:
    """True if any flag is set: reads the device (a sync), for optimizers that cannot skip on it."""
    return any(float(flag.sum()) > 0 for flag in found.values())


def reads_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """True for optimizers that skip on GradScaler's ``found_inf`` attribute themselves (torch's fused)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_reading_found_inf(
    optimizer: torch.optim.Optimizer, step: Callable[[], Any], found_inf: Tensor, **scaling: Tensor | None
) -> Any:
    """Run ``step()`` with GradScaler's attributes set on `optimizer`, removed again afterwards.

    ``found_inf`` (0-dim float32, on the optimizer's device) makes the step a no-op when > 0;
    ``scaling`` may add ``grad_scale`` (the scale its kernel divides the grads by; None: unscaled).
    """
    attributes = {"found_inf": found_inf, **scaling}
    for name, value in attributes.items():
        setattr(optimizer, name, value)
    try:
        return step()
    finally:
        for name in attributes:
            delattr(optimizer, name)


def unscale_grads_in_place_(
    optimizer: torch.optim.Optimizer, inv_scale: Tensor, allow_fp16: bool
) -> FoundInf:
    """GradScaler's unscale of ``optimizer``'s grads: grads *= inv_scale in place, and a fresh
    found_inf per device (0-dim, as GradScaler's). fp16 grads are refused unless ``allow_fp16``
    (an optimizer that reads ``found_inf`` itself unscales with 1, leaving them as they are).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.full((2,), 8.0)
        >>> found = unscale_grads_in_place_(torch.optim.SGD([w]), torch.tensor(0.25), allow_fp16=False)
        >>> w.grad, found[torch.device("cpu")]
        (tensor([2., 2.]), tensor(0.))
    """
    grads: list[Tensor] = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise ValueError(
                        "Attempting to unscale FP16 gradients of a torch.optim optimizer (GradScaler "
                        "refuses too); use amp_fx.optim.FusedAdam / FusedSGD, which keep FP32 masters"
                    )
                grad = param.grad
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grads.append(grad)
        found_infs: FoundInf = {}
        # GradScaler's flags are 0-dim.
        unscale_and_check_(grads, inv_scale, found_infs, flag_shape=())
    return found_infs
