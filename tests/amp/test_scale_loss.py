"""amp.scale_loss: one and two losses, overflow in either, each optimizer kind (amp_fx/amp/_scale_loss.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import amp_fx
from amp_fx import amp
from amp_fx.amp._master_weights import OptimizerKind, amp_optimizer_of

LR = 0.1
# Loss 0 and loss 1 get different scales, small enough that the fp16 grads of these models never
# overflow by themselves (at O1 the default 2**16 does overflow: the scaler's first back-off).
SCALES = (4096.0, 256.0)
OVERFLOW_MESSAGE = "Gradient overflow.  Skipping step, loss scaler {} reducing loss scale to {}"

KINDS = {
    # kind: (opt level, optimizer factory)
    OptimizerKind.MASTERS: ("O2", lambda params: torch.optim.SGD(params, lr=LR)),
    OptimizerKind.FUSED: ("O2", lambda params: amp_fx.optim.FusedSGD(params, lr=LR)),
    OptimizerKind.DIRECT: ("O1", lambda params: torch.optim.SGD(params, lr=LR)),
}


def _setup(tiny_net, kind, num_losses=2, verbosity=1, scales=SCALES, **kwargs):
    opt_level, make_optimizer = KINDS[kind]
    model = tiny_net()
    optimizer = make_optimizer(model.parameters())
    options = dict(opt_level=opt_level, num_losses=num_losses, verbosity=verbosity, **kwargs)
    model, optimizer = amp.initialize(model, optimizer, **options)
    assert amp_optimizer_of(optimizer).kind is kind
    if scales:
        amp.load_state_dict(
            {f"loss_scaler{i}": {"loss_scale": scales[i], "unskipped": 0} for i in range(num_losses)}
        )
    return model, optimizer


def _updated_tensors(optimizer):
    """What the optimizer updates in FP32: masters (or the FP32 params themselves), as copies."""
    if amp_optimizer_of(optimizer).kind is OptimizerKind.FUSED:
        return [m.detach().clone() for m in amp_fx.optim.master_params(optimizer)]
    return [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]


def _scaled_grads(model, batch, scale):
    """The grads one backward of `batch`'s loss at `scale` gives (the converted model's dtypes)."""
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    return torch.autograd.grad(loss.float() * scale, list(model.parameters()))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "amp_fx.amp" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.value)
@pytest.mark.parametrize("overflow_in", [None, 0, 1])
def test_two_losses_with_different_scales(kind, overflow_in, tiny_net, make_batch, caplog):
    caplog.set_level(logging.INFO, logger="amp_fx.amp")
    model, optimizer = _setup(tiny_net, kind)
    batches = [make_batch(0), make_batch(1)]
    expected_grads = [
        sum(g.float() / s for g, s in zip(grads, SCALES, strict=True))
        for grads in zip(
            *(_scaled_grads(model, b, s) for b, s in zip(batches, SCALES, strict=True)), strict=True
        )
    ]
    before = _updated_tensors(optimizer)
    model_before = [p.detach().clone() for p in model.parameters()]

    optimizer.zero_grad()
    for loss_id, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        if loss_id == overflow_in:
            loss = loss * float("inf")
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
            scaled_loss.backward()
        if loss_id == 0 and overflow_in == 0:
            assert not _warnings(caplog)  # logged lazily: not at the end of the backward
    if overflow_in is None and kind is not OptimizerKind.FUSED:
        # Each loss's scale was removed exactly before the grads were added (FP32 master grads).
        grads = [t.grad for t in amp.master_params(optimizer)]
        assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    optimizer.step()
    after = _updated_tensors(optimizer)

    state = amp.state_dict()
    if overflow_in is None:
        expected = [b - LR * g for b, g in zip(before, expected_grads, strict=True)]
        # The fused optimizer adds the two losses' grads in fp16 at the smaller scale.
        rtol, atol = (2e-3, 1e-6) if kind is OptimizerKind.FUSED else (1e-6, 1e-7)
        for actual, wanted, old in zip(after, expected, before, strict=True):
            torch.testing.assert_close(actual - old, wanted - old, rtol=rtol, atol=atol)
        assert [state[f"loss_scaler{i}"] for i in (0, 1)] == [
            {"loss_scale": s, "unskipped": 1} for s in SCALES
        ]
        assert not _warnings(caplog)
    else:
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_before, strict=True))
        other = 1 - overflow_in
        assert state[f"loss_scaler{overflow_in}"] == {"loss_scale": SCALES[overflow_in] / 2, "unskipped": 0}
        assert state[f"loss_scaler{other}"] == {"loss_scale": SCALES[other], "unskipped": 1}
        assert _warnings(caplog) == [OVERFLOW_MESSAGE.format(overflow_in, SCALES[overflow_in] / 2)]
    if kind is not OptimizerKind.DIRECT:
        # The model holds the masters rounded to its dtype.
        masters = _updated_tensors(optimizer)
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), masters, strict=True))


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.value)
def test_one_loss_overflow_skips_the_step_and_logs_apexs_message(kind, tiny_net, make_batch, caplog):
    caplog.set_level(logging.INFO, logger="amp_fx.amp")
    model, optimizer = _setup(tiny_net, kind, num_losses=1)
    for step in range(3):
        optimizer.zero_grad()
        x, y = make_batch(step)
        loss = F.cross_entropy(model(x), y) * (float("nan") if step == 1 else 1.0)
        before = _updated_tensors(optimizer)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        after = _updated_tensors(optimizer)
        changed = any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert changed == (step != 1)
    assert _warnings(caplog) == [OVERFLOW_MESSAGE.format(0, SCALES[0] / 2)]
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": SCALES[0] / 2, "unskipped": 1}


def test_the_overflow_message_waits_for_the_next_amp_call(tiny_net, make_batch, caplog):
    caplog.set_level(logging.INFO, logger="amp_fx.amp")
    model, optimizer = _setup(tiny_net, OptimizerKind.FUSED, num_losses=1)
    x, y = make_batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y) * float("inf"), optimizer) as scaled_loss:
        scaled_loss.backward()
    assert not _warnings(caplog)
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
        assert _warnings(caplog) == [OVERFLOW_MESSAGE.format(0, SCALES[0] / 2)]
        scaled_loss.backward()


def test_fused_iteration_never_reads_a_value_on_the_host(tiny_net, make_batch, monkeypatch):
    model, optimizer = _setup(tiny_net, OptimizerKind.FUSED, num_losses=1, verbosity=0)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read (.item()) in the training step")

    x, y = make_batch(0)
    loss = F.cross_entropy(model(x), y) * float("inf")
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_static_loss_scale_skips_overflowing_steps_and_keeps_its_scale(tiny_net, make_batch, caplog):
    caplog.set_level(logging.INFO, logger="amp_fx.amp")
    model, optimizer = _setup(tiny_net, OptimizerKind.MASTERS, num_losses=1, scales=None, loss_scale=128.0)
    before = _updated_tensors(optimizer)
    x, y = make_batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y) * float("inf"), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(_updated_tensors(optimizer), before, strict=True))
    assert _warnings(caplog) == [
        "Gradient overflow.  Skipping step, loss scaler 0 keeping its static loss scale 128.0"
    ]
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.value)
def test_step_inside_the_block_equals_step_after_it(kind, tiny_net, make_batch):
    results = []
    for inside in (False, True):
        model, optimizer = _setup(tiny_net, kind, num_losses=1, verbosity=0)
        for step in range(2):
            optimizer.zero_grad()
            x, y = make_batch(step)
            with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
                scaled_loss.backward()
                if inside:  # the first seed's program does this
                    optimizer.step()
            if not inside:
                optimizer.step()
        results.append(_updated_tensors(optimizer))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.value)
def test_delay_unscale_accumulates_at_one_scale(kind, tiny_net, make_batch):
    model, optimizer = _setup(tiny_net, kind, num_losses=1, verbosity=0)
    (x0, y0), (x1, y1) = make_batch(0), make_batch(1)
    with amp.scale_loss(F.cross_entropy(model(x0), y0), optimizer, delay_unscale=True) as scaled_loss:
        scaled_loss.backward()
    with pytest.raises(RuntimeError, match="delay_unscale"):
        optimizer.step()
    with amp.scale_loss(F.cross_entropy(model(x1), y1), optimizer) as scaled_loss:
        scaled_loss.backward()
    if kind is OptimizerKind.MASTERS:
        g0, g1 = _scaled_grads(model, (x0, y0), SCALES[0]), _scaled_grads(model, (x1, y1), SCALES[0])
        expected = [(a + b).float() / SCALES[0] for a, b in zip(g0, g1, strict=True)]
        grads = [t.grad for t in amp.master_params(optimizer)]
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    before = _updated_tensors(optimizer)
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(_updated_tensors(optimizer), before, strict=True))


def test_several_models_and_optimizers(tiny_net, make_batch):
    model_a, model_b = tiny_net(1), tiny_net(2)
    sgd = torch.optim.SGD(model_a.parameters(), lr=LR)
    adam = torch.optim.Adam(model_b.parameters(), lr=1e-3)
    [model_a, model_b], [sgd, adam] = amp.initialize(
        [model_a, model_b], [sgd, adam], opt_level="O2", verbosity=0
    )
    reference_a = [t.detach().clone().requires_grad_() for t in _updated_tensors(sgd)]
    reference_b = [t.detach().clone().requires_grad_() for t in _updated_tensors(adam)]
    reference_sgd, reference_adam = (
        torch.optim.SGD(reference_a, lr=LR),
        torch.optim.Adam(reference_b, lr=1e-3),
    )
    for step in range(3):
        x, y = make_batch(step)
        params = [*model_a.parameters(), *model_b.parameters()]
        grads = torch.autograd.grad(F.cross_entropy(model_a(x) + model_b(x), y).float() * 65536.0, params)
        for ref, grad in zip([*reference_a, *reference_b], grads, strict=True):
            ref.grad = grad.float() / 65536.0
        reference_sgd.step()
        reference_adam.step()

        sgd.zero_grad()
        adam.zero_grad()
        with amp.scale_loss(F.cross_entropy(model_a(x) + model_b(x), y), [sgd, adam]) as scaled_loss:
            scaled_loss.backward()
        sgd.step()
        adam.step()
    actual_tensors = [*_updated_tensors(sgd), *_updated_tensors(adam)]
    for actual, expected in zip(actual_tensors, [*reference_a, *reference_b], strict=True):
        torch.testing.assert_close(actual, expected.detach(), rtol=1e-6, atol=1e-7)


def test_clipping_master_params_as_in_apex(tiny_net, make_batch):
    updates = []
    for kind in (OptimizerKind.MASTERS, OptimizerKind.FUSED):
        model, optimizer = _setup(tiny_net, kind, num_losses=1, verbosity=0, scales=(256.0,))
        before = _updated_tensors(optimizer)
        x, y = make_batch(0)
        with amp.scale_loss(F.cross_entropy(model(x), y) * 10.0, optimizer) as scaled_loss:
            scaled_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=0.5)
        assert norm > 0.5  # the unscaled grads' norm, not the scaled one's
        assert norm < 1e3
        optimizer.step()
        updates.append([(a - b) for a, b in zip(_updated_tensors(optimizer), before, strict=True)])
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(u) for u in updates[-1]]))
        torch.testing.assert_close(total, torch.tensor(LR * 0.5), rtol=2e-3, atol=0)
    for a, b in zip(*updates, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-7)


def test_scale_loss_refuses_optimizers_amp_did_not_prepare(tiny_net, make_batch):
    model, optimizer = _setup(tiny_net, OptimizerKind.MASTERS, num_losses=1, verbosity=0)
    stranger = torch.optim.SGD(tiny_net().parameters(), lr=LR)
    loss = F.cross_entropy(model(make_batch(0)[0]), make_batch(0)[1])
    with pytest.raises(RuntimeError, match="amp.initialize"):
        with amp.scale_loss(loss, stranger):
            pass
    with pytest.raises(TypeError, match="optimizer"):
        with amp.scale_loss(loss, "sgd"):
            pass
