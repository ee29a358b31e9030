"""LossScaler: GradScaler's scale sequence, hysteresis, bounds, protocol, checkpoints, no host reads."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle

import pytest
import torch

import amp_fx.training.loss_scale_tensors as loss_scale_tensors_module
from amp_fx import LossScaler, clip_grad_norm_
from amp_fx.kernels import reference, triton_ops
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import tolerances
from amp_fx.training.loss_scale_settings import LossScaleSettings


def _param(dtype=torch.float32, n=4):
    return torch.nn.Parameter(torch.randn(n).to(dtype))


def _iteration(scaler, optimizer, params, overflow: bool) -> None:
    """One training iteration with synthetic grads: scaled ones, or an inf in the last param."""
    scale = scaler.get_scale()
    scaler.scale(torch.zeros(()))
    for param in params:
        param.grad = torch.full_like(param, 0.25 * scale)
    if overflow:
        params[-1].grad[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize("factors", [(2.0, 0.5), (1.5, 0.3)])
@pytest.mark.parametrize("optimizer_kind", ["fused", "torch"])
def test_scale_sequence_equals_grad_scaler(factors, optimizer_kind) -> None:
    growth_factor, backoff_factor = factors
    config = {"init_scale": 2.0**10, "growth_factor": growth_factor, "backoff_factor": backoff_factor}
    pattern = (torch.rand(80, generator=torch.Generator().manual_seed(0)) < 0.2).tolist()
    ours_params, theirs_params = [_param(), _param()], [_param(), _param()]
    ours_optimizer = (FusedSGD if optimizer_kind == "fused" else torch.optim.SGD)(ours_params, lr=1e-3)
    ours = LossScaler(growth_interval=3, max_scale=None, **config)
    theirs = torch.amp.GradScaler("cpu", growth_interval=3, **config)
    theirs_optimizer = torch.optim.SGD(theirs_params, lr=1e-3)
    for overflow in pattern:
        _iteration(ours, ours_optimizer, ours_params, overflow)
        _iteration(theirs, theirs_optimizer, theirs_params, overflow)
        assert ours.get_scale() == theirs.get_scale()
        assert ours._get_growth_tracker() == theirs._get_growth_tracker()
    assert any(pattern) and not all(pattern)


def test_update_from_found_infs_follows_torch_update_scale() -> None:
    """The public entry amp_fx.amp uses: flags collected by the caller, GradScaler's rule applied."""
    pattern = (torch.rand(40, generator=torch.Generator().manual_seed(1)) < 0.3).tolist()
    scaler = LossScaler(init_scale=2.0**10, growth_interval=3, max_scale=None)
    scaler.scale(torch.zeros(()))
    scale, tracker = torch.full((), 2.0**10), torch.zeros((), dtype=torch.int32)
    for overflow in pattern:
        flag = torch.full((1,), float(overflow))
        scaler.update_from_found_infs(flag)
        torch._amp_update_scale_(scale, tracker, torch.full((), float(overflow)), 2.0, 0.5, 3)
        assert scaler.get_scale() == scale.item() and scaler._get_growth_tracker() == tracker.item()
        assert flag.item() == float(overflow)  # left as it was unless zero_found_infs=True
    scaler.update_from_found_infs([torch.ones(1), torch.zeros(1)], zero_found_infs=True)
    assert scaler.get_scale() == scale.item() / 2
    with pytest.raises(RuntimeError, match="before any loss was scaled"):
        LossScaler().update_from_found_infs(torch.ones(1))


def test_hysteresis_backs_off_at_the_nth_consecutive_overflow() -> None:
    # O = overflow, . = clean; hysteresis 3, growth every 4 clean steps.
    pattern = "OO.OOOO....O"
    expected = [1024, 1024, 1024, 1024, 1024, 512, 256, 256, 256, 256, 512, 512]
    params = [_param()]
    optimizer = FusedSGD(params, lr=1e-3)
    scaler = LossScaler(init_scale=1024.0, hysteresis=3, growth_interval=4)
    scales = []
    for mark in pattern:
        _iteration(scaler, optimizer, params, mark == "O")
        scales.append(scaler.get_scale())
    assert scales == expected
    assert scaler.state_dict()["_hysteresis_tracker"] == 2


