"""amp_fx.core.opt_levels: the one table of what each opt level does, and its lookups."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from amp_fx.core.opt_levels import (
    OPT_LEVEL_TABLE,
    OPT_LEVELS,
    OptLevel,
    check_opt_level,
    find_opt_level,
    lookup_opt_level,
)


def test_the_table_holds_apexs_four_levels_in_order() -> None:
    assert OPT_LEVELS == ("O0", "O1", "O2", "O3")
    assert [row.name for row in OPT_LEVEL_TABLE.values()] == list(OPT_LEVELS)


def test_rows_are_frozen_and_the_table_read_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPT_LEVEL_TABLE["O2"].stores_weights_low = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        OPT_LEVEL_TABLE["O4"] = OPT_LEVEL_TABLE["O3"]  # type: ignore[index]


def test_the_fields_hang_together() -> None:
    for row in OPT_LEVEL_TABLE.values():
        # A level that lowers nothing does nothing else either.
        if not row.lowers_precision:
            assert not any(getattr(row, f.name) for f in dataclasses.fields(OptLevel) if f.type == "bool")
        # Per-op casts and low weights are the two ways of lowering; a level picks one.
        assert not (row.uses_autocast_op_lists and row.stores_weights_low)
        # FP32 islands, FP32 norms, FP32 masters and float32 outputs only mean something for low weights.
        if not row.stores_weights_low:
            assert not (row.keeps_fp32_islands or row.keeps_norms_fp32 or row.keeps_fp32_masters)
            assert not (row.keeps_batchnorm_fp32 or row.casts_outputs_fp32)


@pytest.mark.parametrize("level", OPT_LEVELS)
def test_check_opt_level_accepts_the_four_levels(level: str) -> None:
    assert check_opt_level(level) == level


def test_lookup_checks_the_name() -> None:
    assert lookup_opt_level("O2") is OPT_LEVEL_TABLE["O2"]
    with pytest.raises(ValueError, match="did you mean 'O2'"):
        lookup_opt_level("o2")
    with pytest.raises(TypeError, match="opt_level must be a str"):
        lookup_opt_level(2)


def test_find_picks_the_one_level_with_the_fields() -> None:
    assert find_opt_level(lowers_precision=False).name == "O0"
    assert find_opt_level(uses_autocast_op_lists=True).name == "O1"
    assert find_opt_level(stores_weights_low=True, keeps_fp32_islands=False).name == "O3"
    with pytest.raises(ValueError, match="2 opt levels"):
        find_opt_level(stores_weights_low=True)
    with pytest.raises(TypeError, match="no field 'stores_weights'"):
        find_opt_level(stores_weights=True)


def test_no_code_compares_an_opt_level_name() -> None:
    """Code reads the table's fields; a comparison with "O0".."O3" outside it would be a second
    home for what a level does."""
    root = Path(__file__).resolve().parents[2]
    name = r"""["']O[0-3]["']"""
    comparison = re.compile(rf"(==|!=)\s*{name}|{name}\s*(==|!=)|in\s*[(\[{{]{name}")
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for folder in ("amp_fx", "passes", "kernels")
        for path in sorted((root / folder).rglob("*.py"))
        if path.name != "opt_levels.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if comparison.search(line)
    ]
    assert not found, "\n".join(found)
