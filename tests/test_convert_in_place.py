"""``amp_fx.convert(model, ..., in_place=True)``: the model object itself becomes the converted
model (the torch.export front end), computing what the converted copy computes; the Parameter
objects stay, so an optimizer built before keeps training them. Refused where it cannot hold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import CapturedModel


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.norm(x))))


MEMBERS = {
    "block": Block,
    "sequential": lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.BatchNorm1d(8), nn.Linear(8, 2)),
}


LEVELS = [("O1", torch.float16), ("O2", torch.bfloat16), ("O3", torch.float16)]


@pytest.mark.parametrize("member", list(MEMBERS))
@pytest.mark.parametrize("level, dtype", LEVELS)
def test_in_place_is_the_model_itself_and_computes_as_the_copy(member: str, level: str, dtype) -> None:
    torch.manual_seed(0)
    model = MEMBERS[member]()
    inputs = torch.randn(4, 8 if member == "block" else 6)
    reference = amp_fx.convert(copy.deepcopy(model), level, dtype=dtype, front_end="export")
    params = dict(model.named_parameters())
    converted = amp_fx.convert(model, level, dtype=dtype, in_place=True)
    assert converted is model and isinstance(model, CapturedModel)
    assert isinstance(model, type(reference).__mro__[2])  # still of its own class
    assert all(p is params[n] for n, p in model.named_parameters())
    for name, param in reference.named_parameters():
        assert param.dtype == params[name].dtype, name
    assert torch.equal(model(inputs), reference(inputs))


def test_in_place_refusals_leave_the_model_as_it_was() -> None:
    model = Block()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="only the torch.export front end"):
        amp_fx.convert(model, "O2", in_place=True, front_end="fx")
    with pytest.raises(ValueError, match="leaf_modules and concrete_args are torch.fx's"):
        amp_fx.convert(model, "O2", in_place=True, leaf_modules=[nn.Linear])
    with pytest.raises(TypeError, match="in_place must be True or False"):
        amp_fx.convert(model, "O2", in_place="yes")
    gm = amp_fx.convert(model, "O2", front_end="fx")
    with pytest.raises(ValueError, match="already made, with in_place=True"):
        amp_fx.convert(gm, "O2", in_place=True)
    assert type(model) is Block
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    amp_fx.convert(model, "O2", in_place=True)
    with pytest.raises(TypeError, match="already converted"):
        amp_fx.convert(model, "O2", in_place=True)
