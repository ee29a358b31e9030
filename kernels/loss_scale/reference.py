"""The dynamic loss-scale update in plain torch: the family's contract (``amp_fx.kernels.loss_scale``,
which has the rule) computed with torch ops, on any device, and ``reciprocal_scale_``, the inverse
scale GradScaler's unscale multiplies by."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.loss_scale.arguments import check_loss_scale_arguments

__all__ = ["reciprocal_scale_", "update_loss_scale_"]


@torch.no_grad()
def update_loss_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_infs: Sequence[Tensor],
    *,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None = None,
    max_scale: float | None = None,
    inv_scale_out: Tensor | None = None,
    zero_found_infs: bool = False,
) -> None:
    """One step of the dynamic loss-scale rule (`amp_fx.LossScaler`'s), in place on device tensors:
    the contract of ``amp_fx.kernels.loss_scale``.

    Example:
        >>> scale = torch.tensor(1024.0)
        >>> growth, hyst = torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
        >>> update_loss_scale_(scale, growth, hyst, [torch.ones(1)], growth_factor=2.0, backoff_factor=0.5,
        ...                    growth_interval=2000, hysteresis=1)
        >>> scale
        tensor(512.)
    """
    check_loss_scale_arguments(
        scale,
        growth_tracker,
        hysteresis_tracker,
        found_infs,
        inv_scale_out,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        max_scale,
    )
    flags = [f.reshape(()) for f in found_infs]
    found_inf = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
    old_scale = scale.reshape(())
    overflow = found_inf > 0
    new_hysteresis = torch.where(overflow, (hysteresis_tracker.reshape(()) - 1).clamp(min=0), hysteresis)
    back_off = overflow & (new_hysteresis == 0)
    successful = growth_tracker.reshape(()) + 1
    grow = ~overflow & (successful >= growth_interval)
    new_growth_tracker = torch.where(overflow | grow, 0, successful)
    # The factor products in fp64, rounded once to fp32: what torch._amp_update_scale_ computes.
    wide = old_scale.double()
    backed_off = (wide * backoff_factor).float()
    if min_scale is not None:
        backed_off = backed_off.clamp(min=min_scale)
    grown = (wide * growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, old_scale)  # as GradScaler: never grow to inf
    if max_scale is not None:
        grown = grown.clamp(max=max_scale)
    scale.copy_(torch.where(back_off, backed_off, torch.where(grow, grown, old_scale)))
    growth_tracker.copy_(new_growth_tracker)
    hysteresis_tracker.copy_(new_hysteresis)
    if inv_scale_out is not None:
        reciprocal_scale_(inv_scale_out, scale)
    if zero_found_infs:
        torch._foreach_zero_(list(found_infs))


@torch.no_grad()
def reciprocal_scale_(out: Tensor, scale: Tensor) -> None:
    """``out = fp32(1 / fp64(scale))``: GradScaler's reciprocal, in fp64 so that it is exact for any
    float32 power of two (a float32 reciprocal of 2^-127 or below would overflow or flush).

    Example:
        >>> out = torch.empty(()); reciprocal_scale_(out, torch.tensor(1024.0)); out
        tensor(0.0010)
    """
    out.copy_(scale.double().reciprocal().float().reshape(out.shape))
