"""Device-side gradient arithmetic shared by the amp optimizer strategies: unscale, check, add, copy,
scale, cast.

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
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from amp_fx.kernels import implementation_for
from amp_fx.optim import torch_optimizer_scaling
from amp_fx.optim.torch_optimizer_scaling import FoundInf, flag_for

# One factor for all devices, or one per device (None, or no entry: leave that device's tensors alone).
Factors = Tensor | Mapping[torch.device, Tensor | None]


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


def _apply_factor(
    op: Callable[[list[Tensor], Tensor], list[Tensor] | None], tensors: Sequence[Tensor], factors: Factors
) -> list[Tensor]:
    """op(group, factor) per (device, dtype) group of `tensors`, the factor cast (once per group) to the
    group's device and dtype, as ``tensor.mul_(factor.to(tensor.dtype))`` would; its results in order."""
    results = list(tensors)
    for (device, dtype), indices in _groups(tensors).items():
        factor = factors.get(device) if isinstance(factors, Mapping) else factors
        if factor is None:
            continue
        # 0-dim: the foreach ops take no other scalar tensor (and it scales 0-dim tensors in place).
        out = op([tensors[i] for i in indices], factor.to(device, dtype).reshape(()))
        if out is not None:  # an out-of-place op
            for i, result in zip(indices, out, strict=True):
                results[i] = result
    return results


def mul_(tensors: Sequence[Tensor], factors: Factors) -> None:
    """tensors[i] *= factor in the tensor's dtype, one foreach call per (device, dtype)."""
    _apply_factor(torch._foreach_mul_, tensors, factors)


def div_(tensors: Sequence[Tensor], factors: Factors) -> None:
    """tensors[i] /= factor in the tensor's dtype, one foreach call per (device, dtype)."""
    _apply_factor(torch._foreach_div_, tensors, factors)


def divided(tensors: Sequence[Tensor], factors: Factors) -> list[Tensor]:
    """tensors[i] / factor, new tensors (a tensor without a factor comes back itself)."""
    return _apply_factor(torch._foreach_div, tensors, factors)


def converted(
    tensors: Sequence[Tensor], dtypes: torch.dtype | Sequence[torch.dtype], copy: bool = False
) -> list[Tensor]:
    """``[t.to(dtype, copy=copy) for ...]`` (same strides), one foreach copy per (device, dtype) group."""
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(tensors)
    results = list(tensors)
    cast = [i for i, tensor in enumerate(tensors) if copy or tensor.dtype != dtypes[i]]
    for i in cast:
        results[i] = torch.empty_like(tensors[i], dtype=dtypes[i])
    copy_([results[i] for i in cast], [tensors[i] for i in cast])
    return results
