"""A `amp_fx.LossScaler`'s settings (the scale rule's factors, interval, hysteresis and bounds) and
their checks: every value is checked before the scaler changes, in its constructor, its setters and
``load_state_dict``.

Example:
    >>> check_config(1024.0, 2.0, 0.5, 2000, 1, None, 2.0**24)
    >>> check_config(1024.0, 0.5, 0.5, 2000, 1, None, None)
    Traceback (most recent call last):
    ...
    ValueError: growth_factor must be > 1.0, got 0.5
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from amp_fx.kernels.loss_scale.arguments import check_scale_bound, check_tracker_count

__all__ = ["LossScaleSettings", "check_config", "check_number", "checked_state_dict_values"]


def check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        kind = "an int" if integer else "a finite number"
        raise TypeError(f"{name} must be {kind}, got {value!r}")


def check_config(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
) -> None:
    """Raise TypeError/ValueError for a bad scaler configuration (constructor and load_state_dict)."""
    if isinstance(init_scale, str):
        raise TypeError(
            f"LossScaler's first argument is init_scale, got {init_scale!r}: unlike torch.amp.GradScaler it "
            "takes no device (the scale lives on the device of the first scaled loss); drop that argument"
        )
    check_number("init_scale", init_scale)
    check_number("growth_factor", growth_factor)
    check_number("backoff_factor", backoff_factor)
    check_number("growth_interval", growth_interval, integer=True)
    check_number("hysteresis", hysteresis, integer=True)
    if init_scale <= 0:
        raise ValueError(f"init_scale must be > 0, got {init_scale}")
    if growth_factor <= 1.0:
        raise ValueError(f"growth_factor must be > 1.0, got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
    # Both in [1, 2**31 - 1], the trackers counting up to them being int32 (hysteresis 1 backs off at
    # the first overflow).
    check_tracker_count("growth_interval", growth_interval, 1)
    check_tracker_count("hysteresis", hysteresis, 1)
    for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None:
            check_number(name, bound)
            check_scale_bound(name, bound)
    low = min_scale if min_scale is not None else 0.0
    high = max_scale if max_scale is not None else math.inf
    if low > high:
        raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale})")
    if not low <= init_scale <= high:
        raise ValueError(
            f"the scale {init_scale} is outside [min_scale, max_scale] = [{min_scale}, {max_scale}]; "
            "widen the bounds or change the scale"
        )


def checked_state_dict_values(
    state_dict: dict[str, Any], hysteresis: int, min_scale: float | None, max_scale: float | None
) -> tuple[dict[str, Any], Any, Any]:
    """The configuration ``state_dict`` holds, as keyword arguments of `check_config` (already
    checked), and its growth and hysteresis trackers; ``hysteresis``, ``min_scale`` and
    ``max_scale`` (the scaler's current ones) stand in for keys GradScaler does not write. Raises
    ValueError/TypeError for a bad state. Reads tensors' values (a host sync).
    """
    required = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    missing = [key for key in required if key not in state_dict]
    if missing:
        raise ValueError(
            f"the loaded scaler state dict lacks {missing}; load one from LossScaler.state_dict()"
        )

    def number(key: str, default: Any) -> Any:
        value = state_dict.get(key, default)
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"'{key}' must be a number or a one-element tensor, got shape {tuple(value.shape)}"
                )
            value = value.item()
        return value

    values = {
        "init_scale": number("scale", None),
        "growth_factor": number("growth_factor", None),
        "backoff_factor": number("backoff_factor", None),
        "growth_interval": number("growth_interval", None),
        "hysteresis": number("hysteresis", hysteresis),
        "min_scale": number("min_scale", min_scale),
        "max_scale": number("max_scale", max_scale),
    }
    check_config(**values)
    growth_tracker = number("_growth_tracker", None)
    hysteresis_tracker = number("_hysteresis_tracker", values["hysteresis"])
    check_number("_growth_tracker", growth_tracker, integer=True)
    check_number("_hysteresis_tracker", hysteresis_tracker, integer=True)
    check_tracker_count("_growth_tracker", int(growth_tracker), 0)
    if not 0 <= hysteresis_tracker <= values["hysteresis"]:
        raise ValueError(
            f"_hysteresis_tracker ({hysteresis_tracker}) must be in [0, hysteresis={values['hysteresis']}]"
        )
    return values, growth_tracker, hysteresis_tracker


class LossScaleSettings:
    """The settings of the scale rule, with GradScaler's getters and setters; a base of
    `amp_fx.LossScaler`, which documents them. Each setter checks the whole configuration with
    the new value before it stores it."""

    _init_scale: float
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _hysteresis: int
    _min_scale: float | None
    _max_scale: float | None

    def _set_settings(
        self,
        init_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        min_scale: float | None,
        max_scale: float | None,
    ) -> None:
        """Check every setting, then store them all."""
        check_config(
            init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
        )
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        check_config(
            self._init_scale,
            new_factor,
            self._backoff_factor,
            self._growth_interval,
            self._hysteresis,
            self._min_scale,
            self._max_scale,
        )
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by on overflow."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        check_config(
            self._init_scale,
            self._growth_factor,
            new_factor,
            self._growth_interval,
            self._hysteresis,
            self._min_scale,
            self._max_scale,
        )
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        """The number of consecutive clean steps before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1)."""
        check_config(
            self._init_scale,
            self._growth_factor,
            self._backoff_factor,
            new_interval,
            self._hysteresis,
            self._min_scale,
            self._max_scale,
        )
        self._growth_interval = int(new_interval)

    def get_hysteresis(self) -> int:
        """The number of consecutive overflowing steps before the scale backs off."""
        return self._hysteresis

    def get_min_scale(self) -> float | None:
        """The lower bound of the scale (None: unbounded)."""
        return self._min_scale

    def get_max_scale(self) -> float | None:
        """The upper bound of the scale (None: unbounded)."""
        return self._max_scale
