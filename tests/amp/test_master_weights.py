"""FP32 master weights for any torch.optim optimizer (amp_fx/amp/_master_weights.py)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx import amp
from amp_fx.amp._master_weights import (
    MASTERS_KEY,
    STRATEGIES,
    OptimizerKind,
    amp_optimizer_of,
    install_amp_optimizer,
)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_any_optimizer_steps_on_fp32_masters(name, tiny_net, make_batch):
    """The masters follow the same torch optimizer run in FP32 on the unscaled fp16 grads."""
    model = tiny_net()
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    reference_optimizer = OPTIMIZERS[name](reference)
    model, optimizer = amp.initialize(
        model, OPTIMIZERS[name](model.parameters()), opt_level="O2", verbosity=0
    )
    assert amp_optimizer_of(optimizer).kind is OptimizerKind.MASTERS and isinstance(
        optimizer, type(reference_optimizer)
    )
    masters = list(amp.master_params(optimizer))
    assert [m.dtype for m in masters] == [torch.float32] * 4
    assert all(torch.equal(m, r) for m, r in zip(masters, reference, strict=True))  # exact FP32 originals

    for step in range(4):
        x, y = make_batch(step)
        grads = torch.autograd.grad(F.cross_entropy(model(x), y).float() * 65536.0, list(model.parameters()))
        for r, g in zip(reference, grads, strict=True):
            r.grad = g.float() / 65536.0
        reference_optimizer.step()

        optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        for p, m, r in zip(model.parameters(), amp.master_params(optimizer), reference, strict=True):
            torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(p, m.half())


def test_optimizer_stays_usable_with_an_lr_scheduler(tiny_net, make_batch):
    model = tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(2):
        x, y = make_batch(step)
        optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.25
    assert optimizer._opt_called  # the scheduler saw the patched step


@pytest.mark.parametrize(
    "opt_level, make", [("O2", OPTIMIZERS["sgd"]), ("O2", amp_fx.optim.FusedAdam), ("O1", OPTIMIZERS["adam"])]
)
def test_add_param_group_after_initialize(opt_level, make, make_batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 2))
    optimizer = make(model[0].parameters())
    gm, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 0}})  # no fp16 overflow at O1
    optimizer.add_param_group({"params": model[2].parameters(), "lr": 0.05})  # the original model's params
    assert optimizer.param_groups[1]["lr"] == 0.05
    masters = list(amp.master_params(optimizer))
    assert [m.dtype for m in masters] == [torch.float32] * 4
    assert torch.equal(masters[2], model[2].weight)  # the new masters start from the FP32 originals
    before = [m.clone() for m in masters]
    x, y = make_batch(0)
    optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(gm(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    after = list(amp.master_params(optimizer))
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(gm.parameters(), after, strict=True))


def test_state_dict_carries_the_masters_and_loads_with_weights_only(tiny_net, make_batch):
    model = tiny_net()
    model, optimizer = amp.initialize(
        model, OPTIMIZERS["adam"](model.parameters()), opt_level="O2", verbosity=0
    )
    x, y = make_batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert [m.dtype for m in saved[MASTERS_KEY]] == [torch.float32] * 4
    masters = [m.clone() for m in amp.master_params(optimizer)]
    with torch.no_grad():
        for m in amp.master_params(optimizer):
            m.zero_()
    optimizer.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(optimizer), masters, strict=True))


def test_a_refused_optimizer_state_dict_changes_nothing(tiny_net, make_batch):
    model = tiny_net()
    model, optimizer = amp.initialize(
        model, OPTIMIZERS["sgd"](model.parameters()), opt_level="O2", verbosity=0
    )
    x, y = make_batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    good = optimizer.state_dict()
    bad = {**good, MASTERS_KEY: [torch.zeros(3)] * 4}
    masters = [m.clone() for m in amp.master_params(optimizer)]
    momentum = [optimizer.state[m]["momentum_buffer"].clone() for m in amp.master_params(optimizer)]
    with pytest.raises(ValueError, match="master weight 0"):
        optimizer.load_state_dict(bad)
    with pytest.raises(ValueError, match="entries"):
        optimizer.load_state_dict({**good, MASTERS_KEY: []})
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(optimizer), masters, strict=True))
    states = [optimizer.state[m]["momentum_buffer"] for m in amp.master_params(optimizer)]
    assert all(torch.equal(a, b) for a, b in zip(states, momentum, strict=True))


def test_zero_grad_clears_model_and_master_grads(tiny_net, make_batch):
    model = tiny_net()
    model, optimizer = amp.initialize(
        model, OPTIMIZERS["sgd"](model.parameters()), opt_level="O2", verbosity=0
    )
    x, y = make_batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    assert all(m.grad is not None for m in amp.master_params(optimizer))
    optimizer.zero_grad()
    assert all(m.grad is None for m in amp.master_params(optimizer))
    assert all(p.grad is None for p in model.parameters())


def test_existing_optimizer_state_moves_to_the_masters(tiny_net, make_batch):
    model = tiny_net()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    x, y = make_batch(0)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # momentum buffers exist before amp.initialize
    buffers = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    gm, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    moved = [optimizer.state[m]["momentum_buffer"] for m in amp.master_params(optimizer)]
    assert all(torch.equal(a, b) for a, b in zip(moved, buffers, strict=True))
    assert not any(p in optimizer.state for p in model.parameters())


def test_a_refused_optimizer_load_leaves_it_exactly_as_it_was(tiny_net, make_batch):
    opt_level = "O2"  # torch's AdamW on the masters: it raises after replacing its groups and state
    model = tiny_net(seed=11)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gm, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    inputs, target = make_batch(0)
    with amp.scale_loss(F.cross_entropy(gm(inputs).float(), target), optimizer) as loss:
        loss.backward()
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict())
    foreign = amp_fx.optim.FusedAdam(
        [torch.nn.Parameter(p.detach().clone()) for p in gm.parameters()], lr=0.5
    )
    with pytest.raises(KeyError, match="step"):
        optimizer.load_state_dict(foreign.state_dict())
    after = optimizer.state_dict()
    assert optimizer.param_groups[0]["lr"] == 1e-3
    assert before["param_groups"] == after["param_groups"]
    assert before["state"].keys() == after["state"].keys()
    for key, entry in before["state"].items():
        assert all(torch.equal(v, after["state"][key][k]) for k, v in entry.items())


def test_every_kind_has_one_strategy_and_install_picks_it():
    assert set(STRATEGIES) == set(OptimizerKind)
    for kind, strategy in STRATEGIES.items():
        model = torch.nn.Linear(2, 2).half()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if kind is OptimizerKind.FUSED:
            continue  # needs amp_fx's fused optimizer, installed through amp.initialize elsewhere
        amp_optimizer = install_amp_optimizer(optimizer, kind)
        assert type(amp_optimizer) is strategy and amp_optimizer_of(optimizer) is amp_optimizer
