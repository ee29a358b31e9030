"""`amp_fx.LossScaler`'s state dict (its settings, scale and trackers as plain Python numbers),
and its pickles of earlier versions.

A superset of torch.amp.GradScaler's format, so that either loads the other's: GradScaler's keys
``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``, then
ours, ``hysteresis``, ``_hysteresis_tracker``, ``min_scale``, ``max_scale``. Plain numbers load
with ``torch.load(..., weights_only=True)``. `read_state_dict` checks every value before the
scaler takes any.

Example:
    >>> settings = LossScaleSettings(2.0, 0.5, 2000, hysteresis=2, min_scale=None, max_scale=None)
    >>> saved = state_dict_of(ScalerState(settings, scale=1024.0, growth_tracker=3, hysteresis_tracker=2))
    >>> read_state_dict({**saved, "growth_interval": 10}, settings).settings.growth_interval
    10
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, NamedTuple

from torch import Tensor

from amp_fx.kernels.loss_scale.arguments import check_tracker_count
from amp_fx.training.loss_scale_settings import LossScaleSettings, check_number, check_scale
from amp_fx.training.loss_scale_tensors import ScaleTensors

__all__ = ["ScalerState", "read_state_dict", "state_dict_of", "upgraded_pickle"]

# The settings each state dict key holds; GradScaler writes the first three, not the others.
_SETTING_KEYS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale")
_REQUIRED_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class ScalerState(NamedTuple):
    """What a state dict holds: the settings, the scale and the two trackers' counts."""

    settings: LossScaleSettings
    scale: float
    growth_tracker: int
    hysteresis_tracker: int


def state_dict_of(state: ScalerState) -> dict[str, Any]:
    """The state dict of ``state`` (`amp_fx.LossScaler.state_dict` documents it)."""
    settings = state.settings
    return {
        "scale": state.scale,
        "growth_factor": settings.growth_factor,
        "backoff_factor": settings.backoff_factor,
        "growth_interval": settings.growth_interval,
        "_growth_tracker": state.growth_tracker,
        "hysteresis": settings.hysteresis,
        "_hysteresis_tracker": state.hysteresis_tracker,
        "min_scale": settings.min_scale,
        "max_scale": settings.max_scale,
    }


def read_state_dict(state_dict: Any, current: LossScaleSettings) -> ScalerState:
    """The state ``state_dict`` holds, every value checked (TypeError/ValueError otherwise).

    Keys GradScaler does not write (hysteresis, bounds) keep their values in ``current``; a
    missing ``_hysteresis_tracker`` is a full one. A value may be a one-element tensor, read to
    the host (a sync).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"state_dict must be a dict from LossScaler.state_dict(), got {type(state_dict).__name__}"
        )
    if not state_dict:
        raise ValueError(
            "the loaded scaler state dict is empty: it was saved from a disabled scaler (enabled=False); "
            "create this scaler with enabled=False too, or load a state dict from an enabled one"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in state_dict]
    if missing:
        raise ValueError(
            f"the loaded scaler state dict lacks {missing}; load one from LossScaler.state_dict()"
        )
    values = {key: _number(state_dict, key) for key in (*_REQUIRED_KEYS, *_SETTING_KEYS) if key in state_dict}
    settings = replace(current, **{key: values[key] for key in _SETTING_KEYS if key in values})
    check_scale("scale", values["scale"], settings)
    growth_tracker = values["_growth_tracker"]
    hysteresis_tracker = _number(state_dict, "_hysteresis_tracker", settings.hysteresis)
    check_number("_growth_tracker", growth_tracker, integer=True)
    check_number("_hysteresis_tracker", hysteresis_tracker, integer=True)
    check_tracker_count("_growth_tracker", growth_tracker, 0)
    if not 0 <= hysteresis_tracker <= settings.hysteresis:
        raise ValueError(
            f"_hysteresis_tracker ({hysteresis_tracker}) must be in [0, hysteresis={settings.hysteresis}]"
        )
    return ScalerState(settings, float(values["scale"]), int(growth_tracker), int(hysteresis_tracker))


def _number(state_dict: dict[str, Any], key: str, default: Any = None) -> Any:
    """``state_dict[key]`` (or ``default``), a one-element tensor read as a Python number."""
    value = state_dict.get(key, default)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"'{key}' must be a number or a one-element tensor, got shape {tuple(value.shape)}"
            )
        value = value.item()
    return value


def upgraded_pickle(state: dict[str, Any]) -> dict[str, Any]:
    """The ``__dict__`` a LossScaler pickled by an earlier version holds, in today's layout (a
    pickle of today's is returned as it is)."""
    state = dict(state)
    if "_settings" not in state:  # a version that kept each setting in an attribute
        names = [field.name for field in fields(LossScaleSettings)]
        state["_settings"] = LossScaleSettings(**{name: state.pop(f"_{name}") for name in names})
    if "_tensors" not in state:  # a version that kept the device state in attributes
        kinds = ("scale", "growth_tracker", "hysteresis_tracker")
        initial = [state.pop(f"_init_{kind}") for kind in kinds]
        for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_inv_scale"):
            state.pop(name, None)  # None: pickles hold no tensors
        state["_tensors"] = ScaleTensors(*initial)
    state.pop("_scaled_at", None)  # a version before active_scalers kept it here
    return state
