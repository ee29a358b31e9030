"""The device state of `amp_fx.LossScaler`'s scale rule: the scale, its two trackers, and ``1 / scale``.

Numbers until the first scaled loss, then 0-dim tensors on its device (`ScaleTensors.create`): the
scale (float32), the growth and hysteresis trackers (int32), and ``1 / scale`` (GradScaler's fp64
reciprocal), which every write of the scale keeps current, so that ``unscale_`` launches nothing for
it. `ScaleTensors.update` applies the rule to overflow flags in one kernel launch for up to four
flags, i.e. optimizers x devices (`amp_fx.kernels` ``update_loss_scale_``: Triton on CUDA, its torch
reference elsewhere; more flags are summed by torch first), with no host sync.

    >>> import torch
    >>> tensors = ScaleTensors(8.0, growth_tracker=0, hysteresis_tracker=1)
    >>> tensors.create(torch.device("cpu")); tensors.inv_scale
    tensor(0.1250)
    >>> tensors.set_scale(2.0); tensors.scale_value(), tensors.inv_scale
    (2.0, tensor(0.5000))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels import implementation_for
from amp_fx.kernels.reference import reciprocal_scale_
from amp_fx.training.loss_scale_settings import LossScaleSettings, check_number

__all__ = ["ScaleTensors"]


class ScaleTensors:
    """The scale and its trackers: the ``initial`` numbers until `create`, then device tensors."""

    def __init__(self, scale: float, growth_tracker: int, hysteresis_tracker: int) -> None:
        # What the tensors start from, until they are created (a load sets them too).
        self.initial = (scale, growth_tracker, hysteresis_tracker)
        self.scale: Tensor | None = None
        self.growth_tracker: Tensor | None = None
        self.hysteresis_tracker: Tensor | None = None
        self.inv_scale: Tensor | None = None

    def create(self, device: torch.device) -> None:
        """Create the tensors on ``device``, from the ``initial`` numbers."""
        scale, growth_tracker, hysteresis_tracker = self.initial
        self.scale = torch.full((), scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), growth_tracker, dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.full((), hysteresis_tracker, dtype=torch.int32, device=device)
        self.inv_scale = torch.empty((), dtype=torch.float32, device=device)
        reciprocal_scale_(self.inv_scale, self.scale)

    def scale_value(self) -> float:
        """The scale as a Python float (a host sync once the tensors exist)."""
        return self.initial[0] if self.scale is None else float(self.scale.item())

    def growth_value(self) -> int:
        """The growth tracker's count (a host sync once the tensors exist)."""
        return self.initial[1] if self.growth_tracker is None else int(self.growth_tracker.item())

    def hysteresis_value(self) -> int:
        """The hysteresis tracker's count (a host sync once the tensors exist)."""
        return self.initial[2] if self.hysteresis_tracker is None else int(self.hysteresis_tracker.item())

    def on_host(self) -> ScaleTensors:
        """A copy holding the current values as numbers, its tensors not yet created (what a pickle
        holds: they are created again on the device of the first scaled loss)."""
        return ScaleTensors(self.scale_value(), self.growth_value(), self.hysteresis_value())

    def load(self, scale: float, growth_tracker: int, hysteresis_tracker: int) -> None:
        """Start from these values (checked by the caller): the tensors' too, where they exist."""
        self.initial = (scale, growth_tracker, hysteresis_tracker)
        if self.scale is not None:
            self.scale.fill_(scale)
            self.growth_tracker.fill_(growth_tracker)
            self.hysteresis_tracker.fill_(hysteresis_tracker)
            reciprocal_scale_(self.inv_scale, self.scale)

    def set_scale(self, new_scale: float | Tensor) -> None:
        """Set the scale (a positive number, or a one-element tensor, copied on the device)."""
        if isinstance(new_scale, Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise ValueError(
                    "new_scale must be a float or a one-element tensor that does not require grad"
                )
            self.scale.copy_(new_scale.reshape(()))
        else:
            check_number("new_scale", new_scale)
            if new_scale <= 0:
                raise ValueError(f"new_scale must be > 0, got {new_scale}")
            self.scale.fill_(float(new_scale))
        reciprocal_scale_(self.inv_scale, self.scale)

    def update(self, flags: Sequence[Tensor], settings: LossScaleSettings, *, zero_found_infs: bool) -> None:
        """Apply the scale rule of ``settings`` to the overflow ``flags`` (on the scale's device,
        summed), writing ``1 / scale`` too; ``zero_found_infs`` sets the flags to 0 after reading them."""
        implementation_for([self.scale]).update_loss_scale_(
            self.scale,
            self.growth_tracker,
            self.hysteresis_tracker,
            [flag.float() for flag in flags],
            growth_factor=settings.growth_factor,
            backoff_factor=settings.backoff_factor,
            growth_interval=settings.growth_interval,
            hysteresis=settings.hysteresis,
            min_scale=settings.min_scale,
            max_scale=settings.max_scale,
            inv_scale_out=self.inv_scale,
            zero_found_infs=zero_found_infs,
        )