def test_min_and_max_scale_clamp() -> None:
    params = [_param()]
    optimizer = FusedSGD(params, lr=1e-3)
    low = LossScaler(init_scale=4.0, min_scale=1.5)
    scales = []
    for _ in range(3):
        _iteration(low, optimizer, params, overflow=True)
        scales.append(low.get_scale())
    assert scales == [2.0, 1.5, 1.5]
    high = LossScaler(init_scale=2.0**23, growth_interval=1)
    scales = []
    for _ in range(3):
        _iteration(high, optimizer, params, overflow=False)
        scales.append(high.get_scale())
    assert scales == [2.0**24] * 3  # max_scale defaults to 2**24


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
def test_fused_path_never_reads_a_tensor_on_the_host(no_host_reads, triton_calls) -> None:
    """The kernels a GPU runs (Triton, here under the interpreter) with the scaler and clipping:
    nothing is read on the host. (The CPU reference reads its flag in CPU memory, where that is no
    device sync: `amp_fx.kernels.optimizer_step.skip_flag`.)"""
    params = [_param(torch.float16), _param(torch.bfloat16), _param()]
    optimizer = FusedAdam(params, lr=1e-3)
    scaler = LossScaler(init_scale=256.0, hysteresis=2)
    scaler.scale(torch.zeros(()))  # the first scale() creates the state; allowed to happen anywhere
    with no_host_reads():
        for overflow in (False, True, False):
            loss = scaler.scale(torch.ones((), requires_grad=True))
            for param in params:
                param.grad = torch.full_like(param, 3.0)
            if overflow:
                params[0].grad[0] = float("inf")
            scaler.unscale_(optimizer)
            clip_grad_norm_(optimizer, max_norm=1.0)
            scaler.step(optimizer)
            scaler.update()
            assert loss.shape == ()
    assert optimizer.param_groups[0]["step"].item() == 2
    assert triton_calls["adam_step_"] == 3


def test_the_host_read_guard_catches_a_read(no_host_reads) -> None:
    # The guard above must be able to fail: each kind of read it forbids raises inside it.
    reads = [lambda t: t.item(), lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.numpy()]
    reads += [bool, float, int, lambda t: [0, 1][t]]
    for read in reads:
        with no_host_reads(), pytest.raises(AssertionError, match="read on the host"):
            read(torch.ones((), dtype=torch.int64))
    assert torch.ones(()).item() == 1.0  # and nothing is left patched after it


GETTERS = ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval", "is_enabled")


def _getters(scaler) -> dict:
    return {name: getattr(scaler, name)() for name in GETTERS}


def test_getters_and_setters_match_grad_scaler() -> None:
    config = {"init_scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 5}
    ours = LossScaler(max_scale=None, **config)
    theirs = torch.amp.GradScaler("cpu", **config)
    assert _getters(ours) == _getters(theirs)
    assert list(_getters(ours).values()) == [8.0, 3.0, 0.25, 5, True]
    new_values = {"set_growth_factor": 4.0, "set_backoff_factor": 0.125, "set_growth_interval": 2}
    for setter, value in new_values.items():
        getattr(ours, setter)(value)
        getattr(theirs, setter)(value)
    assert _getters(ours) == _getters(theirs)
    assert list(_getters(ours).values()) == [8.0, 4.0, 0.125, 2, True]
    # The new values drive the scale sequence as they drive GradScaler's.
    ours_params, theirs_params = [_param()], [_param()]
    ours_optimizer, theirs_optimizer = FusedSGD(ours_params, lr=1e-3), torch.optim.SGD(theirs_params, lr=1e-3)
    for overflow in (False, False, True, False, False, False, True):
        _iteration(ours, ours_optimizer, ours_params, overflow)
        _iteration(theirs, theirs_optimizer, theirs_params, overflow)
        assert ours.get_scale() == theirs.get_scale()
    assert ours.get_scale() != config["init_scale"]
    # Disabled: scale 1.0 (a disabled GradScaler has no factors to get).
    disabled = (LossScaler(enabled=False), torch.amp.GradScaler("cpu", enabled=False))
    assert [(s.get_scale(), s.is_enabled()) for s in disabled] == [(1.0, False)] * 2


def test_getters_of_what_grad_scaler_lacks() -> None:
    scaler = LossScaler(init_scale=4.0, hysteresis=3, min_scale=0.5, max_scale=64.0)
    assert (scaler.get_hysteresis(), scaler.get_min_scale(), scaler.get_max_scale()) == (3, 0.5, 64.0)
    assert LossScaler().get_max_scale() == 2.0**24 and LossScaler().get_min_scale() is None


@pytest.mark.parametrize(
    ("setter", "value", "error", "match"),
    [
        ("set_growth_factor", 1.0, ValueError, "growth_factor must be > 1.0"),
        ("set_backoff_factor", 1.5, ValueError, "backoff_factor must be in"),
        ("set_growth_interval", 0, ValueError, "growth_interval must be an int in"),
        ("set_growth_interval", 2.5, TypeError, "growth_interval must be an int"),
    ],
)
def test_bad_setter_values_are_refused_and_nothing_changes(setter, value, error, match) -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=5, hysteresis=2)
    for _ in range(2):  # before and after the device state exists
        before = (_getters(scaler), scaler.state_dict())
        with pytest.raises(error, match=match):
            getattr(scaler, setter)(value)
        assert (_getters(scaler), scaler.state_dict()) == before
        scaler.scale(torch.zeros(()))


