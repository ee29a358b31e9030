"""clip_grad_norm_ on amp_fx optimizers against torch.nn.utils.clip_grad_norm_ on FP32 copies."""

from __future__ import annotations

import pytest
import torch

from amp_fx import LossScaler, clip_grad_norm_
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import tolerances

SHAPES = ((6, 5), (5,), (1,), (3, 2, 2))


def _problem(dtype: torch.dtype, seed: int, grad_size: float):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in SHAPES]
    copies = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    grads = [(torch.randn(s, generator=generator) * grad_size).to(dtype) for s in SHAPES]
    return params, copies, grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clips / does not clip
def test_clip_under_loss_scaler_matches_torch(dtype, max_norm) -> None:
    params, copies, grads = _problem(dtype, seed=0, grad_size=2.0)
    optimizer = FusedAdam(params, lr=1e-2)
    reference = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.0)
    scaler = LossScaler(init_scale=2.0**10)
    scaler.scale(torch.zeros(()))
    for param, copy, grad in zip(params, copies, grads, strict=True):
        param.grad = (grad.float() * 2.0**10).to(dtype)
        copy.grad = grad.float()
    scaler.unscale_(optimizer)
    norm = clip_grad_norm_(optimizer, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(copies, max_norm)
    scaler.step(optimizer)
    scaler.update()
    reference.step()
    rtol, atol = tolerances(torch.float32)
    assert norm.shape == () and norm.dtype == torch.float32
    torch.testing.assert_close(norm, expected, rtol=rtol, atol=atol)
    for master, copy in zip(master_params(optimizer), copies, strict=True):
        torch.testing.assert_close(master, copy.detach(), rtol=rtol, atol=atol)


def test_clip_without_scaler_then_sgd_step_matches_torch() -> None:
    params, copies, grads = _problem(torch.bfloat16, seed=1, grad_size=3.0)
    optimizer = FusedSGD(params, lr=0.1, momentum=0.9)
    reference = torch.optim.SGD(copies, lr=0.1, momentum=0.9)
    for param, copy, grad in zip(params, copies, grads, strict=True):
        param.grad, copy.grad = grad, grad.float()
    norm = clip_grad_norm_(optimizer, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    optimizer.step()
    reference.step()
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(norm, expected, rtol=rtol, atol=atol)
    for master, copy in zip(master_params(optimizer), copies, strict=True):
        torch.testing.assert_close(master, copy.detach(), rtol=rtol, atol=atol)


def test_clip_leaves_the_grads_alone_and_lasts_one_step() -> None:
    params, _, grads = _problem(torch.float16, seed=2, grad_size=5.0)
    optimizer = FusedSGD(params, lr=0.1)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    clip_grad_norm_(optimizer, 0.1)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    optimizer.step()  # consumes the clip coefficient
    before = [m.clone() for m in master_params(optimizer)]
    optimizer.step()  # same grads, unclipped
    rtol, atol = tolerances(torch.float32)
    for master, old, grad in zip(master_params(optimizer), before, grads, strict=True):
        torch.testing.assert_close(master, old - 0.1 * grad.float(), rtol=rtol, atol=atol)


def test_non_finite_grad_gives_a_non_finite_norm_and_the_step_is_skipped() -> None:
    params, _, grads = _problem(torch.float16, seed=3, grad_size=1.0)
    optimizer = FusedAdam(params)
    scaler = LossScaler(init_scale=4.0)
    scaler.scale(torch.zeros(()))
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad * 4
    params[2].grad[0] = float("inf")
    before = [p.detach().clone() for p in params]
    scaler.unscale_(optimizer)
    assert not torch.isfinite(clip_grad_norm_(optimizer, 1.0))
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


def test_torch_optimizers_and_parameters_go_to_torch() -> None:
    params, copies, grads = _problem(torch.float32, seed=4, grad_size=2.0)
    for param, copy, grad in zip(params, copies, grads, strict=True):
        param.grad, copy.grad = grad.clone(), grad.clone()
    norm = clip_grad_norm_(torch.optim.SGD(params, lr=0.1), 1.0)
    expected = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert torch.equal(norm, expected)
    assert all(torch.equal(p.grad, c.grad) for p, c in zip(params, copies, strict=True))
    assert torch.equal(clip_grad_norm_(params[0], 1e9), params[0].grad.norm())


def test_bad_arguments() -> None:
    optimizer = FusedAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(optimizer, 1.0, norm_type=float("inf"))
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(optimizer, -1.0)
    assert clip_grad_norm_(optimizer, 1.0) == 0.0  # no grads: norm 0, as torch
