"""Overflow agreement across data-parallel ranks.

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

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


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
