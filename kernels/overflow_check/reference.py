"""The overflow check in plain torch: the family's contract (``amp_fx.kernels.overflow_check``)
computed with torch ops, on any device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.optimizer_step import scaled_grad
from amp_fx.kernels.overflow_check.arguments import check_grads

__all__ = ["check_finite_and_norm_"]


@torch.no_grad()
def check_finite_and_norm_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    *,
    grad_multiplier: Tensor | None = None,
    sq_norm_out: Tensor | None = None,
) -> None:
    """Set ``found_inf`` to 1.0 if any grad holds an inf or NaN; optionally accumulate the squared
    norm: the contract of ``amp_fx.kernels.overflow_check``.

    Example:
        >>> found_inf, sq = torch.zeros(1), torch.zeros(1)
        >>> check_finite_and_norm_([torch.tensor([3.0, 4.0])], found_inf, sq_norm_out=sq)
        >>> found_inf.item(), sq.item()
        (0.0, 25.0)
    """
    check_grads(grads, found_inf, grad_multiplier, sq_norm_out)
    if len(grads) == 0:
        return
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    found_inf.copy_(torch.where(finite, found_inf, torch.ones_like(found_inf)))
    if sq_norm_out is not None:
        sums = [scaled_grad(g, grad_multiplier).square().sum() for g in grads]
        sq_norm_out.add_(torch.stack(sums).sum())