def test_settings_are_frozen_and_every_new_value_is_checked() -> None:
    settings = LossScaleSettings(3, 0.25, 5, hysteresis=2, min_scale=1, max_scale=None)
    # Stored as the getters return them, whatever numbers came in (GradScaler's getters give floats).
    assert [type(settings.growth_factor), type(settings.min_scale)] == [float, float]
    assert LossScaler(growth_factor=3, min_scale=1, init_scale=8).state_dict()["growth_factor"] == 3.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.growth_factor = 4.0
    with pytest.raises(ValueError, match="must not exceed max_scale"):
        dataclasses.replace(settings, max_scale=0.5)
    with pytest.raises(TypeError, match="hysteresis must be an int"):
        dataclasses.replace(settings, hysteresis=True)
    assert settings == LossScaleSettings(3.0, 0.25, 5, hysteresis=2, min_scale=1.0, max_scale=None)


def test_torch_optimizer_path_unscales_in_place_and_skips_on_the_host() -> None:
    param = _param()
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = LossScaler(init_scale=8.0)
    scaler.scale(torch.zeros(()))
    param.grad = torch.full_like(param, 16.0)
    scaler.unscale_(optimizer)
    assert torch.equal(param.grad, torch.full_like(param, 2.0))
    before = param.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), before - 0.1 * 2.0)
    before = param.detach().clone()
    _iteration(scaler, optimizer, [param], overflow=True)
    assert torch.equal(param.detach(), before)


def test_torch_optimizer_with_fp16_grads_is_refused_like_grad_scaler() -> None:
    param = _param(torch.float16)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = LossScaler()
    scaler.scale(torch.zeros(()))
    param.grad = torch.ones_like(param)
    with pytest.raises(ValueError, match="FusedAdam"):
        scaler.step(optimizer)


def test_torch_fused_adam_gets_grad_scale_and_found_inf() -> None:
    results = []
    for scaler_cls in (LossScaler, lambda **kw: torch.amp.GradScaler("cpu", **kw)):
        torch.manual_seed(0)
        params = [_param(), _param()]
        optimizer = torch.optim.Adam(params, lr=1e-2, fused=True)
        scaler = scaler_cls(init_scale=64.0, growth_interval=2)
        for overflow in (False, True, False, False):
            _iteration(scaler, optimizer, params, overflow)
        results.append(([p.detach().clone() for p in params], scaler.get_scale()))
    (ours, our_scale), (theirs, their_scale) = results
    assert our_scale == their_scale
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_bf16_training_with_the_scaler_disabled() -> None:
    torch.manual_seed(1)
    params = [_param(torch.bfloat16, 6), _param(torch.bfloat16, 3)]
    copies = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    optimizer = FusedAdam(params, lr=1e-2)
    reference = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.0)
    scaler = LossScaler(enabled=False)
    generator = torch.Generator().manual_seed(2)
    for _ in range(10):
        loss = torch.ones(())
        assert scaler.scale(loss) is loss
        for param, copy in zip(params, copies, strict=True):
            grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
            param.grad, copy.grad = grad, grad.float()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        reference.step()
    rtol, atol = tolerances(torch.float32)
    for master, copy in zip(master_params(optimizer), copies, strict=True):
        torch.testing.assert_close(master, copy.detach(), rtol=rtol, atol=atol)
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled() and scaler.state_dict() == {}


