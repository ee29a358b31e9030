"""Bit-for-bit tensor comparison, for tests whose contract is "unchanged" or "identical", not "close"."""

from __future__ import annotations

import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when both tensors have the same dtype, shape and bit pattern (NaN == NaN).

    >>> bits_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    True
    >>> bits_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    False
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().reshape(-1).contiguous().view(torch.uint8),
        b.detach().reshape(-1).contiguous().view(torch.uint8),
    )
