"""Device-side gradient arithmetic shared by the optimizer kinds: unscale, check, add, copy.

Every function takes lists of tensors that may span devices and dtypes, groups them, and runs one
foreach call per group; overflow flags are float32 tensors of shape (1,), one per device, that
only ever accumulate (never cleared here), as ``torch._amp_foreach_non_finite_check_and_unscale_``
does. Nothing here reads a value on the host::

    >>> import torch
    >>> flags = {}
    >>> grads = [torch.tensor([4.0, float("inf")])]
    >>> unscale_and_check_(grads, torch.tensor(0.25), flags)
    >>> grads[0], flags[torch.device("cpu")]
    (tensor([1., inf]), tensor([1.]))
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels import implementation_for

FoundInf = dict[torch.device, Tensor]


def _groups(tensors: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        groups[(tensor.device, tensor.dtype)].append(index)
    return groups


def flag_for(found: FoundInf, device: torch.device) -> Tensor:
    """The overflow flag of `device` in `found`, created (zero) on first use."""
    flag = found.get(device)
    if flag is None:
        flag = found[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return flag


def check_sparse(grads: Sequence[Tensor]) -> None:
    if any(grad.is_sparse for grad in grads):
        raise ValueError(
            "amp_fx.amp does not unscale sparse gradients; build the embedding with sparse=False "
            "(the default) when training with amp"
        )


def unscale_and_check_(grads: Sequence[Tensor], inv_scale: Tensor, found: FoundInf) -> None:
    """grads *= inv_scale in place; found[device] > 0 afterwards if any grad held inf or NaN."""
    check_sparse(grads)
    inv_per_device: dict[torch.device, Tensor] = {}
    for (device, _), indices in _groups(grads).items():
        if device not in inv_per_device:
            inv_per_device[device] = inv_scale.to(device, torch.float32, non_blocking=True).reshape(())
        torch._amp_foreach_non_finite_check_and_unscale_(
            [grads[i] for i in indices], flag_for(found, device), inv_per_device[device]
        )


def check_finite(grads: Sequence[Tensor], found: FoundInf) -> None:
    """found[device] > 0 if any grad holds inf or NaN; the grads are only read."""
    check_sparse(grads)
    per_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    for grad in grads:
        per_device[grad.device].append(grad)
    for device, tensors in per_device.items():
        implementation_for(tensors).check_finite_and_norm_(tensors, flag_for(found, device))


def add_(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """targets[i] += sources[i], one foreach call per (device, dtype) of the targets."""
    for _, indices in _groups(targets).items():
        torch._foreach_add_([targets[i] for i in indices], [sources[i].to(targets[i].dtype) for i in indices])


def copy_(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """targets[i].copy_(sources[i]) (casting), one foreach call per (device, dtype) of the targets."""
    for _, indices in _groups(targets).items():
        torch._foreach_copy_([targets[i] for i in indices], [sources[i] for i in indices])


def total_flag(found: FoundInf, device: torch.device) -> Tensor | None:
    """All flags of `found` summed onto `device` (None when there are none)."""
    flags = [flag.to(device, non_blocking=True) for flag in found.values()]
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).sum(0)


def any_flag_on_host(found: FoundInf) -> bool:
    """True if any flag is set: reads the device (a sync), for optimizers that cannot skip on it."""
    return any(float(flag.sum()) > 0 for flag in found.values())
