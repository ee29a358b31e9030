"""The checks a `Policy` runs on every field it is given: each raises a clear error naming the
problem and the fix, so a bad policy never reaches the passes.

    >>> check_low_dtype("bfloat16"), check_rule("fp32")
    (torch.bfloat16, <Rule.FP32: 'fp32'>)
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import torch

from amp_fx.core.dtypes import low_precision_dtype, short_repr
from amp_fx.core.op_lists import DEVICE_TYPES, canonical_op_name, is_known_op, known_ops
from amp_fx.core.rules import Rule

__all__ = [
    "check_device_type",
    "check_flag",
    "check_fp8",
    "check_fp8_device",
    "check_fp8_skip_modules",
    "check_keep_batchnorm_fp32",
    "check_low_dtype",
    "check_low_precision_residual",
    "check_module_type",
    "check_op",
    "check_output_dtype",
    "check_regex",
    "check_rule",
]


def check_low_dtype(dtype: Any) -> torch.dtype:
    """fp16 or bf16, also spelt as a string ("bfloat16", "bf16", "torch.float16", "half"):
    `amp_fx.core.dtypes.low_precision_dtype`."""
    return low_precision_dtype(dtype)


def check_output_dtype(dtype: Any) -> torch.dtype | None:
    """A floating dtype (or its name) for cast_model_outputs, or None for outputs as computed."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        candidate = getattr(torch, name, None)
        if isinstance(candidate, torch.dtype):
            dtype = candidate
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"cast_model_outputs must be a floating torch.dtype (e.g. torch.float32) or None, got "
            f"{short_repr(dtype)}"
        )
    return dtype


def check_device_type(device_type: Any) -> str:
    """A device type autocast has op lists for; a torch.device gives its type.

    >>> check_device_type(torch.device("cuda", 1))
    'cuda'
    """
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if device_type in DEVICE_TYPES:
        return device_type
    hint = ""
    if isinstance(device_type, str) and ":" in device_type:
        hint = f" (a device type has no index: use {short_repr(device_type.split(':')[0])})"
    raise ValueError(
        f"unknown device_type {short_repr(device_type)}: use one of "
        f"{', '.join(map(repr, DEVICE_TYPES))}{hint}"
    )


def check_keep_batchnorm_fp32(value: Any) -> bool:
    """True or False, or Apex's strings "True"/"False"."""
    # Apex accepted the strings "True"/"False" (from argparse); accept them, reject anything else.
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(
        f"keep_batchnorm_fp32 must be True or False (or Apex's strings 'True'/'False'), got {value!r}"
    )