def test_scale_handles_nested_outputs() -> None:
    scaler = LossScaler(init_scale=4.0)
    a, b, c = torch.ones(2), torch.ones(()), torch.ones(3)
    scaled = scaler.scale([a, (b, c)])
    assert isinstance(scaled, list) and isinstance(scaled[1], tuple)
    assert torch.equal(scaled[1][1], torch.full((3,), 4.0))
    assert scaler.scale(b).shape == ()
    with pytest.raises(TypeError, match=r"scale\(\) takes a tensor or an iterable of tensors, got float"):
        scaler.scale(3.0)


def test_protocol_errors() -> None:
    param = _param(torch.float16)
    optimizer = FusedSGD([param], lr=0.1)
    scaler = LossScaler()
    with pytest.raises(RuntimeError, match="scale"):
        scaler.step(optimizer)
    scaler.scale(torch.zeros(()))
    with pytest.raises(RuntimeError, match="no inf checks"):
        scaler.update()
    param.grad = torch.ones_like(param)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(optimizer, lambda: None)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(optimizer)
    scaler.update()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"init_scale": "cuda"}, TypeError, "it takes no device"),
        ({"init_scale": 0.0}, ValueError, "init_scale must be > 0"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor must be > 1.0"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor must be in"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be an int in"),
        ({"growth_interval": 2.5}, TypeError, "growth_interval must be an int"),
        ({"hysteresis": 0}, ValueError, "hysteresis must be an int in"),
        ({"min_scale": 2.0**20}, ValueError, r"outside \[min_scale, max_scale\]"),
        ({"max_scale": 1.0}, ValueError, r"outside \[min_scale, max_scale\]"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, ValueError, "must not exceed max_scale"),
        ({"enabled": "yes"}, TypeError, "enabled must be True or False"),
    ],
)
def test_bad_configuration_is_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        LossScaler(**kwargs)


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_continues_identically() -> None:
    params = [_param()]
    optimizer = FusedSGD(params, lr=1e-3)
    scaler = LossScaler(init_scale=512.0, hysteresis=2, growth_interval=2, min_scale=1.0)
    for overflow in (True, False, True):
        _iteration(scaler, optimizer, params, overflow)
    saved = scaler.state_dict()
    assert all(v is None or type(v) in (int, float) for v in saved.values())
    resumed = LossScaler()
    resumed.load_state_dict(_round_trip(saved))
    assert resumed.state_dict() == saved
    for overflow in (True, True, False, False, False):
        _iteration(scaler, optimizer, params, overflow)
        _iteration(resumed, optimizer, params, overflow)
        assert scaler.state_dict() == resumed.state_dict()


def test_state_dicts_interchange_with_grad_scaler() -> None:
    theirs = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=7)
    ours = LossScaler(hysteresis=3)
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_scale() == 128.0 and ours.get_growth_interval() == 7 and ours.get_hysteresis() == 3
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(LossScaler(init_scale=32.0, growth_factor=3.0).state_dict())
    assert back.get_scale() == 32.0 and back.get_growth_factor() == 3.0


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"scale": -1.0}, ValueError, "must be > 0, got -1.0"),
        ({"scale": float("nan")}, TypeError, "must be a finite number, got nan"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor must be > 1.0"),
        ({"growth_interval": "often"}, TypeError, "growth_interval must be an int"),
        ({"scale": 2.0**30}, ValueError, r"outside \[min_scale, max_scale\]"),  # above max_scale
        ({"_hysteresis_tracker": 5}, ValueError, r"_hysteresis_tracker \(5\) must be in"),
        ({"_growth_tracker": -1}, ValueError, "_growth_tracker must be an int in"),
        # past the int32 tracker: refused before the scale is written
        ({"_growth_tracker": 2**31}, ValueError, "_growth_tracker must be an int in"),
        # good settings beside a bad value: none of them is taken
        ({"growth_factor": 4.0, "hysteresis": 3, "_hysteresis_tracker": 5}, ValueError, "must be in"),
        ({"backoff_factor": 0.25, "max_scale": 32.0}, ValueError, r"outside \[min_scale, max_scale\]"),
    ],
)
def test_bad_state_dict_is_refused_and_nothing_changes(change, error, match) -> None:
    scaler = LossScaler(init_scale=64.0)
    scaler.scale(torch.zeros(()))
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict({**before, **change})
    with pytest.raises(ValueError, match="lacks"):
        scaler.load_state_dict({"scale": 2.0})
    with pytest.raises(ValueError, match="disabled"):
        scaler.load_state_dict({})
    assert scaler.state_dict() == before
    assert scaler._tensors.inv_scale.item() == 1 / 64.0  # unscale_ reads it: still the scale's reciprocal


