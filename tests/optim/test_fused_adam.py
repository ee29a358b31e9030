"""FusedAdam against torch.optim.Adam / AdamW on FP32 copies, for fp16, bf16 and fp32 parameters."""

from __future__ import annotations

import pytest
import torch

from amp_fx import LossScaler
from amp_fx.kernels import reference
from amp_fx.optim import FusedAdam, master_params
from amp_fx.testing import tolerances

LOW = (torch.float16, torch.bfloat16)


def _torch_adam(params, adam_w_mode: bool, **hyperparameters) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, **hyperparameters)


def _assert_masters_match(optimizer, fp32_params) -> None:
    rtol, atol = tolerances(torch.float32)
    for master, expected in zip(master_params(optimizer), fp32_params, strict=True):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.detach(), expected.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("adam_w_mode,weight_decay", [(True, 0.0), (True, 0.05), (False, 0.05)])
def test_masters_match_torch_fp32_over_20_steps(problem, dtype, adam_w_mode, weight_decay) -> None:
    case = problem(dtype)
    hyper = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": weight_decay}
    optimizer = FusedAdam(case.params, adam_w_mode=adam_w_mode, **hyper)
    reference = _torch_adam(case.fp32, adam_w_mode, **hyper)
    for _ in range(20):
        case.next_grads()
        optimizer.step()
        reference.step()
    _assert_masters_match(optimizer, case.fp32)
    for param, master in zip(case.params, master_params(optimizer), strict=True):
        assert torch.equal(param.detach(), master.to(dtype))  # the weight is its master, rounded to nearest
    assert optimizer.param_groups[0]["step"].item() == 20


def test_mixed_dtypes_in_one_group_take_one_step(problem) -> None:
    dtypes = [torch.float16, torch.float32, torch.bfloat16, torch.float32]
    case = problem(dtypes, seed=3)
    optimizer = FusedAdam(case.params, lr=1e-2)
    reference = torch.optim.AdamW(case.fp32, lr=1e-2, weight_decay=0.0)
    for _ in range(5):
        case.next_grads()
        optimizer.step()
        reference.step()
    _assert_masters_match(optimizer, case.fp32)
    for param, dtype in zip(case.params, dtypes, strict=True):
        assert param.dtype == dtype
        assert ("master_param" in optimizer.state[param]) == (dtype != torch.float32)


@pytest.mark.parametrize("dtype", LOW)
def test_with_loss_scaler_matches_unscaled_torch(problem, dtype) -> None:
    case = problem(dtype, seed=5)
    optimizer = FusedAdam(case.params, lr=1e-2, weight_decay=0.01)
    reference = torch.optim.AdamW(case.fp32, lr=1e-2, weight_decay=0.01)
    scaler = LossScaler(init_scale=1024.0)
    for _ in range(10):
        scaler.scale(torch.zeros(()))  # creates the scale on the first call, as a loss would
        case.next_grads(scale=scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        reference.step()
    _assert_masters_match(optimizer, case.fp32)


def test_master_weights_false_updates_low_precision_params_in_place(problem) -> None:
    case = problem(torch.float16, seed=7)
    optimizer = FusedAdam(case.params, lr=1e-2, master_weights=False)
    reference = torch.optim.AdamW(case.fp32, lr=1e-2, weight_decay=0.0)
    assert all("master_param" not in optimizer.state[p] for p in case.params)
    case.next_grads()
    optimizer.step()
    reference.step()
    for param, expected in zip(case.params, case.fp32, strict=True):
        # One step from the same weights: the fp16 result is the fp32 one rounded to nearest.
        assert torch.equal(param.detach(), expected.detach().to(torch.float16))
    assert list(master_params(optimizer)) == list(case.params)


def test_params_without_grads_are_left_alone(problem, bits_equal_fn) -> None:
    case = problem(torch.bfloat16, seed=9)
    optimizer = FusedAdam(case.params, lr=1e-2)
    case.next_grads()
    frozen = case.params[1]
    frozen.grad = None
    before = (frozen.detach().clone(), {k: v.clone() for k, v in optimizer.state[frozen].items()})
    optimizer.step()
    assert bits_equal_fn(frozen.detach(), before[0])
    for key, value in before[1].items():
        assert bits_equal_fn(optimizer.state[frozen][key], value)
    assert not torch.equal(case.params[0].detach(), case.fp32[0].detach().to(torch.bfloat16))


def test_no_grads_at_all_takes_no_step(problem) -> None:
    case = problem(torch.float16)
    optimizer = FusedAdam(case.params)
    optimizer.step()
    assert optimizer.param_groups[0]["step"].item() == 0


def test_closure_is_called_and_its_loss_returned(problem) -> None:
    case = problem(torch.float32, seed=11)
    optimizer = FusedAdam(case.params, lr=1e-2)

    def closure():
        optimizer.zero_grad()
        loss = sum(p.square().sum() for p in case.params)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.requires_grad
    assert optimizer.param_groups[0]["step"].item() == 1


def test_channels_last_params_and_grads_of_another_layout() -> None:
    weight = torch.nn.Parameter(
        torch.randn(4, 3, 5, 5).to(torch.float16).to(memory_format=torch.channels_last)
    )
    reference = torch.nn.Parameter(weight.detach().float().contiguous())
    optimizer = FusedAdam([weight], lr=1e-2)
    assert optimizer.state[weight]["master_param"].stride() == weight.stride()
    grad = torch.randn(4, 3, 5, 5).to(torch.float16)  # contiguous, unlike the weight
    weight.grad, reference.grad = grad, grad.float()
    optimizer.step()
    torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.0).step()
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(
        optimizer.state[weight]["master_param"], reference.detach(), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"lr": -1.0}, ValueError, "invalid lr"),
        ({"betas": (1.0, 0.999)}, ValueError, "invalid beta1"),
        ({"betas": (0.9,)}, TypeError, "betas must be a pair"),
        ({"eps": -1e-8}, ValueError, "invalid eps"),
        ({"weight_decay": -0.1}, ValueError, "invalid weight_decay"),
        ({"lr": torch.tensor(1e-3)}, TypeError, "lr must be a finite Python float"),
        ({"adam_w_mode": 1}, TypeError, "adam_w_mode must be True or False"),
    ],
)
def test_bad_hyperparameters_are_refused(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


@pytest.mark.parametrize(
    "param,match",
    [
        (torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)), "dtype"),
        (torch.nn.Parameter(torch.zeros(4, 4)[:, ::2]), "dense"),
    ],
)
def test_unsupported_params_are_refused(param, match) -> None:
    with pytest.raises(ValueError, match=match):
        FusedAdam([param])


def test_torch_like_param_groups() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    optimizer = FusedAdam([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=1e-3, betas=(0.8, 0.9))
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 0.5]
    assert optimizer.param_groups[1]["betas"] == (0.8, 0.9)
    assert optimizer._step_supports_amp_scaling is True
    assert isinstance(optimizer, torch.optim.Optimizer)


@pytest.mark.parametrize("num_params", [1, 40])
def test_one_kernel_call_per_group_whatever_the_number_of_params(monkeypatch, num_params) -> None:
    calls = []
    original = reference.adam_step_
    monkeypatch.setattr(
        reference,
        "adam_step_",
        lambda params, *a, **k: calls.append(len(params)) or original(params, *a, **k),
    )
    params = [torch.nn.Parameter(torch.randn(3).to(LOW[i % 2])) for i in range(num_params)]
    optimizer = FusedAdam([{"params": params[::2]}, {"params": params[1::2]}] if num_params > 1 else params)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert sorted(calls) == sorted(len(g["params"]) for g in optimizer.param_groups)
