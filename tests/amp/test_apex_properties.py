"""Apex's property table and checks, argument by argument (amp_fx/amp/_properties.py, _initialize.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from amp_fx import amp
from amp_fx.amp._master_weights import OptimizerKind, amp_optimizer_of
from amp_fx.amp._properties import AmpConfigError, opt_level_defaults, resolve_properties


def _init(model, opt_level="O2", optimizer=True, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, optimizer, opt_level=opt_level, **kwargs)


# ---- the table ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "level, cast, patch, keep_bn, master, scale",
    [
        ("O0", torch.float32, False, None, False, 1.0),
        ("O1", None, True, None, None, "dynamic"),
        ("O2", torch.float16, False, True, True, "dynamic"),
        ("O3", torch.float16, False, False, False, 1.0),
    ],
)
def test_opt_level_table_is_apexs(level, cast, patch, keep_bn, master, scale):
    props = opt_level_defaults(level)
    assert (props.enabled, props.opt_level) == (True, level)
    assert (props.cast_model_type, props.patch_torch_functions) == (cast, patch)
    assert (props.keep_batchnorm_fp32, props.master_weights, props.loss_scale) == (keep_bn, master, scale)


@pytest.mark.parametrize("level", ["o2", "02", "O4", "", 2, None])
def test_unknown_opt_level_is_refused_with_the_spellings(level, tiny_net):
    model = tiny_net()
    with pytest.raises(AmpConfigError, match="'O0', 'O1', 'O2', 'O3'") as error:
        _init(model, opt_level=level)
    assert isinstance(error.value, RuntimeError) and isinstance(error.value, ValueError)
    if level in ("o2", "02"):
        assert "'O2'" in str(error.value)


def test_a_refused_initialize_changes_nothing(tiny_net):
    model = tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(AmpConfigError, match="loss_scale must be 'dynamic' or a number"):
        amp.initialize(model, optimizer, opt_level="O2", loss_scale="big", verbosity=0)
    assert amp_optimizer_of(optimizer) is None and "step" not in vars(optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert optimizer.param_groups[0]["params"][0] is model.fc1.weight


# ---- cast_model_type ---------------------------------------------------------------------------
def test_cast_model_type_with_o1_is_refused_as_in_apex(tiny_net):
    with pytest.raises(AmpConfigError, match="O1"):
        _init(tiny_net(), "O1", cast_model_type=torch.float16)
    model, _ = _init(tiny_net(), "O1", cast_model_type=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_cast_model_type_picks_the_weights_dtype(tiny_net):
    model, _ = _init(tiny_net(), "O2", cast_model_type=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(AmpConfigError, match="cast_model_type"):
        _init(tiny_net(), "O2", cast_model_type=torch.int8)


def test_o0_with_a_low_cast_model_type_stores_low_weights(tiny_net):
    model, _ = _init(tiny_net(), "O0", cast_model_type=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model(torch.randn(2, 10)).dtype == torch.float32  # outputs FP32 when the weights are cast


# ---- patch_torch_functions ---------------------------------------------------------------------
def test_patch_torch_functions_outside_o1_is_refused(tiny_net):
    with pytest.raises(AmpConfigError, match="O1"):
        _init(tiny_net(), "O2", patch_torch_functions=True)


def test_o1_without_patched_functions_runs_in_fp32(tiny_net):
    original = tiny_net()
    model, _ = _init(tiny_net(), "O1", patch_torch_functions=False)
    x = torch.randn(4, 10)
    assert torch.equal(model(x), original(x))


def test_o1_casts_ops_and_keeps_weights_fp32(tiny_net):
    model, _ = _init(tiny_net(), "O1", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model(torch.randn(4, 10)).dtype == torch.bfloat16


# ---- keep_batchnorm_fp32 -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, bn_dtype",
    [
        ("True", torch.float32),
        ("False", torch.float16),
        (True, torch.float32),
        (False, torch.float16),
        (None, torch.float32),
    ],
)
def test_keep_batchnorm_fp32_accepts_apexs_strings(value, bn_dtype, tiny_net):
    model, _ = _init(tiny_net(batch_norm=True), "O2", keep_batchnorm_fp32=value)
    assert model.bn.weight.dtype == bn_dtype and model.fc1.weight.dtype == torch.float16


def test_keep_batchnorm_fp32_checks(tiny_net):
    with pytest.raises(AmpConfigError, match="keep_batchnorm_fp32"):
        _init(tiny_net(), "O2", keep_batchnorm_fp32="yes")
    with pytest.raises(AmpConfigError, match="O1"):
        _init(tiny_net(), "O1", keep_batchnorm_fp32=True)
    model, _ = _init(tiny_net(batch_norm=True), "O3", keep_batchnorm_fp32="True")
    assert model.bn.weight.dtype == torch.float32


# ---- master_weights ----------------------------------------------------------------------------
def test_master_weights_checks_and_kinds(tiny_net):
    with pytest.raises(AmpConfigError, match="O1"):
        _init(tiny_net(), "O1", master_weights=True)
    _, optimizer = _init(tiny_net(), "O2", master_weights=False)
    assert amp_optimizer_of(optimizer).kind is OptimizerKind.DIRECT
    assert optimizer.param_groups[0]["params"][0].dtype == torch.float16
    _, optimizer = _init(tiny_net(), "O3", master_weights=True)
    assert amp_optimizer_of(optimizer).kind is OptimizerKind.MASTERS
    assert optimizer.param_groups[0]["params"][0].dtype == torch.float32


# ---- loss_scale ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected", [("dynamic", 65536.0), (128.0, 128.0), ("128.0", 128.0), (4, 4.0)]
)
def test_loss_scale_is_dynamic_or_a_number(value, expected, tiny_net, make_batch):
    model, optimizer = _init(tiny_net(), "O2", loss_scale=value)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": expected, "unskipped": 0}
    x, y = make_batch(0)
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        assert torch.equal(scaled, loss.float() * expected)
        scaled.backward()
    optimizer.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == expected


@pytest.mark.parametrize("value", ["abc", -1.0, 0, float("inf"), [1.0]])
def test_bad_loss_scale_is_refused(value, tiny_net):
    with pytest.raises(AmpConfigError, match="loss_scale"):
        _init(tiny_net(), "O2", loss_scale=value)


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_o0_and_o3_hand_the_loss_through_unscaled(level, tiny_net, make_batch):
    model, optimizer = _init(tiny_net(), level)
    x, y = make_batch(0)
    loss = nn.functional.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss or torch.equal(scaled, loss.float())
        scaled.backward()
    assert amp_optimizer_of(optimizer).found == {}  # nothing checked: Apex's short cut
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 0}


# ---- cast_model_outputs ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "level, outputs, expected",
    [
        ("O2", None, torch.float32),
        ("O2", torch.float16, torch.float16),
        ("O1", torch.float32, torch.float32),
        ("O1", None, torch.float16),
    ],
)
def test_cast_model_outputs(level, outputs, expected, tiny_net):
    model, _ = _init(tiny_net(), level, cast_model_outputs=outputs)
    assert model(torch.randn(2, 10)).dtype == expected


def test_bad_cast_model_outputs_is_refused(tiny_net):
    with pytest.raises(AmpConfigError, match="cast_model_outputs"):
        _init(tiny_net(), "O2", cast_model_outputs=torch.int32)


# ---- num_losses, verbosity, loss-scale bounds ---------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_num_losses_is_refused(value, tiny_net):
    with pytest.raises(AmpConfigError, match="num_losses"):
        _init(tiny_net(), num_losses=value)


def test_num_losses_makes_one_scaler_per_loss(tiny_net, make_batch):
    model, optimizer = _init(tiny_net(), num_losses=3)
    assert list(amp.state_dict()) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    loss = model(make_batch(0)[0]).sum()
    with pytest.raises(ValueError, match="loss_id"):
        with amp.scale_loss(loss, optimizer, loss_id=3):
            pass


def test_verbosity_controls_the_messages(tiny_net, caplog):
    caplog.set_level(logging.INFO, logger="amp_fx.amp")
    _init(tiny_net(), "O2", verbosity=0)
    assert not [r for r in caplog.records if r.name == "amp_fx.amp"]
    _init(tiny_net(), "O2", verbosity=1)
    messages = [r.getMessage() for r in caplog.records if r.name == "amp_fx.amp"]
    assert messages[0].startswith("Selected optimization level O2")
    assert any(m.startswith("master_weights") and m.endswith(": True") for m in messages)
    with pytest.raises(AmpConfigError, match="verbosity"):
        _init(tiny_net(), verbosity=-1)


def test_max_loss_scale_caps_the_initial_and_grown_scale(tiny_net, make_batch):
    model, optimizer = _init(tiny_net(), "O2", max_loss_scale=1024.0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1024.0
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 1999}})
    x, y = make_batch(0)
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()  # the 2000th clean iteration: the scale would double
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 0}


def test_min_loss_scale_is_a_floor(tiny_net, make_batch):
    model, optimizer = _init(tiny_net(), "O2", min_loss_scale=16384.0)
    for step in range(3):
        optimizer.zero_grad()
        x, y = make_batch(step)
        with amp.scale_loss(nn.functional.cross_entropy(model(x), y) * float("inf"), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 16384.0


@pytest.mark.parametrize("low, high", [(2.0, 1.0), (-1.0, 2.0**24), (None, 0.0), (None, "big")])
def test_bad_loss_scale_bounds_are_refused(low, high, tiny_net):
    with pytest.raises(AmpConfigError, match="loss_scale"):
        _init(tiny_net(), min_loss_scale=low, max_loss_scale=high)


# ---- dtype (amp_fx's one addition) -------------------------------------------------------------
def test_dtype_selects_bf16_and_must_agree_with_cast_model_type(tiny_net):
    model, _ = _init(tiny_net(), "O2", dtype=torch.bfloat16)
    assert model.fc1.weight.dtype == torch.bfloat16
    with pytest.raises(AmpConfigError, match="disagree"):
        _init(tiny_net(), "O2", dtype=torch.bfloat16, cast_model_type=torch.float16)
    with pytest.raises(AmpConfigError, match="dtype"):
        _init(tiny_net(), "O2", dtype=torch.float32)


# ---- enabled, models, optimizers, return shapes -----------------------------------------------
def test_enabled_false_makes_amp_a_no_op(tiny_net, make_batch):
    model = tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    returned_model, returned_optimizer = amp.initialize(model, optimizer, enabled=False, verbosity=0)
    assert returned_model is model and returned_optimizer is optimizer and amp_optimizer_of(optimizer) is None
    loss = model(make_batch(0)[0]).sum()
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss
    assert amp.state_dict() == {}
    assert amp.initialize(model, enabled=False, verbosity=0) is model


def test_return_shapes_follow_the_arguments(tiny_net):
    m1, m2 = tiny_net(1), tiny_net(2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    models, optimizers = amp.initialize([m1, m2], [o1, o2], opt_level="O1", verbosity=0)
    assert isinstance(models, list) and len(models) == 2 and optimizers == [o1, o2]
    model = amp.initialize(tiny_net(), opt_level="O2", verbosity=0)
    assert isinstance(model, torch.fx.GraphModule)
    m3 = tiny_net(3)
    models, optimizer = amp.initialize([m3], torch.optim.SGD(m3.parameters(), lr=0.1), verbosity=0)
    assert isinstance(models, list) and isinstance(optimizer, torch.optim.SGD)
    m4 = tiny_net(4)
    model, optimizers = amp.initialize(m4, [torch.optim.SGD(m4.parameters(), lr=0.1)], verbosity=0)
    assert isinstance(model, nn.Module) and isinstance(optimizers, list)


def test_bad_models_and_optimizers_are_refused(tiny_net):
    with pytest.raises(AmpConfigError, match="DataParallel"):
        amp.initialize(nn.DataParallel(tiny_net()), verbosity=0)
    with pytest.raises(AmpConfigError, match=r"\.half\(\)"):
        amp.initialize(tiny_net().half(), verbosity=0)
    with pytest.raises(TypeError, match="nn.Module"):
        amp.initialize("model", verbosity=0)
    model = tiny_net()
    with pytest.raises(TypeError, match="Optimizer"):
        amp.initialize(model, "sgd", verbosity=0)
    stranger = torch.optim.SGD(tiny_net().parameters(), lr=0.1)
    with pytest.raises(AmpConfigError, match="belongs to the model"):
        amp.initialize(model, stranger, verbosity=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(AmpConfigError, match="twice"):
        amp.initialize(model, [optimizer, optimizer], verbosity=0)


def test_resolve_properties_applies_overrides_in_apex_order():
    props = resolve_properties("O3", keep_batchnorm_fp32="True", master_weights=True, loss_scale="dynamic")
    assert (props.keep_batchnorm_fp32, props.master_weights, props.loss_scale) == (True, True, "dynamic")
    with pytest.raises(AmpConfigError, match="unknown property"):
        resolve_properties("O2", fused_optimizer=True)