def test_pickle_between_iterations() -> None:
    params = [_param()]
    optimizer = FusedSGD(params, lr=1e-3)
    scaler = LossScaler(init_scale=64.0, hysteresis=2)
    _iteration(scaler, optimizer, params, overflow=True)
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.state_dict() == scaler.state_dict()
    scaler.scale(torch.zeros(()))
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.dumps(scaler)


def test_a_scaler_pickled_with_a_setting_per_attribute_loads() -> None:
    params = [_param()]
    optimizer = FusedSGD(params, lr=1e-3)
    scaler = LossScaler(init_scale=64.0, hysteresis=2, growth_interval=2, min_scale=1.0, backoff_factor=0.25)
    _iteration(scaler, optimizer, params, overflow=True)
    # What a version before the frozen settings pickled: `_growth_factor`, ..., `_max_scale`.
    state = scaler.__getstate__()
    settings = state.pop("_settings")
    state.update({f"_{field.name}": getattr(settings, field.name) for field in dataclasses.fields(settings)})
    restored = LossScaler.__new__(LossScaler)
    restored.__setstate__(state)
    assert restored.state_dict() == scaler.state_dict()
    for overflow in (True, True, False, False, False):
        _iteration(scaler, optimizer, params, overflow)
        _iteration(restored, optimizer, params, overflow)
        assert restored.state_dict() == scaler.state_dict()


def test_a_scaler_pickled_with_its_device_state_in_attributes_loads() -> None:
    params = [_param()]
    optimizer = FusedSGD(params, lr=1e-3)
    scaler = LossScaler(init_scale=64.0, hysteresis=2, growth_interval=2)
    _iteration(scaler, optimizer, params, overflow=True)
    # What a version before `ScaleTensors` pickled: the numbers the tensors start from, no tensors.
    state = scaler.__getstate__()
    del state["_tensors"]
    state.update(
        _init_scale=scaler.get_scale(),
        _init_growth_tracker=scaler._get_growth_tracker(),
        _init_hysteresis_tracker=scaler._get_hysteresis_tracker(),
        _scale=None,
        _growth_tracker=None,
        _hysteresis_tracker=None,
    )
    restored = LossScaler.__new__(LossScaler)
    restored.__setstate__(state)
    assert restored.state_dict() == scaler.state_dict()
    for overflow in (True, False, False, False):
        _iteration(scaler, optimizer, params, overflow)
        _iteration(restored, optimizer, params, overflow)
        assert restored.state_dict() == scaler.state_dict()


def test_update_with_a_new_scale() -> None:
    params = [_param()]
    optimizer = FusedSGD(params, lr=1e-3)
    scaler = LossScaler(init_scale=64.0)
    _iteration(scaler, optimizer, params, overflow=False)
    scaler.update(new_scale=8.0)
    assert scaler.get_scale() == 8.0
    scaler.update(new_scale=torch.tensor(16.0))
    assert scaler.get_scale() == 16.0
    with pytest.raises(ValueError, match=r"new_scale must be > 0, got -1.0"):
        scaler.update(new_scale=-1.0)


def _pending_multiplier(optimizer) -> float:
    return optimizer.pending_scaling(torch.device("cpu"))[0].item()


def _exact_inverse(scale: float) -> float:
    return torch.tensor(scale).double().reciprocal().float().item()


