"""Device-side gradient arithmetic shared by the amp optimizer strategies: unscale, check, add, copy.

Every function takes lists of tensors that may span devices and dtypes, groups them, and runs one
foreach call per group; overflow flags are float32 tensors of shape (1,), one per device, that
only ever accumulate (never cleared here). The unscale itself is `amp_fx.LossScaler`'s
(`amp_fx.optim.torch_optimizer_scaling`). Nothing here reads a value on the host::

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
from amp_fx.optim import torch_optimizer_scaling
from amp_fx.optim.torch_optimizer_scaling import FoundInf, flag_for


def _groups(tensors: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        groups[(tensor.device, tensor.dtype)].append(index)
    return groups


def check_sparse(grads: Sequence[Tensor]) -> None:
    if any(grad.is_sparse for grad in grads):
        raise ValueError(
            "amp_fx.amp does not unscale sparse gradients; build the embedding with sparse=False "
            "(the default) when training with amp"
        )


def unscale_and_check_(grads: Sequence[Tensor], inv_scale: Tensor, found: FoundInf) -> None:
    """grads *= inv_scale in place; found[device] > 0 afterwards if any grad held inf or NaN."""
    check_sparse(grads)
    torch_optimizer_scaling.unscale_and_check_(grads, inv_scale, found)


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
