"""Apex's opt levels as one table: what each level does, as named fields.

Code asks the table what a level does (``lookup_opt_level("O2").stores_weights_low``), never which
level it is: no other module compares an opt level's name. Apex's property table
(`amp_fx.amp._properties`) and `amp_fx.core.policy`'s presets are views of this one.

    >>> lookup_opt_level("O2").stores_weights_low, lookup_opt_level("O1").stores_weights_low
    (True, False)
    >>> find_opt_level(uses_autocast_op_lists=True).name
    'O1'

To add a field, give `OptLevel` the field and every row a value; to add a level, add a row to
`_ROWS`. docs/DESIGN.md ("Opt levels") says what each field means to the passes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from amp_fx.core.dtypes import short_repr

__all__ = [
    "OPT_LEVELS",
    "OPT_LEVEL_TABLE",
    "OptLevel",
    "check_opt_level",
    "find_opt_level",
    "lookup_opt_level",
]


@dataclass(frozen=True)
class OptLevel:
    """What one opt level does. Each field is a question some code asks; see docs/DESIGN.md."""

    name: str
    # One line for Apex's startup message.
    description: str
    # Some ops run in the low dtype. False only for pure FP32, where converting is the identity.
    lowers_precision: bool
    # Op rules come from torch.autocast's op lists of the device type; weights stay FP32
    # (Apex's patch_torch_functions).
    uses_autocast_op_lists: bool
    # Parameters and floating buffers are stored in the low dtype and floating model inputs are
    # cast low (at the entry or at their first lowered consumer: `casts_inputs_at_entry`).
    stores_weights_low: bool
    # The default of cast_inputs_at_entry: floating model inputs are cast low at the graph's entry
    # (Apex), not where the first op that runs in the low dtype reads them.
    casts_inputs_at_entry: bool
    # The ops of `amp_fx.core.preset_rules.FP32_ISLANDS` (softmax, losses, exp/log, sums) run in FP32.
    keeps_fp32_islands: bool
    # Norms (layer/group/RMS) and embedding tables run in FP32 on FP32 parameters, as under autocast.
    keeps_norms_fp32: bool
    # The default of keep_batchnorm_fp32: BatchNorm keeps FP32 parameters and runs on low input.
    keeps_batchnorm_fp32: bool
    # Floating model outputs are cast to float32 by default (cast_model_outputs).
    casts_outputs_fp32: bool
    # Untraced code (OPAQUE) runs inside torch.autocast of the policy's dtype.
    autocast_opaque: bool
    # The fused kernels (`Policy.fusion_flags`) are on by default.
    fuses_kernels: bool
    # The optimizer keeps FP32 master weights (Apex's master_weights).
    keeps_fp32_masters: bool
    # The loss scale is dynamic by default, else a static 1.0 (Apex's loss_scale).
    dynamic_loss_scale: bool


_ROWS = (
    OptLevel(
        name="O0",
        description="Pure FP32 training.",
        lowers_precision=False,
        uses_autocast_op_lists=False,
        stores_weights_low=False,
        casts_inputs_at_entry=False,
        keeps_fp32_islands=False,
        keeps_norms_fp32=False,
        keeps_batchnorm_fp32=False,
        casts_outputs_fp32=False,
        autocast_opaque=False,
        fuses_kernels=False,
        keeps_fp32_masters=False,
        dynamic_loss_scale=False,
    ),
    OptLevel(
        name="O1",
        description="Casts inserted around each op by the autocast op lists; model weights stay FP32.",
        lowers_precision=True,
        uses_autocast_op_lists=True,
        stores_weights_low=False,
        casts_inputs_at_entry=False,
        keeps_fp32_islands=False,
        keeps_norms_fp32=False,
        keeps_batchnorm_fp32=False,
        casts_outputs_fp32=False,
        autocast_opaque=True,
        fuses_kernels=False,
        keeps_fp32_masters=False,
        dynamic_loss_scale=True,
    ),
    OptLevel(
        name="O2",
        description="Low-precision weights with FP32 batchnorm and FP32 master weights.",
        lowers_precision=True,
        uses_autocast_op_lists=False,
        stores_weights_low=True,
        casts_inputs_at_entry=False,
        keeps_fp32_islands=True,
        keeps_norms_fp32=True,
        keeps_batchnorm_fp32=True,
        casts_outputs_fp32=True,
        autocast_opaque=True,
        fuses_kernels=True,
        keeps_fp32_masters=True,
        dynamic_loss_scale=True,
    ),
    OptLevel(
        name="O3",
        description="Pure low-precision training.",
        lowers_precision=True,
        uses_autocast_op_lists=False,
        stores_weights_low=True,
        casts_inputs_at_entry=True,
        keeps_fp32_islands=False,
        keeps_norms_fp32=False,
        keeps_batchnorm_fp32=False,
        casts_outputs_fp32=True,
        autocast_opaque=False,
        fuses_kernels=False,
        keeps_fp32_masters=False,
        dynamic_loss_scale=False,
    ),
)

# name -> its row, in Apex's order.
OPT_LEVEL_TABLE = MappingProxyType({row.name: row for row in _ROWS})
# The accepted spellings.
OPT_LEVELS = tuple(OPT_LEVEL_TABLE)


def check_opt_level(opt_level: Any) -> str:
    """Return `opt_level` if it is one of "O0".."O3"; else raise naming the accepted spellings.

    A TypeError for a value that is not a str, a ValueError for an unknown one (with a hint when
    the letter O was typed as a zero or lower case).

    >>> check_opt_level("O1")
    'O1'
    """
    spellings = ", ".join(map(repr, OPT_LEVELS))
    if not isinstance(opt_level, str):
        raise TypeError(
            f"opt_level must be a str, one of {spellings}; got {type(opt_level).__name__} "
            f"{short_repr(opt_level)}"
        )
    if opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    stripped = opt_level.strip()
    if len(stripped) == 2 and stripped[1] in "0123" and stripped[0] in "oO0":
        hint = f"; did you mean 'O{stripped[1]}' (capital letter O)?"
    raise ValueError(f"unknown opt_level {short_repr(opt_level)}: use one of {spellings}{hint}")


def lookup_opt_level(opt_level: Any) -> OptLevel:
    """The table's row for `opt_level`, checked as `check_opt_level` checks it.

    >>> lookup_opt_level("O3").keeps_fp32_masters
    False
    """
    return OPT_LEVEL_TABLE[check_opt_level(opt_level)]


def find_opt_level(**fields: Any) -> OptLevel:
    """The one level whose fields have these values; raises if none or several do.

    For code that must pick a level by what it does (Apex's overridden properties map back to
    the level that realizes them).

    >>> find_opt_level(lowers_precision=False).name
    'O0'
    """
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(OptLevel)})
    if unknown:
        raise TypeError(f"OptLevel has no field {unknown[0]!r}")
    matches = [row for row in _ROWS if all(getattr(row, k) == v for k, v in fields.items())]
    if len(matches) != 1:
        names = [row.name for row in matches]
        raise ValueError(f"{len(matches)} opt levels {names} have {fields}: name fields that pick one")
    return matches[0]
