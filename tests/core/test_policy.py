"""amp_fx.core.policy: presets per opt level (Apex's table), override precedence, serialization, errors."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from torch import nn

from amp_fx.core.op_lists import (
    AUTOCAST_OP_LISTS,
    OPAQUE_OP,
    PASSTHROUGH_OPS,
    autocast_op_lists,
    register_op,
)
from amp_fx.core.policy import Decision, Policy, Rule, preset
from amp_fx.core.preset_rules import FP32_ISLANDS

LEVELS = ("O0", "O1", "O2", "O3")
LOW_DTYPES = (torch.float16, torch.bfloat16)
DEVICES = ("cpu", "cuda")


# ---- presets: Apex's property table ---------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_preset_properties_follow_the_table(device: str, dtype: torch.dtype) -> None:
    table = {
        # level: (cast_parameters, cast_inputs_dtype, autocast_opaque, is_identity, keep_bn, outputs)
        "O0": (False, None, False, True, False, None),
        "O1": (False, None, True, False, False, None),
        "O2": (True, dtype, True, False, True, torch.float32),
        "O3": (True, dtype, False, False, False, torch.float32),
    }
    for level, expected in table.items():
        policy = preset(level, dtype=dtype, device_type=device)
        got = (
            policy.cast_parameters,
            policy.cast_inputs_dtype,
            policy.autocast_opaque,
            policy.is_identity,
            policy.keep_batchnorm_fp32,
            policy.cast_model_outputs,
        )
        assert got == expected, level
        assert (policy.opt_level, policy.dtype, policy.device_type) == (level, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
def test_o0_is_passthrough_everywhere_with_params_untouched(device: str) -> None:
    policy = preset("O0", device_type=device)
    for op in ["linear", "softmax", "batch_norm", "cat", "relu", OPAQUE_OP, "never_heard_of"]:
        decision = policy.decide(op, module_name="m", module_type=nn.Linear)
        assert decision == Decision(Rule.PASSTHROUGH, "O0: no casts (identity)", None)


@pytest.mark.parametrize("device", DEVICES)
def test_o1_mirrors_the_autocast_lists(device: str) -> None:
    policy = preset("O1", dtype=torch.bfloat16, device_type=device)
    lists = autocast_op_lists(device)
    expected = {
        "lower_precision_fp": Rule.LOWER,
        "fp32": Rule.FP32,
        "fp32_set_opt_dtype": Rule.FP32,
        "fp32_append_dtype": Rule.FP32,
        "promote": Rule.PROMOTE,
        "banned": Rule.FP32,
        "composite": Rule.OPAQUE,
    }
    for category, rule in expected.items():
        for op in getattr(lists, category):
            decision = policy.decide(op)
            assert decision.rule is rule, (op, category)
            assert decision.param_dtype is None
            assert f"autocast {device}" in decision.reason
    for op in PASSTHROUGH_OPS:
        assert policy.decide(op).rule is Rule.PASSTHROUGH, op
    assert policy.decide(OPAQUE_OP).rule is Rule.OPAQUE
    assert policy.decide("linear").reason == f"autocast {device} lower_precision_fp list"


def test_o1_cpu_and_cuda_lists_differ() -> None:
    cpu, cuda = preset("O1", device_type="cpu"), preset("O1", device_type="cuda")
    assert cuda.decide("softmax").rule is Rule.FP32 and cpu.decide("softmax").rule is Rule.PASSTHROUGH
    assert cuda.decide("layer_norm").rule is Rule.FP32 and cpu.decide("layer_norm").rule is Rule.PASSTHROUGH
    assert cpu.decide("cat").rule is Rule.PROMOTE and cuda.decide("cat").rule is Rule.PASSTHROUGH
    assert cpu.decide("einsum").rule is Rule.OPAQUE and cuda.decide("einsum").rule is Rule.LOWER
    assert cpu != cuda


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_o2_rules_and_param_dtypes(device: str, dtype: torch.dtype) -> None:
    policy = preset("O2", dtype=dtype, device_type=device)
    for op in ("linear", "conv2d", "matmul", "bmm", "einsum", "scaled_dot_product_attention"):
        assert policy.decide(op) == Decision(Rule.LOWER, policy.decide(op).reason, dtype), op
    for op in ("cat", "stack", "addcmul"):
        assert policy.decide(op).rule is Rule.PROMOTE, op
    for op, why in FP32_ISLANDS.items():
        decision = policy.decide(op)
        assert decision.rule is Rule.FP32 and decision.param_dtype == torch.float32, op
        assert decision.reason == f"O2 FP32 island: {why}"
    # BatchNorm: no casts, fp32 params (mixed input works). The other norms and embeddings run
    # FP32 on FP32 params, as under autocast (the residual stream of a transformer stays FP32).
    decision = policy.decide("batch_norm", module_name="norm")
    assert (decision.rule, decision.param_dtype) == (Rule.PASSTHROUGH, torch.float32)
    for op in ("layer_norm", "group_norm", "rms_norm", "embedding", "embedding_bag"):
        decision = policy.decide(op, module_name="norm")
        assert (decision.rule, decision.param_dtype) == (Rule.FP32, torch.float32), op
    assert "keep_batchnorm_fp32" in policy.decide("batch_norm").reason
    for op in ("relu", "add", "getitem", "max_pool2d"):
        assert policy.decide(op) == Decision(Rule.PASSTHROUGH, policy.decide(op).reason, dtype), op
    assert policy.decide(OPAQUE_OP).rule is Rule.OPAQUE


def test_o2_without_keep_batchnorm_fp32_stores_batchnorm_low() -> None:
    policy = preset("O2", keep_batchnorm_fp32=False)
    assert policy.decide("batch_norm").param_dtype == torch.float16
    assert policy.decide("layer_norm").param_dtype == torch.float32  # not a BatchNorm


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_o3_has_no_fp32_islands(dtype: torch.dtype) -> None:
    policy = preset("O3", dtype=dtype, device_type="cuda")
    rules = {policy.decide(op).rule for op in [*FP32_ISLANDS, *AUTOCAST_OP_LISTS["cuda"].fp32]}
    assert Rule.FP32 not in rules
    assert policy.decide("softmax") == Decision(Rule.PASSTHROUGH, policy.decide("softmax").reason, dtype)
    assert policy.decide("linear").rule is Rule.LOWER
    assert policy.decide("cat").rule is Rule.PROMOTE
    for op in ("batch_norm", "layer_norm", "group_norm"):
        assert policy.decide(op).param_dtype == dtype, op
    kept = preset("O3", dtype=dtype, keep_batchnorm_fp32=True)
    assert kept.decide("batch_norm").param_dtype == torch.float32
    assert kept.decide("layer_norm").param_dtype == dtype


def test_keep_batchnorm_fp32_and_cast_model_outputs_overrides() -> None:
    assert preset("O2", keep_batchnorm_fp32="False").keep_batchnorm_fp32 is False
    assert preset("O3", keep_batchnorm_fp32="True").keep_batchnorm_fp32 is True
    assert preset("O1", keep_batchnorm_fp32=True).keep_batchnorm_fp32 is True
    assert preset("O2", cast_model_outputs=torch.float16).cast_model_outputs == torch.float16
    assert preset("O1", cast_model_outputs=torch.float32).cast_model_outputs == torch.float32
    assert preset("O0").cast_model_outputs is None


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
    assert "cast_model_outputs=float32" in text and "cast_parameters=True" in text
    fp32_line = next(line for line in text.splitlines() if line.strip().startswith("fp32 "))
    assert "log_softmax" in fp32_line and "mse_loss" in fp32_line
    assert "module name regex '^head'" in text and "module name 'head.out'" in text
    assert "module type LayerNorm" in text
    assert str(preset("O0")).count("\n") == 2  # header, derived properties, global; no op rules


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, "half"])
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
    assert undecided.fused_losses == (level == "O2")  # the same on every device
    cuda_only = ("fused_linear_loss", "fused_batch_norm", "fused_max_pool")
    assert all(getattr(undecided, flag) is None for flag in cuda_only)
    assert Policy.from_dict(json.loads(json.dumps(undecided.to_dict()))) == undecided
    assert preset(level, fused_max_pool=True).fused_max_pool is True


def test_fusion_flags_are_read_from_the_fields_and_unknown_ones_refused() -> None:
    flags = ("fused_losses", "fused_linear_loss", "fused_batch_norm", "fused_max_pool")
    assert Policy.fusion_flags() == flags
    data = preset("O2", device_type="cuda").to_dict()
    assert {flag: data[flag] for flag in Policy.fusion_flags()} == dict.fromkeys(Policy.fusion_flags(), True)
    with pytest.raises(TypeError, match="unknown keyword 'fused_max_pol'; did you mean 'fused_max_pool'"):
        preset("O2", fused_max_pol=False)


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
