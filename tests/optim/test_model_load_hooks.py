"""Loads into a model reach the FP32 masters of the fused optimizers that hold its parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.optim import FusedAdam, FusedSGD, master_params


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _checkpoint(model: nn.Module, value: float) -> dict[str, torch.Tensor]:
    """An FP32 checkpoint of ``model``'s keys, every entry ``value`` (0.1 has no exact fp16 value)."""
    return {k: torch.full(v.shape, value, dtype=torch.float32) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("make_optimizer", [FusedAdam, FusedSGD])
def test_a_load_after_the_optimizer_takes_effect_at_full_precision(front_end, make_optimizer) -> None:
    torch.manual_seed(0)
    gm = amp_fx.convert(TwoLayers(), "O2", front_end=front_end, example_inputs=(torch.randn(2, 4),))
    optimizer = make_optimizer(gm.parameters(), lr=0.0)
    checkpoint = _checkpoint(gm, 0.1)
    gm.load_state_dict(checkpoint)
    for param in gm.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()  # lr=0: the step must write back what was loaded, not the old masters
    for (name, param), master in zip(gm.named_parameters(), master_params(optimizer), strict=True):
        assert torch.equal(master, checkpoint[name]), name  # the checkpoint's FP32 values, not fp16-rounded
        assert torch.equal(param, checkpoint[name].to(param.dtype)), name


def test_a_refused_strict_load_changes_neither_model_nor_masters() -> None:
    torch.manual_seed(1)
    gm = amp_fx.convert(TwoLayers(), "O2")
    optimizer = FusedAdam(gm.parameters(), lr=1e-3)
    before_params = {k: v.clone() for k, v in gm.state_dict().items()}
    before_masters = [m.clone() for m in master_params(optimizer)]
    checkpoint = _checkpoint(gm, 0.5)
    del checkpoint["fc2.bias"]
    with pytest.raises(RuntimeError, match="Missing key\\(s\\) in state_dict: 'fc2.bias'"):
        gm.load_state_dict(checkpoint)
    assert all(torch.equal(v, before_params[k]) for k, v in gm.state_dict().items())
    assert all(torch.equal(m, b) for m, b in zip(master_params(optimizer), before_masters, strict=True))


def test_a_non_strict_load_updates_the_masters_of_what_it_loads() -> None:
    torch.manual_seed(2)
    gm = amp_fx.convert(TwoLayers(), "O2")
    optimizer = FusedSGD(gm.parameters(), lr=0.0)
    old_bias_master = optimizer.state[gm.fc2.bias]["master_param"].clone()
    checkpoint = _checkpoint(gm, 0.1)
    del checkpoint["fc2.bias"]
    gm.load_state_dict(checkpoint, strict=False)
    assert torch.equal(optimizer.state[gm.fc1.weight]["master_param"], checkpoint["fc1.weight"])
    assert torch.equal(optimizer.state[gm.fc2.bias]["master_param"], old_bias_master)
