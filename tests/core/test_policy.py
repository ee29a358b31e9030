"""amp_fx.core.policy: override precedence, equality, serialization, printing, the device type."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from amp_fx.core.fusions import FUSIONS
from amp_fx.core.op_lists import (
    register_op,
)
from amp_fx.core.policy import Decision, Policy, Rule, preset

LEVELS = ("O0", "O1", "O2", "O3")
DEVICES = ("cpu", "cuda")


# ---- precedence -------------------------------------------------------------------------------------
class _Block(nn.Module):
    pass


# Each override level, lowest first, with the rule it sets; all match the call decided below.
_LEVELS = [
    ("global", lambda p: p.set_global(Rule.LOWER), Rule.LOWER, "global rule"),
    ("op", lambda p: p.set_op("my_block_op", Rule.FP32), Rule.FP32, "override: op 'my_block_op'"),
    ("type", lambda p: p.set_module_type(_Block, Rule.PROMOTE), Rule.PROMOTE, "override: module type _Block"),
    (
        "regex",
        lambda p: p.set_module_name_regex(r"^enc\.", Rule.OPAQUE),
        Rule.OPAQUE,
        "override: module name regex",
    ),
    (
        "name",
        lambda p: p.set_module_name("enc.block", Rule.PASSTHROUGH),
        Rule.PASSTHROUGH,
        "override: module name",
    ),
]


@pytest.mark.parametrize(
    "subset", [s for n in range(1, 6) for s in itertools.combinations(range(5), n)], ids=str
)
def test_each_precedence_level_beats_the_ones_below(subset: tuple[int, ...]) -> None:
    register_op("my_block_op")
    policy = preset("O1", device_type="cpu")
    # Apply in reverse to show that the order of the calls does not matter, only the level.
    for index in reversed(subset):
        _LEVELS[index][1](policy)
    decision = policy.decide("my_block_op", module_name="enc.block", module_type=_Block)
    _, _, rule, reason = _LEVELS[max(subset)]
    assert decision.rule is rule
    assert decision.reason.startswith(reason)


def test_preset_op_rules_sit_between_global_and_op_overrides() -> None:
    policy = preset("O2").set_global(Rule.FP32)
    assert policy.decide("linear").rule is Rule.LOWER  # preset entry beats global
    assert policy.decide("relu").rule is Rule.FP32  # passthrough ops are the global's
    assert policy.decide("unlisted_thing").rule is Rule.FP32
    policy.set_op("linear", Rule.FP32)
    assert policy.decide("linear") == Decision(Rule.FP32, "override: op 'linear'", torch.float32)


def test_regex_first_match_wins_and_exact_names_need_exact_match() -> None:
    policy = preset("O1").set_module_name_regex("^head", Rule.FP32).set_module_name_regex("^he", Rule.LOWER)
    assert policy.decide("relu", module_name="head.fc").rule is Rule.FP32
    assert policy.decide("relu", module_name="hex").rule is Rule.LOWER
    policy.set_module_name_regex("^head", Rule.PROMOTE)  # re-setting a pattern keeps its place
    assert policy.decide("relu", module_name="head.fc").rule is Rule.PROMOTE
    policy.set_module_name("head", Rule.OPAQUE)
    assert policy.decide("relu", module_name="head.fc").rule is Rule.PROMOTE
    assert policy.decide("relu", module_name="head").rule is Rule.OPAQUE
    assert policy.decide("relu").rule is Rule.PASSTHROUGH  # no module name: module overrides do not apply


def test_module_type_is_exact_and_overrides_apply_at_o0() -> None:
    class Sub(nn.Linear):
        pass

    policy = preset("O0").set_module_type(nn.Linear, Rule.LOWER)
    assert not policy.is_identity
    assert policy.decide("linear", module_type=nn.Linear).rule is Rule.LOWER
    assert policy.decide("linear", module_type=Sub).rule is Rule.PASSTHROUGH
    assert policy.decide("linear", module_type=nn.Linear).param_dtype is None


def test_override_param_dtypes_at_o2() -> None:
    policy = preset("O2", dtype=torch.bfloat16).set_module_name("head", Rule.FP32).set_op("softmax", "lower")
    assert policy.decide("linear", module_name="head").param_dtype == torch.float32
    assert policy.decide("softmax") == Decision(Rule.LOWER, "override: op 'softmax'", torch.bfloat16)


def test_set_methods_chain_and_accept_aliases() -> None:
    policy = preset("O1")
    assert policy.set_global("passthrough") is policy
    assert policy.set_op("cross_entropy", Rule.FP32) is policy
    assert policy.set_module_type(nn.Linear, Rule.FP32) is policy
    assert policy.set_module_name_regex("x", Rule.FP32) is policy
    assert policy.set_module_name("x", Rule.FP32) is policy
    assert policy.op_overrides == {"cross_entropy_loss": Rule.FP32}
    assert policy.decide("cross_entropy").reason == "override: op 'cross_entropy_loss'"


# ---- data: equality, serialization, printing ---------------------------------------------------------
def _customized(level: str, device: str) -> Policy:
    return (
        preset(level, dtype=torch.bfloat16, device_type=device)
        .set_global(Rule.PASSTHROUGH)
        .set_op("softmax", Rule.LOWER)
        .set_module_type(nn.LayerNorm, Rule.FP32)
        .set_module_name_regex(r"^blocks\.\d+\.attn", Rule.FP32)
        .set_module_name_regex("^head", Rule.LOWER)
        .set_module_name("head.out", Rule.PROMOTE)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("level", LEVELS)
def test_to_dict_from_dict_round_trip_through_json(level: str, device: str) -> None:
    for policy in (preset(level, device_type=device), _customized(level, device)):
        data = policy.to_dict()
        assert Policy.from_dict(data) == policy
        assert Policy.from_dict(json.loads(json.dumps(data))) == policy
        assert data["dtype"] in ("float16", "bfloat16")
    data = _customized(level, device).to_dict()
    assert data["module_type_overrides"] == {"torch.nn.modules.normalization.LayerNorm": "fp32"}
    assert data["module_name_regex_overrides"] == [[r"^blocks\.\d+\.attn", "fp32"], ["^head", "lower"]]


def test_equality_sees_every_field() -> None:
    assert preset("O2") == preset("O2")
    assert preset("O2") != preset("O2", dtype=torch.bfloat16)
    assert preset("O2") != preset("O2", keep_batchnorm_fp32=False)
    assert preset("O2") != preset("O3")
    assert preset("O2") != preset("O2").set_op("relu", Rule.FP32)
    a = preset("O1").set_module_name_regex("a", Rule.FP32).set_module_name_regex("b", Rule.LOWER)
    b = preset("O1").set_module_name_regex("b", Rule.LOWER).set_module_name_regex("a", Rule.FP32)
    assert a != b  # regex order is precedence


def test_str_is_a_readable_table() -> None:
    text = str(_customized("O2", "cuda"))
    assert text.startswith("Policy O2 dtype=bfloat16 device_type=cuda keep_batchnorm_fp32=True")
    assert "cast_model_outputs=float32" in text and "stores_weights_low=True" in text
    fp32_line = next(line for line in text.splitlines() if line.strip().startswith("fp32 "))
    assert "log_softmax" in fp32_line and "mse_loss" in fp32_line
    assert "module name regex '^head'" in text and "module name 'head.out'" in text
    assert "module type LayerNorm" in text
    assert str(preset("O0")).count("\n") == 2  # header, derived properties, global; no op rules


def test_serialization_errors() -> None:
    def make_local() -> type:
        class Local(nn.Module):
            pass

        return Local

    with pytest.raises(ValueError, match="defined inside a function"):
        preset("O1").set_module_type(make_local(), Rule.FP32).to_dict()
    data = preset("O1").to_dict()
    data["module_type_overrides"] = {"torch.nn.NoSuchModule": "fp32"}
    with pytest.raises(ValueError, match="cannot import module type 'torch.nn.NoSuchModule'"):
        Policy.from_dict(data)
    with pytest.raises(ValueError, match="lacks"):
        Policy.from_dict({"opt_level": "O1"})
    with pytest.raises(ValueError, match="O2"):
        Policy.from_dict({**preset("O1").to_dict(), "opt_level": "o2"})


# ---- device type: the model's unless the policy names one ---------------------------------------------
def test_preset_without_device_type_leaves_device_choices_to_for_device() -> None:
    policy = preset("O1", dtype=torch.bfloat16).set_op("softmax", Rule.LOWER)
    assert policy.device_type is None and policy.op_rules == {}
    with pytest.raises(ValueError, match="O1's rule for 'linear' comes from the autocast op list.*device"):
        policy.decide("linear")
    for device in DEVICES:
        resolved = policy.for_device(device)
        expected = preset("O1", dtype=torch.bfloat16, device_type=device).set_op("softmax", Rule.LOWER)
        assert resolved == expected
    assert policy.device_type is None  # for_device returns a copy
    assert preset("O1", device_type="cpu").for_device(torch.device("cpu")).device_type == "cpu"
    with pytest.raises(ValueError, match="for device_type 'cpu', not 'cuda'"):
        preset("O1", device_type="cpu").for_device("cuda")


@pytest.mark.parametrize("level", LEVELS)
def test_fusion_defaults_wait_for_the_device_type(level: str) -> None:
    undecided = preset(level)
    for device in DEVICES:
        assert undecided.for_device(device) == preset(level, device_type=device)
    for fusion in FUSIONS:  # the CUDA-only ones wait; the others are the same on every device
        assert getattr(undecided, fusion.flag) is (None if fusion.cuda_only else level == "O2")
    assert Policy.from_dict(json.loads(json.dumps(undecided.to_dict()))) == undecided
    assert preset(level, fused_max_pool=True).fused_max_pool is True


def test_fusion_flags_are_serialized_and_unknown_ones_refused() -> None:
    data = preset("O2", device_type="cuda").to_dict()
    assert {flag: data[flag] for flag in Policy.fusion_flags()} == dict.fromkeys(Policy.fusion_flags(), True)
    with pytest.raises(TypeError, match="unknown keyword 'fused_max_pol'; did you mean 'fused_max_pool'"):
        preset("O2", fused_max_pol=False)


# ---- low_precision_residual: the opt-in low-precision residual stream ---------------------------------
def test_low_precision_residual_lowers_embedding_tables_only_at_o2() -> None:
    default, low = (
        preset("O2", torch.bfloat16, "cpu"),
        preset("O2", torch.bfloat16, "cpu", low_precision_residual=True),
    )
    assert default.low_precision_residual is False and default != low
    for op in ("embedding", "embedding_bag"):
        assert default.decide(op).rule is Rule.FP32 and default.decide(op).param_dtype == torch.float32
        decision = low.decide(op)
        assert decision.rule is Rule.LOWER and decision.param_dtype == torch.bfloat16
        assert "low_precision_residual" in decision.reason
    # Norms, the FP32 islands and matmuls are what O2 decides without it.
    for op in ("layer_norm", "rms_norm", "softmax", "linear", "_grouped_mm"):
        assert low.decide(op) == default.decide(op)
    # Any override beats it, as it beats the preset.
    assert low.set_op("embedding", Rule.FP32).decide("embedding").rule is Rule.FP32
    assert "low_precision_residual=True" in str(low) and "low_precision_residual=False" in str(default)
    assert Policy.from_dict(json.loads(json.dumps(low.to_dict()))) == low
    undecided = preset("O2", torch.bfloat16, low_precision_residual=True)
    assert undecided.for_device("cuda").decide("embedding").rule is Rule.LOWER


@pytest.mark.parametrize("level", ["O0", "O1", "O3"])
def test_low_precision_residual_is_refused_where_the_stream_is_not_fp32(level: str) -> None:
    with pytest.raises(ValueError, match=f"low_precision_residual=True is for O2.*{level}"):
        preset(level, low_precision_residual=True)
    with pytest.raises(TypeError, match="low_precision_residual must be True or False"):
        preset("O2", low_precision_residual="yes")
