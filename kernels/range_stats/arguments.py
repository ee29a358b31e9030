"""The range statistics' argument checks, shared by the reference and the Triton kernel (metadata
only: they never read a value)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.arguments import KERNEL_DTYPES, check_dtype
from amp_fx.kernels.range_stats import COUNT_FIELDS

__all__ = ["check_kernel_record", "check_record_range"]


def check_record_range(value: Tensor, amax: Tensor, counts: Tensor, index: int) -> None:
    """Validate the arguments of ``record_range_``; raise TypeError/ValueError.

    Example:
        >>> check_record_range(torch.ones(2), torch.zeros(4), torch.zeros(12, dtype=torch.int64), 3)
    """
    for name, tensor in (("value", value), ("amax", amax), ("counts", counts)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    check_dtype("value", value.dtype, KERNEL_DTYPES)
    if amax.dtype != torch.float32 or not amax.is_contiguous():
        raise ValueError(f"amax must be a contiguous float32 tensor, got {amax.dtype}")
    if counts.dtype != torch.int64 or not counts.is_contiguous():
        raise ValueError(f"counts must be a contiguous int64 tensor, got {counts.dtype}")
    if counts.numel() != len(COUNT_FIELDS) * amax.numel():
        raise ValueError(
            f"counts must hold {len(COUNT_FIELDS)} entries per entry of amax ({amax.numel()}), "
            f"got {counts.numel()}"
        )
    if not isinstance(index, int) or not 0 <= index < amax.numel():
        raise ValueError(f"index must be an int in [0, {amax.numel()}), got {index!r}")
    for name, tensor in (("amax", amax), ("counts", counts)):
        if tensor.device != value.device:
            raise ValueError(
                f"{name} is on {tensor.device} but value is on {value.device}; keep them on one device"
            )


def check_kernel_record(record: object, values: Sequence[Tensor | None]) -> None:
    """Validate a fused kernel's ``record=(amax, counts, indices)`` argument against the values it
    writes (``values`` in its contract's order; None where it writes none); raise TypeError/ValueError.

    Example:
        >>> record = (torch.zeros(4), torch.zeros(12, dtype=torch.int64), (3, None))
        >>> check_kernel_record(record, [torch.ones(2, dtype=torch.float16), None])
    """
    if not (isinstance(record, tuple) and len(record) == 3 and isinstance(record[2], tuple)):
        raise TypeError(
            f"record must be a tuple (amax, counts, indices) with a tuple of indices, got {record!r}"
        )
    amax, counts, indices = record
    if len(indices) != len(values):
        raise ValueError(
            f"record holds {len(indices)} indices, one per value the kernel writes ({len(values)})"
        )
    for value, index in zip(values, indices, strict=True):
        if index is None:
            continue
        if value is None:
            raise ValueError("record asks for a value this call does not write (an index where it has None)")
        check_record_range(value, amax, counts, index)
