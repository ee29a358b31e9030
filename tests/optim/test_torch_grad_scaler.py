"""The fused optimizers under torch's own torch.amp.GradScaler (grad_scale / found_inf attributes)."""

from __future__ import annotations

import pytest
import torch

from amp_fx import clip_grad_norm_
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import tolerances


def _grad_scaler(init_scale: float) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_unscales_inside_the_step(problem, dtype) -> None:
    case = problem(dtype, seed=41)
    optimizer = FusedAdam(case.params, lr=1e-2)
    reference = torch.optim.AdamW(case.fp32, lr=1e-2, weight_decay=0.0)
    scaler = _grad_scaler(512.0)
    for _ in range(6):
        scaler.scale(torch.zeros(()))
        case.next_grads(scale=scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        reference.step()
        assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
    rtol, atol = tolerances(torch.float32)
    for master, expected in zip(master_params(optimizer), case.fp32, strict=True):
        torch.testing.assert_close(master, expected.detach(), rtol=rtol, atol=atol)
    assert scaler.get_scale() == 2048.0  # grew twice (growth_interval=3): GradScaler saw clean steps


def test_grad_scaler_overflow_skips_on_the_device(problem, optimizer_snapshot) -> None:
    snapshot, assert_unchanged = optimizer_snapshot
    case = problem(torch.float16, seed=43)
    optimizer = FusedSGD(case.params, lr=0.1, momentum=0.9)
    scaler = _grad_scaler(512.0)
    scaler.scale(torch.zeros(()))
    case.next_grads(scale=512.0)
    case.params[1].grad[0] = float("inf")
    before = snapshot(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert_unchanged(before, snapshot(optimizer))
    assert scaler.get_scale() == 256.0


def test_grad_scaler_unscale_then_amp_fx_clip(problem) -> None:
    # GradScaler.unscale_ rewrites bf16/fp32 grads in place; the step then gets grad_scale=None.
    case = problem(torch.bfloat16, seed=45)
    optimizer = FusedAdam(case.params, lr=1e-2)
    reference = torch.optim.AdamW(case.fp32, lr=1e-2, weight_decay=0.0)
    scaler = _grad_scaler(256.0)
    scaler.scale(torch.zeros(()))
    case.next_grads(scale=256.0)
    scaler.unscale_(optimizer)
    norm = clip_grad_norm_(optimizer, max_norm=0.5)
    expected_norm = torch.nn.utils.clip_grad_norm_(case.fp32, max_norm=0.5)
    scaler.step(optimizer)
    reference.step()
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(norm, expected_norm, rtol=rtol, atol=atol)
    for master, expected in zip(master_params(optimizer), case.fp32, strict=True):
        torch.testing.assert_close(master, expected.detach(), rtol=rtol, atol=atol)


def test_without_any_scaler(problem) -> None:
    case = problem(torch.bfloat16, seed=47)
    optimizer = FusedSGD(case.params, lr=0.1)
    reference = torch.optim.SGD(case.fp32, lr=0.1)
    case.next_grads()
    optimizer.step()
    reference.step()
    rtol, atol = tolerances(torch.float32)
    for master, expected in zip(master_params(optimizer), case.fp32, strict=True):
        torch.testing.assert_close(master, expected.detach(), rtol=rtol, atol=atol)
