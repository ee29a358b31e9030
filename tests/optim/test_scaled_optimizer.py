"""The ScaledOptimizer handshake (amp_fx/optim/scaled_optimizer.py), driven by hand as LossScaler does."""

from __future__ import annotations

import pytest
import torch

from amp_fx.optim import FusedAdam, FusedSGD
from amp_fx.optim.scaled_optimizer import ScaledOptimizer

CPU = torch.device("cpu")


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(5, generator=generator)) for _ in range(2)]


@pytest.mark.parametrize("optimizer_class", [FusedAdam, FusedSGD])
def test_fused_optimizers_implement_the_protocol(optimizer_class) -> None:
    assert isinstance(optimizer_class(_params()), ScaledOptimizer)
    assert not isinstance(torch.optim.SGD(_params(), lr=0.1), ScaledOptimizer)


def test_unscale_and_fold_reach_the_step_as_torch_sgd_on_the_unscaled_grads() -> None:
    ours, reference = _params(), _params()
    grads = [torch.linspace(-3.0, 5.0, 5) * 8.0, torch.linspace(1.0, 2.0, 5) * 8.0]  # scaled by 8
    for param, ref, grad in zip(ours, reference, grads, strict=True):
        param.grad = grad.clone()
        ref.grad = grad / 8.0 * 0.5
    optimizer = FusedSGD(ours, lr=0.1, momentum=0.9)
    flags = optimizer.unscale_grads_(torch.tensor(1.0 / 8.0))
    assert list(flags) == [CPU] and flags[CPU].item() == 0.0
    assert torch.equal(ours[0].grad, grads[0])  # the grads are only read
    optimizer.fold_grad_multiplier_(torch.tensor(0.5))
    multiplier, found_inf = optimizer.pending_scaling(CPU)
    assert multiplier.item() == 1.0 / 16.0 and found_inf is flags[CPU]
    optimizer.step()
    torch.optim.SGD(reference, lr=0.1, momentum=0.9).step()
    for param, ref in zip(ours, reference, strict=True):
        torch.testing.assert_close(param.detach(), ref.detach())
    assert optimizer.pending_scaling(CPU) == (None, None)  # the step consumed them


def test_an_overflow_flag_makes_the_step_a_no_op() -> None:
    params = _params()
    before = [p.detach().clone() for p in params]
    for param in params:
        param.grad = torch.ones_like(param)
    params[1].grad[2] = float("inf")
    optimizer = FusedAdam(params, lr=0.1)
    assert optimizer.unscale_grads_(torch.tensor(1.0))[CPU].item() == 1.0
    optimizer.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


def test_finish_scaling_forgets_pending_values_and_trusts_flags_reported_zeroed() -> None:
    params = _params()
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer = FusedSGD(params, lr=0.1)
    (flag,) = optimizer.unscale_grads_(torch.tensor(0.5)).values()
    optimizer.finish_scaling()
    assert optimizer.pending_scaling(CPU) == (None, None)
    # A flag nobody reported zeroed is filled with 0 before its next check...
    flag.fill_(3.0)
    assert optimizer.unscale_grads_(torch.tensor(0.5))[CPU].item() == 0.0
    # ...one reported zeroed (LossScaler.update's kernel zeroes the flags it read) is not filled again.
    flag.fill_(3.0)
    optimizer.finish_scaling(zeroed_found_infs=[flag])
    (again,) = optimizer.unscale_grads_(torch.tensor(0.5)).values()
    assert again is flag and again.item() == 3.0
