"""amp_fx.core.policy_checks: a bad policy field is refused with the problem and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_fx.core.op_lists import register_op
from amp_fx.core.policy import Policy, Rule, preset


# ---- errors: name the problem and the fix -----------------------------------------------------------
@pytest.mark.parametrize("level", ["o2", "02", "o2 ", " 02"])
def test_lowercase_o_and_zero_get_a_capital_o_hint(level: str) -> None:
    with pytest.raises(ValueError, match=r"did you mean 'O2' \(capital letter O\)\?"):
        preset(level)


@pytest.mark.parametrize("level", ["O4", "O12", "", "fast"])
def test_unknown_opt_level(level: str) -> None:
    with pytest.raises(ValueError, match="unknown opt_level .* use one of 'O0', 'O1', 'O2', 'O3'") as info:
        preset(level)
    assert "did you mean" not in str(info.value)
    with pytest.raises(TypeError, match="opt_level must be a str"):
        preset(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, "float", "f16"])
def test_dtype_must_be_fp16_or_bf16(dtype: object) -> None:
    with pytest.raises(ValueError, match="torch.float16 or torch.bfloat16"):
        preset("O2", dtype=dtype)


def test_unknown_device_type() -> None:
    with pytest.raises(ValueError, match="unknown device_type 'mps'"):
        preset("O1", device_type="mps")
    with pytest.raises(ValueError, match="use 'cuda'"):
        preset("O1", device_type="cuda:0")
    assert preset("O1", device_type=torch.device("cpu")).device_type == "cpu"


@pytest.mark.parametrize("value", ["true", "yes", 1, 0, None])
def test_keep_batchnorm_fp32_must_be_a_bool_or_apex_string(value: object) -> None:
    if value is None:
        assert preset("O2", keep_batchnorm_fp32=None).keep_batchnorm_fp32 is True
        return
    with pytest.raises(ValueError, match="keep_batchnorm_fp32 must be True or False"):
        preset("O2", keep_batchnorm_fp32=value)


def test_unknown_op_names_the_op_suggests_and_says_how_to_register() -> None:
    with pytest.raises(ValueError, match="unknown op 'softmaxx'") as info:
        preset("O1").set_op("softmaxx", Rule.FP32)
    assert "'softmax'" in str(info.value)
    assert "register_op('softmaxx')" in str(info.value)
    data = preset("O1").to_dict()
    data["op_overrides"] = {"lnear": "lower"}
    with pytest.raises(ValueError, match="unknown op 'lnear'.*'linear'"):
        Policy.from_dict(data)
    register_op("softmaxx_custom")
    assert preset("O1").set_op("softmaxx_custom", Rule.FP32).decide("softmaxx_custom").rule is Rule.FP32


def test_bad_regex_rule_and_module_type() -> None:
    policy = preset("O1")
    before = policy.to_dict()
    with pytest.raises(ValueError, match=r"regex '\(head' does not compile"):
        policy.set_module_name_regex("(head", Rule.FP32)
    with pytest.raises(ValueError, match="unknown rule 'fp64'.*Rule.LOWER"):
        policy.set_op("linear", "fp64")
    with pytest.raises(TypeError, match="needs a class such as torch.nn.Linear"):
        policy.set_module_type(nn.Linear(2, 2), Rule.FP32)
    assert policy.to_dict() == before  # a failed override changes nothing


# ---- errors echo at most ~60 characters of a user's value ---------------------------------------------
@pytest.mark.parametrize(
    "call",
    [
        lambda huge: preset(huge),
        lambda huge: preset("O2", dtype=huge),
        lambda huge: preset("O2", device_type=huge),
        lambda huge: preset("O2", cast_model_outputs=huge),
    ],
    ids=["opt_level", "dtype", "device_type", "cast_model_outputs"],
)
def test_errors_cut_huge_user_strings(call) -> None:
    with pytest.raises(ValueError, match=r"'OOOO.*\.\.\. \(1000002 characters\)") as info:
        call("O" * 1_000_000)
    assert len(str(info.value)) < 400
