"""amp_fx.core.dtypes: the shared dtype facts and the cut repr of errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx import amp
from amp_fx.amp import AmpConfigError
from amp_fx.core.dtypes import default_device_type, dtype_name, short_dtype_name, short_repr
from amp_fx.core.opt_levels import check_opt_level


def test_short_repr_keeps_short_values_and_cuts_long_ones() -> None:
    assert short_repr("O2") == repr("O2")
    assert short_repr("x" * 58) == repr("x" * 58)  # 60 characters with the quotes: kept whole
    cut = short_repr("x" * 59)
    assert cut == repr("x" * 59)[:59] + "... (61 characters)"
    assert short_repr(list(range(10)), limit=12) == "[0, 1, 2, 3... (30 characters)"


def test_a_huge_opt_level_is_echoed_cut_everywhere() -> None:
    huge = "O" * 1_000_000
    calls = [
        lambda: check_opt_level(huge),
        lambda: amp_fx.preset(huge),
        lambda: amp_fx.convert(nn.Linear(2, 2), huge),
        lambda: amp.initialize(nn.Linear(2, 2), opt_level=huge, verbosity=0),
    ]
    cut = r"unknown opt_level 'OOO.*\.\.\. \(1000002 characters\)"
    for call in calls:
        with pytest.raises(ValueError, match=cut) as info:
            call()
        assert len(str(info.value)) < 200
    with pytest.raises(AmpConfigError, match="'O0', 'O1', 'O2', 'O3'"):
        amp.initialize(nn.Linear(2, 2), opt_level=huge, verbosity=0)


def test_dtype_names_long_and_short() -> None:
    assert [dtype_name(d) for d in (torch.float16, torch.bfloat16)] == ["float16", "bfloat16"]
    assert [short_dtype_name(d) for d in (torch.float16, torch.bfloat16, torch.float32)] == [
        "fp16",
        "bf16",
        "fp32",
    ]
    assert short_dtype_name(None) == "-" and short_dtype_name(torch.complex64) == "complex64"


def test_default_device_type_is_the_first_tensors_or_cpu() -> None:
    assert default_device_type(nn.Linear(2, 2)) == "cpu"
    assert default_device_type(nn.ReLU()) == "cpu"
    meta = nn.Linear(2, 2, device="meta")
    assert default_device_type(meta) == "meta"
