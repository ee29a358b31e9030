"""An overflowing step is skipped on the device: everything stays bit-identical, NaN reaches no master."""

from __future__ import annotations

import pytest
import torch

from amp_fx import LossScaler
from amp_fx.optim import FusedAdam, FusedSGD, master_params

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float16]
OPTIMIZERS = {
    "adam": lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01),
    "sgd": lambda params: FusedSGD(params, lr=0.05, momentum=0.9),
}


def _scaled_step(scaler: LossScaler, optimizer, case, poison: float | None = None, where: int = 2) -> None:
    scaler.scale(torch.zeros(()))
    case.next_grads(scale=scaler.get_scale())
    if poison is not None:
        case.params[where].grad.view(-1)[0] = poison
    scaler.step(optimizer)
    scaler.update()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
def test_overflow_leaves_everything_bit_identical(problem, optimizer_snapshot, name, poison) -> None:
    snapshot, assert_unchanged = optimizer_snapshot
    case = problem(DTYPES, seed=31)
    optimizer = OPTIMIZERS[name](case.params)
    scaler = LossScaler(init_scale=1024.0)
    for _ in range(2):
        _scaled_step(scaler, optimizer, case)
    before = snapshot(optimizer)
    _scaled_step(scaler, optimizer, case, poison=poison)
    assert_unchanged(before, snapshot(optimizer))
    assert optimizer.param_groups[0]["step"].item() == 2
    assert scaler.get_scale() == 512.0
    for master in master_params(optimizer):
        assert torch.isfinite(master).all()
    _scaled_step(scaler, optimizer, case)
    assert optimizer.param_groups[0]["step"].item() == 3


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_overflow_within_hysteresis_is_skipped_too(problem, optimizer_snapshot, name) -> None:
    snapshot, assert_unchanged = optimizer_snapshot
    case = problem(DTYPES, seed=33)
    optimizer = OPTIMIZERS[name](case.params)
    scaler = LossScaler(init_scale=1024.0, hysteresis=2)
    _scaled_step(scaler, optimizer, case)
    before = snapshot(optimizer)
    _scaled_step(scaler, optimizer, case, poison=float("nan"), where=0)
    assert_unchanged(before, snapshot(optimizer))
    assert scaler.get_scale() == 1024.0  # the first overflow is absorbed, but the step is still skipped


def test_overflow_in_one_group_skips_every_group(problem, optimizer_snapshot) -> None:
    snapshot, assert_unchanged = optimizer_snapshot
    case = problem(DTYPES, seed=35)
    optimizer = FusedAdam([{"params": case.params[:2]}, {"params": case.params[2:], "lr": 0.1}])
    scaler = LossScaler(init_scale=256.0)
    before = snapshot(optimizer)
    _scaled_step(scaler, optimizer, case, poison=float("inf"), where=3)
    assert_unchanged(before, snapshot(optimizer))
    assert [g["step"].item() for g in optimizer.param_groups] == [0, 0]


def test_deferred_unscale_leaves_fp16_grads_untouched(problem, bits_equal_fn) -> None:
    # The fast path (amp_fx.clip_grad_norm_ or step without unscale_): the kernel applies 1 / scale.
    case = problem(torch.float16, seed=37)
    optimizer = FusedAdam(case.params)
    scaler = LossScaler(init_scale=2.0**12)
    scaler.scale(torch.zeros(()))
    case.next_grads(scale=scaler.get_scale())
    grads = [p.grad.clone() for p in case.params]
    scaler.defer_unscale_(optimizer)
    for param, grad in zip(case.params, grads, strict=True):
        assert bits_equal_fn(param.grad, grad)


def test_overflow_flag_is_cleared_before_every_check_nobody_cleared_it_for(problem) -> None:
    # The flag is one persistent tensor per device. Without a LossScaler.update in between (the
    # Apex-style amp_fx.amp path calls unscale_grads_ once per backward), each check must start at 0.
    case = problem(DTYPES)
    optimizer = FusedSGD(case.params, lr=0.05)
    case.next_grads()
    case.params[1].grad.view(-1)[0] = float("nan")
    (first,) = optimizer.unscale_grads_(torch.ones(())).values()
    assert first.item() == 1.0
    case.next_grads()
    (second,) = optimizer.unscale_grads_(torch.ones(())).values()
    assert second is first and second.item() == 0.0
    steps = optimizer.param_groups[0]["step"].clone()
    optimizer.step()
    assert optimizer.param_groups[0]["step"].item() == steps.item() + 1
