"""amp.state_dict / load_state_dict in Apex's format, and the per-loss scaler (amp/_state.py, _scaler.py)."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch
import torch.nn.functional as F

from amp_fx import amp
from amp_fx.amp._scaler import ApexLossScaler


def _o2(tiny_net, num_losses=1):
    model = tiny_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, optimizer, opt_level="O2", num_losses=num_losses, verbosity=0)


def test_state_dict_is_apexs_format(tiny_net):
    _o2(tiny_net, num_losses=2)
    state = amp.state_dict()
    assert state == {f"loss_scaler{i}": {"loss_scale": 65536.0, "unskipped": 0} for i in (0, 1)}
    assert list(state) == ["loss_scaler0", "loss_scaler1"]
    assert json.loads(json.dumps(state)) == state  # plain Python numbers
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state
    destination = {"epoch": 3}
    assert amp.state_dict(destination) is destination and destination["loss_scaler1"]["unskipped"] == 0


def test_an_apex_checkpoint_sets_scale_and_count(tiny_net, make_batch):
    model, optimizer = _o2(tiny_net)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5}})
    x, y = make_batch(0)
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        assert torch.equal(scaled_loss, loss.float() * 1024.0)
        scaled_loss.backward()
    optimizer.step()
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 6}}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}, "optimizer": {}}, "unexpected key"),
        ({"loss_scaler0": {"loss_scale": -8.0, "unskipped": 0}}, "loss_scale"),
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0.5}}, "unskipped"),
        ({"loss_scaler0": {"loss_scale": 8.0}}, "unskipped"),
        ({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}, "loss_scaler1": 3}, "loss_scaler1"),
    ],
)
def test_a_refused_amp_state_dict_changes_nothing(bad, message, tiny_net):
    _o2(tiny_net, num_losses=2)
    with pytest.raises(ValueError, match=message):
        amp.load_state_dict(bad)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}


def test_a_different_number_of_scalers_loads_what_fits(tiny_net, caplog):
    caplog.set_level(logging.WARNING, logger="amp_fx.amp")
    _o2(tiny_net, num_losses=2)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1}})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 8.0, "unskipped": 1}
    assert amp.state_dict()["loss_scaler1"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert "1 loss scaler(s) but num_losses=2" in caplog.text


def test_amp_state_needs_initialize():
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.state_dict()
    with pytest.raises(RuntimeError, match="amp.initialize"):
        amp.load_state_dict({})


def test_scaler_follows_apexs_rule():
    """Halve on overflow (not below the floor), double after 2000 clean updates (not above the cap)."""
    scaler = ApexLossScaler(0, "dynamic", min_loss_scale=4.0, max_loss_scale=2.0**17)
    scaler.scale_loss(torch.tensor(1.0))
    expected, unskipped = 2.0**16, 0
    pattern = [1] * 20 + [0] * 2000 + [0] * 2000 + [0] * 10
    for overflow in pattern:
        scaler.update(torch.tensor([float(overflow)]))
        if overflow:
            expected, unskipped = max(4.0, expected / 2), 0
        else:
            unskipped += 1
            if unskipped == 2000:
                expected, unskipped = min(2.0**17, expected * 2), 0
    assert (scaler.loss_scale(), scaler.unskipped()) == (expected, unskipped) == (16.0, 10)
