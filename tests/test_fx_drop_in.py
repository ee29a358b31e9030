"""A model converted by the torch.fx front end behaves like the original: it follows ``.train()`` /
``.eval()`` (also where its forward reads ``self.training``), calls with the original's signature,
captures untraceable children with torch.export, and bad models are refused before any change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_fx

BF16 = torch.bfloat16


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() if not v.is_meta else v for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------
# Models convert cannot take are refused before any change
# ------------------------------------------------------------------------------------------
def test_meta_model_is_refused_with_how_to_materialise_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to("meta")
    hooks = dict(model._load_state_dict_pre_hooks)
    with pytest.raises(ValueError, match=r"meta device.*hold no values.*to_empty.*load_state_dict"):
        amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    assert all(p.is_meta and p.dtype == torch.float32 for p in model.parameters())
    assert type(model) is nn.Sequential and dict(model._load_state_dict_pre_hooks) == hooks


def test_script_module_is_refused_with_the_original_module_as_the_fix():
    original = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    scripted = torch.jit.script(original)
    before = _state(scripted)
    with pytest.raises(TypeError, match=r"TorchScript modules cannot be converted.*original nn.Module"):
        amp_fx.convert(scripted, "O2", dtype=BF16, device_type="cpu")
    after = scripted.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32 for k in before)
    x = torch.randn(2, 4)
    assert torch.equal(scripted(x), original(x))
