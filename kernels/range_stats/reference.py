"""The range statistics in plain torch: the family's contract (``amp_fx.kernels.range_stats``)
computed with torch ops, on any device."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.range_stats.arguments import check_record_range

__all__ = ["record_range_"]


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
