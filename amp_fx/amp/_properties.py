"""Apex's opt-level property table (O0-O3) and the consistency checks it applies to overrides.

The table is a view of amp_fx's opt-level table (`amp_fx.core.opt_levels`), in Apex's names.

`amp.initialize` starts from the preset of the chosen opt level and applies every keyword that is
not None as an override, in Apex's order, checking each against the opt level the way Apex did
(e.g. O1 keeps model weights FP32, so `cast_model_type=torch.float16` with O1 is refused)::

    >>> props = resolve_properties("O2", keep_batchnorm_fp32="False", loss_scale="128.0")
    >>> props.keep_batchnorm_fp32, props.loss_scale, props.master_weights
    (False, 128.0, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from amp_fx.core import opt_levels
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES, short_repr
from amp_fx.core.opt_levels import OPT_LEVEL_TABLE, OptLevel, lookup_opt_level

__all__ = [
    "LOW_PRECISION_DTYPES",
    "AmpConfigError",
    "Properties",
    "check_loss_scale_bounds",
    "check_opt_level",
    "opt_level_defaults",
    "resolve_properties",
]


class AmpConfigError(ValueError, RuntimeError):
    """A bad `amp.initialize` argument or property combination.

    A ValueError like every amp_fx argument error, and a RuntimeError because that is what Apex
    raised for the same mistakes, so `except RuntimeError` written for Apex keeps working.
    """


@dataclass(frozen=True)
class Properties:
    """The options an opt level stands for, with Apex's names and meanings."""

    enabled: bool = False
    opt_level: str | None = None
    # The dtype the model's weights are stored in; None/False leaves them as they are (O1).
    cast_model_type: torch.dtype | None | bool = None
    # O1's op-level casts (Apex patched torch functions; amp_fx inserts the casts into the graph).
    patch_torch_functions: bool = False
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | None = None
    # "dynamic" or a fixed scale.
    loss_scale: float | str = 1.0

    def items(self) -> list[tuple[str, Any]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


# One line per opt level, as Apex's startup message shows it.
OPT_LEVEL_BRIEF = {name: f"{name}:  {level.description}" for name, level in OPT_LEVEL_TABLE.items()}


def _apex_row(level: OptLevel) -> dict[str, Any]:
    # Apex leaves the properties that O1's per-op casts make moot as None. Its tables name
    # float16 for low weights; `amp.initialize(dtype=...)` picks bfloat16.
    per_op = level.uses_autocast_op_lists
    return dict(
        cast_model_type=torch.float16 if level.stores_weights_low else None if per_op else torch.float32,
        patch_torch_functions=per_op,
        keep_batchnorm_fp32=level.keeps_batchnorm_fp32 if level.stores_weights_low else None,
        master_weights=None if per_op else level.keeps_fp32_masters,
        loss_scale="dynamic" if level.dynamic_loss_scale else 1.0,
    )


# Apex's property table. `enabled` and `opt_level` are set from the arguments.
OPT_LEVEL_PRESETS: dict[str, dict[str, Any]] = {
    name: _apex_row(level) for name, level in OPT_LEVEL_TABLE.items()
}


def check_opt_level(opt_level: Any) -> str:
    """`amp_fx.core.opt_levels.check_opt_level`, raising Apex's `AmpConfigError` for any bad value."""
    try:
        return opt_levels.check_opt_level(opt_level)
    except (TypeError, ValueError) as error:
        raise AmpConfigError(str(error)) from None


def opt_level_defaults(opt_level: str) -> Properties:
    """The preset of an opt level, before any override."""
    level = check_opt_level(opt_level)
    return Properties(enabled=True, opt_level=level, **OPT_LEVEL_PRESETS[level])


def _casts_per_op(props: Properties) -> bool:
    # O1: its weights stay FP32 and autocast's lists cast around each op, which rules out the
    # properties of low weights.
    return lookup_opt_level(props.opt_level).uses_autocast_op_lists


def _check_cast_model_type(props: Properties, value: Any) -> Any:
    if value is not None and value is not False and value not in (torch.float32, *LOW_PRECISION_DTYPES):
        raise AmpConfigError(
            f"cast_model_type={short_repr(value)} is not supported: use torch.float16, torch.bfloat16, "
            "torch.float32 or None"
        )
    if _casts_per_op(props) and value not in (None, False, torch.float32):
        raise AmpConfigError(
            "O1 casts around each op and keeps the model weights themselves FP32, so "
            f"cast_model_type must stay None with O1 (it was {value}); to store the weights in low "
            "precision use opt_level='O2' or 'O3'"
        )
    return value


def _check_patch_torch_functions(props: Properties, value: Any) -> bool:
    if not isinstance(value, bool):
        raise AmpConfigError(f"patch_torch_functions must be True, False or None, not {short_repr(value)}")
    if not _casts_per_op(props) and value:
        raise AmpConfigError(
            "patch_torch_functions=True (op-level casts) is what opt_level='O1' selects; "
            "choose opt_level='O1' instead of setting it on another opt level"
        )
    return value


def _check_keep_batchnorm_fp32(props: Properties, value: Any) -> bool | None:
    if _casts_per_op(props) and value is not None:
        raise AmpConfigError(
            "with opt_level O1 batchnorm already runs in FP32 through the op lists, so "
            f"keep_batchnorm_fp32 must be None (it was {short_repr(value)})"
        )
    if value == "True":
        return True
    if value == "False":
        return False
    if value is True or value is False or value is None:
        return value
    raise AmpConfigError(
        "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, "
        f"found keep_batchnorm_fp32={short_repr(value)}"
    )


def _check_master_weights(props: Properties, value: Any) -> bool | None:
    if _casts_per_op(props) and value is not None:
        raise AmpConfigError(
            "master_weights make no sense with O1: its model weights are FP32 already; leave "
            "master_weights=None, or use opt_level='O2' for low-precision weights with FP32 masters"
        )
    if value is not None and not isinstance(value, bool):
        raise AmpConfigError(f"master_weights must be True, False or None, not {short_repr(value)}")
    return value


def _check_loss_scale(props: Properties, value: Any) -> float | str:
    if value == "dynamic":
        return value
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise AmpConfigError(
            "loss_scale must be 'dynamic' or a number (or a string of one, e.g. '128.0'), not "
            f"{short_repr(value)}"
        ) from None
    if not math.isfinite(scale) or scale <= 0:
        raise AmpConfigError(
            f"loss_scale must be a positive finite number or 'dynamic', not {short_repr(value)}"
        )
    return scale


# Apex's override order; each check sees the opt level already in place.
_OVERRIDE_CHECKS = (
    ("cast_model_type", _check_cast_model_type),
    ("patch_torch_functions", _check_patch_torch_functions),
    ("keep_batchnorm_fp32", _check_keep_batchnorm_fp32),
    ("master_weights", _check_master_weights),
    ("loss_scale", _check_loss_scale),
)


def resolve_properties(opt_level: str = "O1", **overrides: Any) -> Properties:
    """The opt level's preset with every override that is not None applied and checked.

    Raises `AmpConfigError` (a ValueError and RuntimeError) for an unknown opt level, an unknown
    override name or a value the opt level does not allow, as Apex did.
    """
    unknown = set(overrides) - {name for name, _ in _OVERRIDE_CHECKS}
    if unknown:
        raise AmpConfigError(
            f"unknown property {sorted(unknown)}: known are {[n for n, _ in _OVERRIDE_CHECKS]}"
        )
    props = opt_level_defaults(opt_level)
    for name, check in _OVERRIDE_CHECKS:
        value = overrides.get(name)
        if value is not None:
            props = replace(props, **{name: check(props, value)})
    return props


def check_loss_scale_bounds(min_loss_scale: Any, max_loss_scale: Any) -> tuple[float | None, float]:
    """Validate `min_loss_scale`/`max_loss_scale` and return them as floats (min may be None)."""
    bounds = []
    for name, value in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
        if value is None and name == "min_loss_scale":
            bounds.append(None)
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not value > 0
            or math.isinf(value)
        ):
            raise AmpConfigError(f"{name} must be a positive finite number, not {short_repr(value)}")
        bounds.append(float(value))
    low, high = bounds
    if low is not None and low > high:
        raise AmpConfigError(
            f"min_loss_scale={low} is larger than max_loss_scale={high}: lower min_loss_scale"
        )
    return low, high