def test_unscale_applies_the_inverse_of_the_current_scale_after_every_kind_of_change() -> None:
    # 1 / scale is kept by the update kernel and by every other write of the scale, not recomputed.
    params = [_param(torch.float16)]
    optimizer = FusedSGD(params, lr=1e-3)
    scaler = LossScaler(init_scale=3.0, growth_interval=1, backoff_factor=0.3, growth_factor=1.1)

    def set_scale() -> None:
        _iteration(scaler, optimizer, params, overflow=False)
        scaler.update(new_scale=7.0)

    changes = [
        lambda: _iteration(scaler, optimizer, params, overflow=False),  # grows
        lambda: _iteration(scaler, optimizer, params, overflow=True),  # backs off
        set_scale,
        lambda: scaler.load_state_dict({**scaler.state_dict(), "scale": 5.0}),
    ]
    scales = []
    for change in [lambda: None, *changes]:
        change()
        scaler.scale(torch.zeros(()))
        params[0].grad = torch.ones_like(params[0])
        scaler.defer_unscale_(optimizer)
        assert _pending_multiplier(optimizer) == _exact_inverse(scaler.get_scale())
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
    assert scales[3:] == [7.0, 5.0]


def test_scale_sequence_is_the_same_on_the_triton_kernel(device, monkeypatch) -> None:
    pattern = "OO.OOOO....OO.O...."
    runs = []
    # The scaler's update runs each implementation by name (on CUDA both would otherwise pick
    # Triton); the optimizer's kernels are the device's.
    for implementation in (reference, triton_ops):
        monkeypatch.setattr(
            loss_scale_tensors_module, "implementation_for", lambda tensors, module=implementation: module
        )
        params = [torch.nn.Parameter(torch.ones(3, device=device))]
        optimizer = FusedAdam(params, lr=1e-3)
        scaler = LossScaler(init_scale=2.0**14, hysteresis=2, growth_interval=3, backoff_factor=0.3)
        states = []
        for mark in pattern:
            scaler.scale(torch.zeros((), device=device))
            params[0].grad = torch.full_like(params[0], float("inf") if mark == "O" else 1.0)
            scaler.step(optimizer)
            scaler.update()
            states.append(
                (scaler.get_scale(), scaler._get_growth_tracker(), scaler._get_hysteresis_tracker())
            )
        runs.append(states)
    assert runs[0] == runs[1]
    assert len({scale for scale, _, _ in runs[0]}) > 3


def test_overflow_flags_are_reused_and_start_every_step_at_zero() -> None:
    params = [_param(torch.float16), _param()]
    optimizer = FusedAdam(params, lr=1e-3)
    scaler = LossScaler(init_scale=64.0)
    _iteration(scaler, optimizer, params, overflow=True)
    flag = optimizer._pending.flags[torch.device("cpu")]
    assert flag.item() == 0.0  # zeroed by the update that read it
    steps = optimizer.param_groups[0]["step"].item()
    _iteration(scaler, optimizer, params, overflow=False)
    assert optimizer._pending.flags[torch.device("cpu")] is flag
    assert optimizer.param_groups[0]["step"].item() == steps + 1  # the old overflow did not stick
    # An overflowing iteration ended by update(new_scale) leaves its flag set; the next one clears it.
    scaler.scale(torch.zeros(()))
    params[0].grad = torch.full_like(params[0], float("inf"))
    params[1].grad = torch.ones_like(params[1])
    scaler.step(optimizer)
    scaler.update(new_scale=32.0)
    assert flag.item() == 1.0
    _iteration(scaler, optimizer, params, overflow=False)
    assert optimizer.param_groups[0]["step"].item() == steps + 2
    assert scaler.get_scale() == 32.0


def test_update_reads_the_flags_of_several_optimizers() -> None:
    first, second = [_param(torch.float16)], [_param()]
    optimizers = [FusedAdam(first, lr=1e-3), torch.optim.SGD(second, lr=1e-3)]
    scaler = LossScaler(init_scale=64.0, growth_interval=2)
    for overflow_in, expected in ((None, 64.0), (None, 128.0), (1, 64.0), (0, 32.0), (None, 32.0)):
        scaler.scale(torch.zeros(()))
        for i, params in enumerate((first, second)):
            params[0].grad = torch.full_like(params[0], float("inf") if overflow_in == i else 1.0)
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == expected


def test_bounds_and_counts_beyond_the_state_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="float32"):
        LossScaler(max_scale=1e39)
    with pytest.raises(ValueError, match="int32"):
        LossScaler(growth_interval=2**31)
