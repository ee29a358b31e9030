"""register_half_function / register_float_function / register_promote_function (amp_fx/amp/_registry.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_fx import amp
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.a)
        return torch.add(F.softmax(y, dim=-1), x)


def _rules(model: torch.fx.GraphModule) -> dict[str, Rule]:
    rules = {}
    for node in model.graph.nodes:
        info = node.meta.get("amp_fx")
        if info is not None and info.op in ("matmul", "softmax", "add") and not info.is_cast:
            rules[info.op] = node_info(node).rule
    return rules


def test_registered_functions_change_the_rule_of_later_conversions():
    before = _rules(amp.initialize(Mixer(), opt_level="O2", verbosity=0))
    assert before == {"matmul": Rule.LOWER, "softmax": Rule.FP32, "add": Rule.PASSTHROUGH}
    amp.register_float_function(torch, "matmul")
    amp.register_half_function(F, "softmax")
    amp.register_promote_function(torch, "add")
    model = amp.initialize(Mixer(), opt_level="O2", verbosity=0)
    assert _rules(model) == {"matmul": Rule.FP32, "softmax": Rule.LOWER, "add": Rule.PROMOTE}
    assert model(torch.randn(2, 4)).dtype == torch.float32


def test_o1_follows_the_registry_and_o0_ignores_it():
    amp.register_float_function(torch, "matmul")
    assert _rules(amp.initialize(Mixer(), opt_level="O1", verbosity=0))["matmul"] is Rule.FP32
    assert _rules(amp.initialize(Mixer(), opt_level="O0", verbosity=0))["matmul"] is Rule.PASSTHROUGH


def test_a_later_registration_of_the_same_function_wins():
    amp.register_half_function(torch, "matmul")
    amp.register_float_function(torch, "matmul")
    assert amp.registered_functions() == {"matmul": Rule.FP32}


def test_unknown_functions_are_refused():
    with pytest.raises(ValueError, match="No function named no_such_fn"):
        amp.register_half_function(torch, "no_such_fn")
    with pytest.raises(TypeError, match="str"):
        amp.register_float_function(torch, 3)
    assert amp.registered_functions() == {}
