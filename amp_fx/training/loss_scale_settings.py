"""The settings of `amp_fx.LossScaler`'s scale rule, frozen and checked once, where they are made.

`LossScaleSettings` holds the factors, the growth interval, the hysteresis and the bounds; its
``__post_init__`` is the one check of them, so a scaler changes a setting with
``dataclasses.replace``, which raises for a bad value before the scaler holds the result. The
scale itself is state, not a setting: `check_scale` checks one against the settings' bounds.

Example:
    >>> from dataclasses import replace
    >>> settings = LossScaleSettings(2.0, 0.5, 2000, hysteresis=1, min_scale=None, max_scale=2.0**24)
    >>> replace(settings, growth_interval=100).growth_interval
    100
    >>> replace(settings, growth_factor=0.5)
    Traceback (most recent call last):
    ...
    ValueError: growth_factor must be > 1.0, got 0.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from amp_fx.kernels.loss_scale.arguments import check_scale_bound, check_tracker_count

__all__ = ["LossScaleSettings", "check_number", "check_scale"]


def check_number(name: str, value: Any, *, integer: bool = False) -> None:
    """Raise TypeError unless ``value`` is a finite int or float (an int with ``integer=True``);
    bools are refused.

    >>> check_number("growth_interval", 2.5, integer=True)
    Traceback (most recent call last):
    ...
    TypeError: growth_interval must be an int, got 2.5
    """
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        kind = "an int" if integer else "a finite number"
        raise TypeError(f"{name} must be {kind}, got {value!r}")


@dataclass(frozen=True)
class LossScaleSettings:
    """How the scale moves (`amp_fx.LossScaler` documents each setting); no defaults here, the
    scaler's signature holds them. Checked on creation (TypeError/ValueError), and stored as
    float/int whatever numbers were given, as GradScaler's getters return them.

    Attributes:
        growth_factor: > 1.
        backoff_factor: in (0, 1).
        growth_interval, hysteresis: ints in [1, 2**31 - 1] (the trackers counting to them are int32).
        min_scale, max_scale: None (unbounded) or in (0, float32 max], ``min_scale <= max_scale``.
    """

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float | None
    max_scale: float | None

    def __post_init__(self) -> None:
        check_number("growth_factor", self.growth_factor)
        check_number("backoff_factor", self.backoff_factor)
        check_number("growth_interval", self.growth_interval, integer=True)
        check_number("hysteresis", self.hysteresis, integer=True)
        if self.growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1.0, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        # Hysteresis 1 backs off at the first overflow.
        check_tracker_count("growth_interval", self.growth_interval, 1)
        check_tracker_count("hysteresis", self.hysteresis, 1)
        for name in ("min_scale", "max_scale"):
            bound = getattr(self, name)
            if bound is not None:
                check_number(name, bound)
                check_scale_bound(name, bound)
        if self.lowest > self.highest:
            raise ValueError(f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})")
        # Frozen: the checked values are stored in the types the getters promise.
        for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            object.__setattr__(self, name, None if value is None else float(value))
        for name in ("growth_interval", "hysteresis"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def lowest(self) -> float:
        """The lowest scale allowed (``min_scale``, or 0)."""
        return 0.0 if self.min_scale is None else self.min_scale

    @property
    def highest(self) -> float:
        """The highest scale allowed (``max_scale``, or infinity)."""
        return math.inf if self.max_scale is None else self.max_scale


def check_scale(name: str, scale: Any, settings: LossScaleSettings) -> None:
    """Raise TypeError/ValueError unless ``scale`` is a positive number within the settings' bounds
    (a scaler's starting scale: ``init_scale``, or the one a state dict holds).

    >>> settings = LossScaleSettings(2.0, 0.5, 2000, hysteresis=1, min_scale=None, max_scale=64.0)
    >>> check_scale("init_scale", 64.0, settings)
    >>> check_scale("init_scale", 128.0, settings)
    Traceback (most recent call last):
    ...
    ValueError: the scale 128.0 is outside [min_scale, max_scale] = [None, 64.0]; widen the bounds ...
    """
    check_number(name, scale)
    if scale <= 0:
        raise ValueError(f"{name} must be > 0, got {scale}")
    if not settings.lowest <= scale <= settings.highest:
        raise ValueError(
            f"the scale {scale} is outside [min_scale, max_scale] = [{settings.min_scale}, "
            f"{settings.max_scale}]; widen the bounds or change the scale"
        )
