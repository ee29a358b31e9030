"""The range statistics in plain torch: the family's contract (``amp_fx.kernels.range_stats``)
computed with torch ops, on any device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.kernels.range_stats.arguments import check_kernel_record, check_record_range

__all__ = ["record_outputs_", "record_range_"]


@torch.no_grad()
def record_range_(value: Tensor, amax: Tensor, counts: Tensor, index: int) -> None:
    """Accumulate the largest magnitude and the underflow, non-finite and element counts of
    ``value`` into entry ``index``: the contract of ``amp_fx.kernels.range_stats``.

    Example:
        >>> amax, counts = torch.zeros(1), torch.zeros(3, dtype=torch.int64)
        >>> value = torch.tensor([1e-6, -3.0, float("inf"), float("nan"), 0.0], dtype=torch.float16)
        >>> record_range_(value, amax, counts, 0)
        >>> amax.tolist(), counts.tolist()
        ([inf], [1, 2, 5])
    """
    check_record_range(value, amax, counts, index)
    magnitude = value.detach().abs()
    largest = torch.where(torch.isnan(magnitude), 0, magnitude).amax().float() if value.numel() else None
    tiny = torch.finfo(value.dtype).tiny
    underflow = ((magnitude < tiny) & (magnitude > 0)).sum()
    nonfinite = (~torch.isfinite(magnitude)).sum()
    entry = amax.view(-1)[index]
    if largest is not None:
        torch.maximum(entry, largest, out=entry)
    three = counts.view(-1)[3 * index : 3 * index + 3]
    three[0].add_(underflow)
    three[1].add_(nonfinite)
    three[2].add_(value.numel())


def record_outputs_(record: KernelRecord | None, values: Sequence[Tensor | None]) -> None:
    """A fused kernel's ``record`` for its reference: `record_range_` of each value it wrote into
    that value's entry (``values`` in its contract's order, None where it writes none).

    Example:
        >>> amax, counts = torch.zeros(2), torch.zeros(6, dtype=torch.int64)
        >>> record_outputs_((amax, counts, (None, 1)), [torch.ones(2), torch.tensor([-4.0])])
        >>> amax.tolist(), counts.tolist()
        ([0.0, 4.0], [0, 0, 0, 0, 0, 1])
    """
    if record is None:
        return
    check_kernel_record(record, values)
    amax, counts, indices = record
    for value, index in zip(values, indices, strict=True):
        if index is not None:
            record_range_(value, amax, counts, index)
