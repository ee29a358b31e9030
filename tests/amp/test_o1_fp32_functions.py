"""Apex's O1 as Apex ran it: with the Apex front end at O1, the functions torch.autocast runs in
FP32 (losses, and on CUDA softmax, exp, sum, ...) run in FP32 outside the converted model too, so
a loss computed from the model's fp16 output trains as under ``torch.autocast`` + ``GradScaler``:
the first step is applied whenever autocast's is, and the losses match. Nothing else changes:
``amp_fx.convert(model, "O1")`` stays autocast bit for bit, and torch's functions are its own again
once another ``initialize`` (or none) is current."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
import amp_fx.amp._state as amp_state
from amp_fx import amp
from amp_fx.amp import _fp32_functions

CLASSES, STEPS = 5, 6


@pytest.fixture(autouse=True)
def torch_functions_restored():
    yield
    _fp32_functions.restore()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = 3 * torch.randn(8, 16, generator=generator)  # losses above 1: fp16 * 65536 overflows
    return inputs, torch.randint(0, CLASSES, (8,), generator=generator)


def one_hot(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return F.one_hot(y, CLASSES).to(like.dtype)


LOSSES = {
    "cross_entropy": lambda out, y: F.cross_entropy(out, y),
    "mse_loss": lambda out, y: F.mse_loss(out / 4, one_hot(y, out)),
    "softmax_mse": lambda out, y: F.mse_loss(F.softmax(out, dim=-1), one_hot(y, out)),
    "log_softmax_nll": lambda out, y: F.nll_loss(out.log_softmax(-1), y),
    "kl_div": lambda out, y: F.kl_div(F.log_softmax(out, -1), one_hot(y, out), reduction="batchmean"),
    "bce_with_logits": lambda out, y: F.binary_cross_entropy_with_logits(out, one_hot(y, out)),
    "smooth_l1": lambda out, y: F.smooth_l1_loss(out, 3 * one_hot(y, out)),
}


def apex_o1_run(loss_fn) -> tuple[list[float], list[float], list[torch.Tensor]]:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    losses, scales, first = [], [], None
    for step in range(STEPS):
        inputs, targets = data(step)
        loss = loss_fn(model(inputs), targets)
        losses.append(loss.item())
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        if first is None:
            first = [p.detach().clone() for p in model.parameters()]
    return losses, scales, first


def autocast_run(loss_fn) -> tuple[list[float], list[float], list[torch.Tensor]]:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    losses, scales, first = [], [], None
    for step in range(STEPS):
        inputs, targets = data(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(inputs), targets)
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
        if first is None:
            first = [p.detach().clone() for p in model.parameters()]
    return losses, scales, first


@pytest.mark.parametrize("member", list(LOSSES))
def test_apex_o1_trains_as_autocast_and_grad_scaler(member: str) -> None:
    losses, scales, first = apex_o1_run(LOSSES[member])
    reference, reference_scales, reference_first = autocast_run(LOSSES[member])
    # The first step is applied (or skipped) exactly when autocast + GradScaler's is.
    initial = list(make_model().parameters())
    applied = [not torch.equal(a, b) for a, b in zip(first, initial, strict=True)]
    reference_applied = [not torch.equal(a, b) for a, b in zip(reference_first, initial, strict=True)]
    assert applied == reference_applied and all(reference_applied)
    assert scales == reference_scales
    assert losses == pytest.approx(reference, rel=1e-3, abs=1e-4)


def test_the_loss_outside_the_model_is_fp32_and_torch_is_its_own_again_after() -> None:
    originals = (F.cross_entropy, torch.nn.functional.mse_loss, torch.Tensor.log_softmax)
    model = amp.initialize(make_model(), opt_level="O1", verbosity=0)
    out = model(data(0)[0])
    assert out.dtype == torch.float16
    assert F.cross_entropy(out, data(0)[1]).dtype == torch.float32
    assert out.log_softmax(-1).dtype == torch.float16  # not on autocast's CPU lists: as autocast
    with amp.disable_casts():  # Apex's switch for its patches
        assert F.cross_entropy(out, data(0)[1]).dtype == torch.float16
    amp.initialize(make_model(), opt_level="O2", verbosity=0)  # another level: torch's own again
    assert (F.cross_entropy, torch.nn.functional.mse_loss, torch.Tensor.log_softmax) == originals
    assert "log_softmax" not in torch.Tensor.__dict__ or torch.Tensor.log_softmax is originals[2]
    amp.initialize(make_model(), opt_level="O1", verbosity=0)
    assert F.cross_entropy is not originals[0]
    amp.initialize(make_model(), opt_level="O1", enabled=False, verbosity=0)
    assert F.cross_entropy is originals[0]
    amp.initialize(make_model(), opt_level="O1", verbosity=0)
    amp_state._current = None  # amp's state reset: the next call gives torch its functions back
    assert F.cross_entropy(out, data(0)[1]).dtype == torch.float16
    assert F.cross_entropy is originals[0] and not _fp32_functions.patched()


def test_a_registered_half_function_stays_low_outside_the_model() -> None:
    amp.register_half_function(F, "cross_entropy")
    try:
        model = amp.initialize(make_model(), opt_level="O1", verbosity=0)
        out = model(data(0)[0])
        assert F.cross_entropy(out, data(0)[1]).dtype == torch.float16
        assert F.mse_loss(out, one_hot(data(0)[1], out)).dtype == torch.float32
    finally:
        amp.clear_registered_functions()


class WithLoss(nn.Module):
    """Computes its loss inside: the graph's own casts decide there, not the patches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return F.cross_entropy(out, y) + F.mse_loss(out.softmax(-1), F.one_hot(y, CLASSES).float())


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("low_mse", [False, True])
def test_convert_o1_stays_autocast_bit_for_bit_while_apex_o1_is_active(front_end: str, low_mse: bool) -> None:
    """Also with a policy that runs mse_loss low inside the graph: its call gets fp16 inputs there,
    which the patched function passes through as they are."""
    inputs, targets = data(0)
    policy = amp_fx.preset("O1", dtype=torch.float16, device_type="cpu")
    if low_mse:
        policy = policy.set_op("mse_loss", "lower")

    def run() -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        converted = amp_fx.convert(WithLoss(), policy=policy, front_end=front_end)
        loss = converted(inputs, targets)
        loss.backward()
        return (loss.detach(), *(p.grad for p in converted.parameters()))

    alone = run()
    amp.initialize(make_model(), opt_level="O1", verbosity=0)
    assert _fp32_functions.patched()
    beside = run()
    assert all(torch.equal(a, b) for a, b in zip(alone, beside, strict=True))
    if low_mse:
        return
    # The amp model computes as the same model converted at O1.
    torch.manual_seed(0)
    apex_model = amp.initialize(WithLoss(), opt_level="O1", verbosity=0)
    assert torch.equal(apex_model(inputs, targets).detach(), alone[0])
