"""amp.initialize end to end: checkpoints, resume bit for bit, calling it twice (amp/_initialize.py)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import amp_fx
from amp_fx import amp
from amp_fx.amp._master_weights import amp_optimizer_of

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "fused_adam": lambda params: amp_fx.optim.FusedAdam(params, lr=1e-2),
}


def _o2_with_sgd(model):
    return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)


def _save_and_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _train(model, optimizer, steps, num_losses, make_batch, overflows):
    model.train()
    for step in steps:
        optimizer.zero_grad()
        for loss_id in range(num_losses):
            x, y = make_batch(step * num_losses + loss_id)
            loss = F.cross_entropy(model(x), y)
            if (step, loss_id) in overflows:
                loss = loss * float("inf")
            with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()


def _snapshot(model, optimizer):
    tensors = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    return tensors, masters, amp.state_dict()


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_resume_continues_bit_for_bit(opt_level, num_losses, optimizer_name, tiny_net, make_batch):
    # Overflows where loss scaling is on (O1/O2), so that resumed scalers matter.
    overflows = {(1, 0), (3, num_losses - 1)} if opt_level in ("O1", "O2") else set()

    def fresh():
        model = tiny_net(batch_norm=True)
        optimizer = OPTIMIZERS[optimizer_name](model.parameters())
        return amp.initialize(model, optimizer, opt_level=opt_level, num_losses=num_losses, verbosity=0)

    model, optimizer = fresh()
    _train(model, optimizer, range(6), num_losses, make_batch, overflows)
    uninterrupted = _snapshot(model, optimizer)

    model, optimizer = fresh()
    _train(model, optimizer, range(3), num_losses, make_batch, overflows)
    checkpoint = _save_and_load(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    )
    model, optimizer = fresh()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    _train(model, optimizer, range(3, 6), num_losses, make_batch, overflows)
    resumed = _snapshot(model, optimizer)

    for expected, actual in zip(uninterrupted[:2], resumed[:2], strict=True):
        assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))
    assert uninterrupted[2] == resumed[2]
    if opt_level in ("O1", "O2"):
        assert uninterrupted[2]["loss_scaler0"]["loss_scale"] < 65536.0  # the overflows did happen


def test_o2_checkpoints_are_fp32_and_load_into_the_original_model(tiny_net, make_batch):
    original = tiny_net(batch_norm=True)
    source = tiny_net(batch_norm=True)
    model, optimizer = _o2_with_sgd(source)
    assert model.fc1.weight.dtype == torch.float16
    x, y = make_batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

    state = model.state_dict()
    assert set(state) == set(original.state_dict())
    assert {k: v.dtype for k, v in state.items() if v.is_floating_point()} == {
        k: torch.float32 for k, v in original.state_dict().items() if v.is_floating_point()
    }
    masters = list(amp.master_params(optimizer))
    assert torch.equal(state["fc1.weight"], masters[0])  # the exact FP32 training state
    original.load_state_dict(state)
    torch.testing.assert_close(original.eval()(x), model.eval()(x), **_fp16_tolerance())


def _fp16_tolerance():
    rtol, atol = amp_fx.testing.tolerances(torch.float16)
    return {"rtol": rtol, "atol": atol}


def test_fp32_checkpoints_load_into_the_o2_model_and_its_masters(tiny_net):
    source = tiny_net()
    model, optimizer = _o2_with_sgd(source)
    checkpoint = {k: v + 1e-4 for k, v in tiny_net(seed=7).state_dict().items()}
    model.load_state_dict(checkpoint)
    assert torch.equal(model.fc1.weight, checkpoint["fc1.weight"].half())
    assert torch.equal(next(iter(amp.master_params(optimizer))), checkpoint["fc1.weight"])
    assert torch.equal(model.state_dict()["fc2.bias"], checkpoint["fc2.bias"])


def test_initialize_twice_keeps_each_calls_scalers(tiny_net, make_batch):
    def run_a(with_b_in_between):
        source = tiny_net(1)
        model, optimizer = _o2_with_sgd(source)
        if with_b_in_between:
            other = tiny_net(2)
            amp.initialize(
                other, torch.optim.Adam(other.parameters()), opt_level="O1", num_losses=2, verbosity=0
            )
        for step in range(3):
            optimizer.zero_grad()
            x, y = make_batch(step)
            loss = F.cross_entropy(model(x), y) * (float("inf") if step == 1 else 1.0)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        return model, optimizer

    alone, alone_optimizer = run_a(False)
    model, optimizer = run_a(True)
    assert all(torch.equal(a, b) for a, b in zip(alone.parameters(), model.parameters(), strict=True))
    assert amp_optimizer_of(optimizer).session.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0
    # amp.state_dict() describes the latest call: the second model's two untouched scalers.
    assert amp.state_dict() == {f"loss_scaler{i}": {"loss_scale": 65536.0, "unskipped": 0} for i in (0, 1)}
    with pytest.raises(amp.AmpConfigError, match="already returned by amp.initialize"):
        amp.initialize(tiny_net(), optimizer, verbosity=0)


def test_converted_model_keeps_working_as_a_module(tiny_net, make_batch):
    source = tiny_net(batch_norm=True)
    model = amp.initialize(source, opt_level="O2", verbosity=0)
    assert isinstance(model, torch.fx.GraphModule)
    model.eval()
    assert not model.bn.training
    x, _ = make_batch(0)
    assert model(x).dtype == torch.float32
    assert len(list(model.parameters())) == len(list(source.parameters()))
    assert source.fc1.weight.dtype == torch.float32  # the model passed in is left as it was


class _WithASpareHead(torch.nn.Module):
    """A classifier whose forward does not call ``spare_head`` (the training loop calls it itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(10, 4)
        self.spare_head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_submodule_the_forward_skips_stays_in_the_model_and_trains(make_batch):
    torch.manual_seed(0)
    original = _WithASpareHead()
    model, optimizer = _o2_with_sgd(_WithASpareHead())
    # As with Apex, the returned model's checkpoint has every key of the original's.
    original.load_state_dict(_save_and_load(model.state_dict()))
    # The optimizer steps the returned model's spare head, not the original's.
    before = model.spare_head.weight.detach().clone()
    x, y = make_batch(0)
    logits = model.spare_head(model(x).half()).float()
    with amp.scale_loss(F.cross_entropy(logits, y), optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert model.spare_head.weight.dtype == torch.float16
    assert not torch.equal(model.spare_head.weight, before)