def check_flag(name: str, value: Any) -> bool:
    """A bool switch named `name` (a fused-kernel flag)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_low_precision_residual(value: Any, opt_level: str, keeps_residual_fp32: bool) -> bool:
    """True or False; True only at a level whose residual stream is FP32 (O2: `keeps_residual_fp32`).

    >>> check_low_precision_residual(True, "O2", keeps_residual_fp32=True)
    True
    """
    value = check_flag("low_precision_residual", value)
    if value and not keeps_residual_fp32:
        raise ValueError(
            f"low_precision_residual=True is for O2, whose residual stream is FP32; {opt_level} keeps "
            "no FP32 stream to lower (O3 runs it low already, O1 follows torch.autocast)"
        )
    return value


def check_fp8(recipe: Any, opt_level: str, mixes_low_and_fp32: bool, dtype: torch.dtype) -> str | None:
    """None (no FP8), or the name of an FP8 recipe (`amp_fx.kernels.fp8.recipes`) that runs on
    ``dtype`` at ``opt_level``: FP8 products are for O2 (`mixes_low_and_fp32`: weights stored in the
    low dtype the products read and write, FP32 islands), in a dtype CUDA's FP8 product writes.

    >>> check_fp8("rowwise", "O2", True, torch.bfloat16)
    'rowwise'
    """
    if recipe is None:
        return None
    # Imported here: amp_fx.core reads no kernel package at import.
    from amp_fx.kernels.fp8.arguments import OUTPUT_DTYPES
    from amp_fx.kernels.fp8.recipes import recipe_named

    recipe_named(recipe)
    if not mixes_low_and_fp32:
        raise ValueError(
            f"fp8={recipe!r} is for O2 (low-precision weights, FP32 masters), not {opt_level}: use "
            f"preset('O2', dtype=torch.bfloat16, fp8={recipe!r})"
        )
    if dtype not in OUTPUT_DTYPES:
        names = ", ".join(str(d) for d in OUTPUT_DTYPES)
        raise ValueError(f"fp8={recipe!r} writes {names}, not {dtype}: pass dtype=torch.bfloat16")
    return recipe


def check_fp8_device(recipe: str | None, device_type: str | None) -> None:
    """Raise ValueError where ``recipe``'s products cannot run on ``device_type`` with this torch:
    per-row scaling on a CPU whose ``torch._scaled_mm`` has per-tensor scales only (before 2.14).

    >>> check_fp8_device("tensorwise", "cpu")
    """
    if recipe is None or device_type != "cpu":
        return
    # Imported here: amp_fx.core reads no kernel package at import.
    from amp_fx.kernels.fp8.arguments import cpu_scales_per_row
    from amp_fx.kernels.fp8.recipes import recipe_named

    if recipe_named(recipe).scaling == "rowwise" and not cpu_scales_per_row():
        raise ValueError(
            f"fp8={recipe!r} scales per row, which torch {torch.__version__}'s CPU FP8 product "
            "(torch._scaled_mm) does not do: use fp8='tensorwise' on the CPU, run on CUDA, or "
            "install torch 2.14 or later"
        )


def check_fp8_skip_modules(patterns: Any) -> list[str]:
    """Module-name patterns (``re.fullmatch``) whose linear layers stay out of FP8.

    >>> check_fp8_skip_modules(("lm_head", "blocks[.]0[.].*"))
    ['lm_head', 'blocks[.]0[.].*']
    """
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)):
        raise TypeError(
            "fp8_skip_modules must be a list of module names or patterns such as ['lm_head', "
            f"'blocks[.]0[.].*'], got {short_repr(patterns)}"
        )
    return [check_regex(pattern) for pattern in patterns]


def check_rule(rule: Any) -> Rule:
    """A `Rule` or its value ("lower", "fp32", ...)."""
    if isinstance(rule, Rule):
        return rule
    try:
        return Rule(rule)
    except ValueError:
        choices = ", ".join(f"Rule.{r.name}" for r in Rule)
        raise ValueError(f"unknown rule {rule!r}: use one of {choices} (or their values)") from None


def check_op(op: Any) -> str:
    """The canonical name of a known op; an unknown one is refused with close matches.

    >>> check_op("relu_")
    'relu'
    """
    name = canonical_op_name(op)
    if is_known_op(name):
        return name
    close = difflib.get_close_matches(name, sorted(known_ops()), n=3, cutoff=0.6)
    suggestion = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ValueError(
        f"policy names an unknown op {op!r}.{suggestion} Op names are aten names without overload or "
        "in-place underscore ('linear', 'conv2d', 'softmax'); to use a new op, register it first with "
        f"amp_fx.core.op_lists.register_op({name!r})"
    )


def check_module_type(module_type: Any) -> type:
    """A module class, for set_module_type."""
    if not isinstance(module_type, type):
        raise TypeError(
            f"set_module_type needs a class such as torch.nn.Linear, got {type(module_type).__name__} "
            f"{module_type!r}"
        )
    return module_type


def check_regex(pattern: Any) -> str:
    """A module-name pattern that compiles."""
    if not isinstance(pattern, str):
        raise TypeError(f"module name regex must be a str, got {type(pattern).__name__} {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(
            f"module name regex {pattern!r} does not compile ({error}); fix the pattern, or use "
            "set_module_name for an exact name (re.escape quotes dots)"
        ) from None
    return pattern
