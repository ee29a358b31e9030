"""Overflow agreement across data-parallel ranks, and the local shards of FSDP2's DTensors.

DDP's gradient all-reduce already spreads an inf/NaN from one rank's backward to every rank, but
a gradient changed after the all-reduce (a hook, a sharded optimizer, a manual edit) would let
ranks disagree: one skips the step, the others take it, and the replicas drift apart for good.
`LossScaler` therefore max-reduces its overflow flags over the process group before any optimizer
reads them. The reduce is a device collective (NCCL on GPUs): no host sync, and CUDA-graph safe.

Example (inside a ``torchrun`` job)::

    >>> found_infs = {torch.device("cuda", 0): torch.zeros(1, device="cuda")}  # doctest: +SKIP
    >>> agree_on_overflow_(found_infs, group=None)  # doctest: +SKIP
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def agree_on_overflow_(found_infs: Mapping[torch.device, torch.Tensor], group: Any = None) -> None:
    """Set every rank's overflow flags to the maximum over ``group`` (default: the whole world), in place.

    Does nothing when torch.distributed is not initialised or the group has one rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size(group) == 1:
        return
    for found_inf in found_infs.values():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2's parameters), without importing torch.distributed.tensor.

    >>> is_dtensor(torch.ones(2))
    False
    """
    # A DTensor exists only once torch.distributed.tensor is imported; importing it here would add
    # about half a second to every `import amp_fx.optim`.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def is_fsdp_module(module: Any) -> bool:
    """Whether FSDP2's ``fully_shard`` has sharded ``module`` (its class is then an ``FSDPModule``
    subclass), without importing torch.distributed.fsdp (seconds) where no one has.

    >>> is_fsdp_module(torch.nn.Linear(2, 2))
    False
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def local_tensor(tensor: Tensor) -> Tensor:
    """The rank's local shard of a ``DTensor`` (FSDP2's parameters, grads, state); else ``tensor``.

    Example:
        >>> local_tensor(torch.ones(2))
        tensor([1., 1.])
    """
    return tensor.to_local() if is_dtensor(tensor) else tensor


def shard_groups(tensors: Iterable[Tensor]) -> list[Any]:
    """The process groups over which ``tensors`` (DTensors) are sharded, one per sharded mesh dimension.

    A sum over local shards, all-reduced over these groups in turn, is the sum over the whole
    tensors. Empty when no tensor is a DTensor. Refused when only some are, or when they are
    sharded differently: a sum over their local shards would count some elements more than once.

    Example:
        >>> shard_groups([torch.ones(2)])
        []
    """
    layouts = set()
    plain = 0
    for tensor in tensors:
        if is_dtensor(tensor):
            sharded_dims = tuple(i for i, p in enumerate(tensor.placements) if p.is_shard())
            layouts.add((tensor.device_mesh, sharded_dims))
        else:
            plain += 1
    if not layouts:
        return []
    if plain or len(layouts) > 1:
        raise ValueError(
            "the gradients mix plain tensors and DTensors, or DTensors sharded over different mesh "
            "dimensions; clip_grad_norm_ sums local shards over one layout: shard every parameter the "
            "optimizer holds with the same fully_shard mesh"
        )
    mesh, sharded_dims = layouts.pop()
    return [mesh.get_group(dim) for dim in sharded_dims]
