"""Parameters whose first grad comes late (a layer unfrozen later, a branch unused at first) step as
in torch.optim: Adam's bias correction counts each parameter's own steps, SGD's momentum buffer
starts at the parameter's first grad (also with dampening > 0)."""

from __future__ import annotations

import pytest
import torch

from amp_fx import LossScaler
from amp_fx.kernels import FORCE_TRITON_ENV
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import tolerances
from tests.optim.conftest import step_counts

STEPS = 20
SHAPES = ((5, 7), (3,), (2, 3, 4), (6,))
UNFROZEN_AT = {1: 7, 3: 12}  # param 1: frozen, then unfrozen; param 3: a branch unused at first
NEVER = 2  # param 2 never gets a grad
SETTINGS = {
    "adam": (FusedAdam, torch.optim.Adam, {"lr": 1e-2, "adam_w_mode": False, "weight_decay": 0.05}),
    "adamw": (FusedAdam, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05}),
    "sgd": (FusedSGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
}


def _torch_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k != "adam_w_mode"}


def _params(dtype: torch.dtype) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=generator) for s in SHAPES]
    return (
        [torch.nn.Parameter(v.to(dtype)) for v in values],
        [torch.nn.Parameter(v.to(dtype).float()) for v in values],
    )


def _has_grad(index: int, step: int) -> bool:
    return index != NEVER and step >= UNFROZEN_AT.get(index, 0)


def _set_grads(params, copies, generator, step: int, scale: float = 1.0) -> None:
    for i, (param, copy) in enumerate(zip(params, copies, strict=True)):
        grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        has_grad = _has_grad(i, step)
        param.grad = (grad.float() * scale).to(param.dtype) if has_grad else None
        copy.grad = grad.float() if has_grad else None


def _train(name: str, dtype: torch.dtype) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer, list]:
    ours_cls, torch_cls, kwargs = SETTINGS[name]
    params, copies = _params(dtype)
    optimizer, reference = ours_cls(params, **kwargs), torch_cls(copies, **_torch_kwargs(kwargs))
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        _set_grads(params, copies, generator, step)
        optimizer.step()
        reference.step()
    return optimizer, reference, copies


def _expected_steps() -> list[float | None]:
    return [None if i == NEVER else float(STEPS - UNFROZEN_AT.get(i, 0)) for i in range(len(SHAPES))]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_fp32_matches_torch_per_parameter(name) -> None:
    optimizer, reference, copies = _train(name, torch.float32)
    assert step_counts(optimizer) == _expected_steps()
    for param, copy in zip(master_params(optimizer), copies, strict=True):
        if name == "sgd":
            assert torch.equal(param, copy)  # torch's operations in torch's order: its bits
            continue
        # Adam: bias correction by expm1 in fp32 (torch: 1 - beta**t in fp64), so fp32 rounding apart;
        # a count per group would be ~1e-3 off for the late params.
        rtol, atol = tolerances(torch.float32)
        torch.testing.assert_close(param, copy, rtol=rtol, atol=atol)
    for copy, expected in zip(copies, _expected_steps(), strict=True):
        state = reference.state.get(copy, {})
        if "step" in state:
            assert state["step"].item() == expected


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_late_momentum_buffer_starts_at_the_first_grad(name) -> None:
    optimizer, reference, copies = _train(name, torch.bfloat16)
    rtol, atol = tolerances(torch.float32)
    for param, copy in zip(optimizer.param_groups[0]["params"], copies, strict=True):
        for key, value in reference.state.get(copy, {}).items():
            if key != "step":
                torch.testing.assert_close(optimizer.state[param][key], value, rtol=rtol, atol=atol)
    for master, copy in zip(master_params(optimizer), copies, strict=True):
        torch.testing.assert_close(master, copy.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_triton_kernels_match_the_reference(monkeypatch, name) -> None:
    ours_cls, _, kwargs = SETTINGS[name]
    runs = []
    for force in ("0", "1"):
        monkeypatch.setenv(FORCE_TRITON_ENV, force)
        params, copies = _params(torch.float16)
        optimizer, generator = ours_cls(params, **kwargs), torch.Generator().manual_seed(1)
        for step in range(STEPS):
            _set_grads(params, copies, generator, step)
            optimizer.step()
        runs.append((optimizer, params))
    (reference, _), (triton, params) = runs
    assert step_counts(triton) == step_counts(reference) == _expected_steps()
    rtol, atol = tolerances(torch.float32)
    for ours, expected in zip(master_params(triton), master_params(reference), strict=True):
        torch.testing.assert_close(ours, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_skipped_first_step_leaves_the_count_at_zero(name) -> None:
    """A late parameter's first step overflows: it is skipped, and the next one is its first (as for
    torch.amp.GradScaler with torch.optim, which never calls the optimizer on an overflow)."""
    ours_cls, torch_cls, kwargs = SETTINGS[name]
    params, copies = _params(torch.float16)
    optimizer, reference = ours_cls(params, **kwargs), torch_cls(copies, **_torch_kwargs(kwargs))
    scaler, generator = LossScaler(init_scale=256.0), torch.Generator().manual_seed(1)
    overflow_at = UNFROZEN_AT[1]
    for step in range(STEPS):
        scaler.scale(torch.zeros(()))
        scale = scaler.get_scale()
        _set_grads(params, copies, generator, step, scale=scale)
        if step == overflow_at:
            params[1].grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        if step != overflow_at:
            reference.step()
    assert step_counts(optimizer)[1] == STEPS - overflow_at - 1
    rtol, atol = tolerances(torch.float32)
    for master, copy in zip(master_params(optimizer), copies, strict=True):
        torch.testing.assert_close(master, copy.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_a_group_step_checkpoint_loads_as_per_parameter_counts(name) -> None:
    """A checkpoint from before per-parameter counts (one "step" per group, none per parameter)
    gives each parameter with moments its group's count; parameters without moments get none."""
    ours_cls, _, kwargs = SETTINGS[name]
    params, copies = _params(torch.float16)
    optimizer, generator = ours_cls(params, **kwargs), torch.Generator().manual_seed(1)
    for step in range(10):
        _set_grads(params, copies, generator, step)
        optimizer.step()
    old = optimizer.state_dict()
    for state in old["state"].values():
        state.pop("step", None)
    old["param_groups"][0]["step"] = torch.tensor([10.0])
    loaded = ours_cls([torch.nn.Parameter(p.detach().clone()) for p in params], **kwargs)
    loaded.load_state_dict(old)
    assert step_counts(loaded) == [10.0, 10.0, None, None]  # param 3's moments come at step 12
    assert "step" not in loaded.param_groups[0]
    assert all(loaded.state[p]["step"].shape == () for p in loaded.param_groups[0]["params"][:2])


def test_a_new_checkpoint_without_a_count_is_refused() -> None:
    params, copies = _params(torch.float16)
    optimizer = FusedAdam(params)
    _set_grads(params, copies, torch.Generator().manual_seed(1), step=0)
    optimizer.step()
    state_dict = optimizer.state_dict()
    del state_dict["state"][0]["step"]
    with pytest.raises(ValueError, match=r"missing \['step'\]"):
        FusedAdam([torch.nn.Parameter(p.detach().clone()) for p in params]).load_state_dict(state_dict)
    state_dict = optimizer.state_dict()
    state_dict["state"][0]["step"] = torch.tensor(float("nan"))
    with pytest.raises(ValueError, match="finite count of steps"):
        FusedAdam([torch.nn.Parameter(p.detach().clone()) for p in params]).load_state_dict(state_dict)
