"""FusedSGD against torch.optim.SGD on FP32 copies, for fp16, bf16 and fp32 parameters."""

from __future__ import annotations

import pytest
import torch

from amp_fx.optim import FusedSGD, master_params
from amp_fx.testing import tolerances

SETTINGS = [
    {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    {"momentum": 0.9, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    {"momentum": 0.9, "dampening": 0.0, "nesterov": True, "weight_decay": 0.01},
    {"momentum": 0.8, "dampening": 0.3, "nesterov": False, "weight_decay": 0.01},
    {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.1},
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_masters_match_torch_fp32_over_20_steps(problem, dtype, settings) -> None:
    case = problem(dtype, seed=21)
    optimizer = FusedSGD(case.params, lr=0.05, **settings)
    reference = torch.optim.SGD(case.fp32, lr=0.05, **settings)
    for _ in range(20):
        case.next_grads()
        optimizer.step()
        reference.step()
    rtol, atol = tolerances(torch.float32)
    for master, expected in zip(master_params(optimizer), case.fp32, strict=True):
        torch.testing.assert_close(master.detach(), expected.detach(), rtol=rtol, atol=atol)
    for param, master in zip(case.params, master_params(optimizer), strict=True):
        assert torch.equal(param.detach(), master.to(dtype))
    if settings["momentum"]:
        for param, expected in zip(case.params, case.fp32, strict=True):
            buffer = reference.state[expected]["momentum_buffer"]
            torch.testing.assert_close(
                optimizer.state[param]["momentum_buffer"], buffer, rtol=rtol, atol=atol
            )


def test_momentum_buffers_exist_only_with_momentum() -> None:
    with_momentum = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    plain = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    optimizer = FusedSGD([{"params": [with_momentum], "momentum": 0.9}, {"params": [plain]}], lr=0.1)
    # As torch.optim.SGD: no buffer before the first step, so building the optimizer costs none.
    assert set(optimizer.state[with_momentum]) == {"master_param"}
    for param in (with_momentum, plain):
        param.grad = torch.ones(3, dtype=torch.float16)
    optimizer.step()
    # The step offset comes with the buffer (the group steps before the param's first, here none).
    assert set(optimizer.state[with_momentum]) == {"master_param", "momentum_buffer", "step_offset"}
    assert set(optimizer.state[plain]) == {"master_param"}


def test_momentum_switched_on_later_creates_its_buffer(problem) -> None:
    case = problem(torch.float16, seed=23)
    optimizer = FusedSGD(case.params, lr=0.05)
    case.next_grads()
    optimizer.step()
    optimizer.param_groups[0]["momentum"] = 0.9
    case.next_grads()
    optimizer.step()
    assert all(optimizer.state[p]["momentum_buffer"].abs().sum() > 0 for p in case.params)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"lr": -0.1}, ValueError, "invalid lr"),
        ({"momentum": -0.5}, ValueError, "invalid momentum"),
        ({"weight_decay": -1.0}, ValueError, "invalid weight_decay"),
        ({"nesterov": True}, ValueError, "nesterov momentum requires momentum > 0"),
        ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, ValueError, "and dampening == 0"),
        ({"momentum": "0.9"}, TypeError, "momentum must be a finite Python float"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        FusedSGD([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_signature_defaults_follow_torch() -> None:
    optimizer = FusedSGD([torch.nn.Parameter(torch.zeros(2))])
    torch_defaults = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))]).defaults
    for key in ("lr", "momentum", "dampening", "weight_decay", "nesterov"):
        assert optimizer.defaults[key] == torch_defaults[key], key


def test_lr_scheduler_drives_the_learning_rate(problem) -> None:
    case = problem(torch.float16, seed=25)
    optimizer = FusedSGD(case.params, lr=0.1)
    reference = torch.optim.SGD(case.fp32, lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (optimizer, reference)]
    for _ in range(5):
        case.next_grads()
        optimizer.step()
        reference.step()
        for scheduler in schedulers:
            scheduler.step()
    assert optimizer.param_groups[0]["lr"] == reference.param_groups[0]["lr"] == 0.025
    rtol, atol = tolerances(torch.float32)
    for master, expected in zip(master_params(optimizer), case.fp32, strict=True):
        torch.testing.assert_close(master, expected.detach(), rtol=rtol, atol=atol)
