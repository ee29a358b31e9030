"""amp_fx.core.preset_rules: the op rules each opt level's preset starts from (Apex's table)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_fx.core.op_lists import (
    AUTOCAST_OP_LISTS,
    OPAQUE_OP,
    PASSTHROUGH_OPS,
    autocast_op_lists,
)
from amp_fx.core.policy import Decision, Rule, preset
from amp_fx.core.preset_rules import FP32_ISLANDS

LOW_DTYPES = (torch.float16, torch.bfloat16)
DEVICES = ("cpu", "cuda")


# ---- presets: Apex's property table ---------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_preset_properties_follow_the_table(device: str, dtype: torch.dtype) -> None:
    table = {
        # level: (stores_weights_low, cast_inputs_dtype, autocast_opaque, is_identity, keep_bn, outputs)
        "O0": (False, None, False, True, False, None),
        "O1": (False, None, True, False, False, None),
        "O2": (True, dtype, True, False, True, torch.float32),
        "O3": (True, dtype, False, False, False, torch.float32),
    }
    for level, expected in table.items():
        policy = preset(level, dtype=dtype, device_type=device)
        got = (
            policy.stores_weights_low,
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
