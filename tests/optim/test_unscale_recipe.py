"""torch.amp's recipe means what it means with amp_fx's optimizers and LossScaler: after
``scaler.unscale_(opt)`` the grads are the true gradients, what user code does to them is what the
step applies, and the step never unscales twice. Checked against torch.amp.GradScaler + torch.optim
over FP32 copies; and the fast path (no unscale_) against the same reference."""

from __future__ import annotations

import pytest
import torch

import amp_fx
from amp_fx import LossScaler
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import tolerances

SCALE = 2.0**12
OPTIMIZERS = {
    "adam": (
        lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01),
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
    ),
    "sgd": (
        lambda params: FusedSGD(params, lr=0.05, momentum=0.9),
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    ),
}


class Wrapper:
    """A user's own wrapper: the optimizer at ``.optimizer`` and nothing else."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def step(self):  # pragma: no cover - never called: amp_fx steps the optimizer inside
        raise AssertionError("the wrapper's step was called")


def _reference_step(reference, copies, grad_scaler, *, clip: float | None, scale_after: float = 1.0):
    grad_scaler.scale(torch.zeros(()))
    for copy in copies:
        copy.grad.mul_(SCALE)
    grad_scaler.unscale_(reference)
    norm = torch.nn.utils.clip_grad_norm_(copies, clip) if clip is not None else None
    for copy in copies:
        copy.grad.mul_(scale_after)
    grad_scaler.step(reference)
    grad_scaler.update()
    return norm


def _assert_masters_match(optimizer, copies) -> None:
    rtol, atol = tolerances(torch.float32)
    for master, copy in zip(master_params(optimizer), copies, strict=True):
        torch.testing.assert_close(master, copy.detach(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "wrapped"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unscale_then_torch_clip_matches_grad_scaler_over_fp32_copies(problem, dtype, name, wrap) -> None:
    case = problem([dtype, dtype, torch.float32, dtype], seed=81)
    make, make_reference = OPTIMIZERS[name]
    optimizer, reference = make(case.params), make_reference(case.fp32)
    held = Wrapper(optimizer) if wrap else optimizer
    scaler = LossScaler(init_scale=SCALE, growth_interval=1000)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    for _ in range(3):
        scaler.scale(torch.zeros(()))
        case.next_grads(scale=SCALE)
        scaler.unscale_(held)
        assert all(type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32 for p in case.params)
        norm = torch.nn.utils.clip_grad_norm_(case.params, max_norm=0.5)
        for param in case.params:  # what the user does to the grads is what the step applies
            param.grad.mul_(0.5)
        scaler.step(held)
        scaler.update()
        expected = _reference_step(reference, case.fp32, grad_scaler, clip=0.5, scale_after=0.5)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-6)
    _assert_masters_match(optimizer, case.fp32)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fast_path_clip_without_unscale_matches_the_recipe(problem, dtype, name) -> None:
    case = problem(dtype, seed=83)
    make, make_reference = OPTIMIZERS[name]
    optimizer, reference = make(case.params), make_reference(case.fp32)
    scaler = LossScaler(init_scale=SCALE, growth_interval=1000)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    for _ in range(3):
        scaler.scale(torch.zeros(()))
        case.next_grads(scale=SCALE)
        scaled = [p.grad.clone() for p in case.params]
        norm = amp_fx.clip_grad_norm_(Wrapper(optimizer), max_norm=0.5)
        # The fast path leaves the grads scaled, in their own dtype: 1 / scale and the clip are the kernel's.
        for param, grad in zip(case.params, scaled, strict=True):
            assert param.grad.dtype == dtype and torch.equal(param.grad, grad)
        scaler.step(optimizer)
        scaler.update()
        expected = _reference_step(reference, case.fp32, grad_scaler, clip=0.5)
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-6)
    _assert_masters_match(optimizer, case.fp32)


def test_unscale_after_the_fast_path_clip_writes_the_clipped_grads(problem) -> None:
    case = problem(torch.float16, seed=85)
    optimizer, reference = FusedSGD(case.params, lr=0.1), torch.optim.SGD(case.fp32, lr=0.1)
    scaler = LossScaler(init_scale=SCALE)
    scaler.scale(torch.zeros(()))
    case.next_grads(scale=SCALE)
    amp_fx.clip_grad_norm_(optimizer, max_norm=0.5, scaler=scaler)
    scaler.unscale_(optimizer)  # 1 / scale and the clip coefficient, written into the grads
    torch.nn.utils.clip_grad_norm_(case.fp32, max_norm=0.5)
    rtol, atol = tolerances(torch.float32)
    for param, copy in zip(case.params, case.fp32, strict=True):
        torch.testing.assert_close(param.grad, copy.grad, rtol=rtol, atol=atol)
    scaler.step(optimizer)
    scaler.update()
    reference.step()
    _assert_masters_match(optimizer, case.fp32)


def test_unscale_keeps_fp16_gradients_that_would_underflow_in_fp16(problem) -> None:
    # True grads around 1e-7: exact after scaling by 2**16, zero or subnormal once divided in fp16.
    case = problem(torch.float16, seed=87)
    optimizer = FusedAdam(case.params)
    scaler = LossScaler()
    scaler.scale(torch.zeros(()))
    generator = torch.Generator().manual_seed(0)
    true = [torch.randn(p.shape, generator=generator) * 1e-7 for p in case.params]
    for param, grad in zip(case.params, true, strict=True):
        param.grad = (grad * scaler.get_scale()).to(torch.float16)
    in_fp16 = [(p.grad * (1 / scaler.get_scale())).float() for p in case.params]
    scaler.unscale_(optimizer)
    rtol, atol = tolerances(torch.float16)
    for param, grad, lossy in zip(case.params, true, in_fp16, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=rtol, atol=0.0)
        assert (lossy - grad).abs().max() > (param.grad - grad).abs().max()


def test_overflow_after_unscale_still_skips_on_the_device(problem, optimizer_snapshot) -> None:
    snapshot, assert_unchanged = optimizer_snapshot
    case = problem(torch.float16, seed=89)
    optimizer = FusedAdam(case.params)
    scaler = LossScaler(init_scale=SCALE)
    scaler.scale(torch.zeros(()))
    case.next_grads(scale=SCALE)
    case.params[0].grad[0, 0] = float("inf")
    before = snapshot(optimizer)
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(case.params, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    assert_unchanged(before, snapshot(optimizer))
    assert scaler.get_scale() == SCALE / 2


def test_next_backward_after_an_unscaled_step_accumulates_into_the_fp32_grads() -> None:
    # zero_grad(set_to_none=False) keeps the FP32 grads; autograd adds the next fp16 grads to them.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).half()
    optimizer = FusedSGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=SCALE)
    x = torch.randn(8, 4).half()
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(model(x).float().square().mean()).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    assert model.weight.grad.dtype == torch.float32
    optimizer.zero_grad()
    scaler.scale(model(x).float().square().mean()).backward()
    assert model.weight.grad.dtype == torch.float16


def test_two_active_scalers_and_a_fresh_optimizer_are_refused_by_the_fast_path(problem) -> None:
    case = problem(torch.float16, seed=91)
    optimizer = FusedSGD(case.params, lr=0.1)
    first, second = LossScaler(), LossScaler()
    first.scale(torch.zeros(()))
    second.scale(torch.zeros(()))
    case.next_grads(scale=first.get_scale())
    with pytest.raises(RuntimeError, match="scaler=scaler"):
        amp_fx.clip_grad_norm_(optimizer, max_norm=1.0)
    amp_fx.clip_grad_norm_(optimizer, max_norm=1.0, scaler=first)
    first.step(optimizer)
    first.update()
    second.update(new_scale=1.0)
