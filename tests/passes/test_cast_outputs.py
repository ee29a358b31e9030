"""Tests for `amp_fx.passes.cast_outputs`: returned values cast per ``cast_model_outputs``."""

from __future__ import annotations

from collections import namedtuple

import torch
import torch.fx
from torch import nn

from amp_fx.capture.fx import trace
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import preset
from amp_fx.ops.casts import cast_if_floating
from amp_fx.passes.cast_outputs import cast_outputs
from amp_fx.passes.cast_parameters import cast_parameters
from amp_fx.passes.classify import classify
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.propagate_dtypes import propagate_dtypes
from amp_fx.passes.shared.casts import is_output_structure
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.decisions import plan_parameters

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

Outputs = namedtuple("Outputs", ["logits", "aux"])


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.attn = nn.MultiheadAttention(4, 1, batch_first=True)

    def forward(self, x):
        logits = self.fc(x)
        attended = self.attn(x, x, x)[0]
        return Outputs(logits, {"pred": logits.argmax(-1), "features": [attended, x.shape[0]]})


def _converted(model: nn.Module, policy) -> torch.fx.GraphModule:
    gm = normalize_ops(trace(model)).graph_module
    gm = classify(gm, Conversion(policy)).graph_module
    context = plan_parameters(gm, Conversion(policy))
    for step in (propagate_dtypes, insert_casts, cast_parameters, cast_outputs):
        step(gm, context)
    gm.graph.lint()
    gm.recompile()
    return gm


def _output_casts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    readers = [n for n in gm.graph.nodes if n.op == "output" or is_output_structure(n)]
    return [n for reader in readers for n in reader.all_input_nodes if node_info(n).is_cast]


def test_o2_outputs_come_back_float32_through_nested_structures():
    gm = _converted(Heads(), preset("O2", F16, "cpu"))
    out = gm(torch.randn(2, 5, 4))
    assert isinstance(out, Outputs)
    assert out.logits.dtype == F32
    assert out.aux["pred"].dtype == torch.int64  # never cast
    assert out.aux["features"][0].dtype == F32
    assert out.aux["features"][1] == 2
    casts = _output_casts(gm)
    assert {n.name for n in casts} == {"fc_to_float32", "getitem_to_float32"}
    assert (
        next(n for n in casts if n.name == "getitem_to_float32").target is cast_if_floating
    )  # opaque: unknown
    assert all("cast_model_outputs" in node_info(n).cast_reason for n in casts)


def test_outputs_as_computed_when_cast_model_outputs_is_none():
    gm = _converted(Heads(), preset("O1", BF16, "cpu"))
    assert _output_casts(gm) == []
    assert gm(torch.randn(2, 5, 4)).logits.dtype == BF16


def test_cast_model_outputs_override_at_o1():
    gm = _converted(Heads(), preset("O1", BF16, "cpu", cast_model_outputs=F32))
    out = gm(torch.randn(2, 5, 4))
    assert out.logits.dtype == F32 and out.aux["features"][0].dtype == F32


def test_o2_returning_a_model_input_keeps_it_exact():
    class Passthrough(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x), x

    gm = _converted(Passthrough(), preset("O2", BF16, "cpu"))
    x = torch.randn(2, 4)
    out, same = gm(x)
    assert out.dtype == F32
    assert same is x  # seen float32 by the output, as it came in: no lossy round trip


class LossAndLogits(nn.Module):
    """A Hugging Face causal LM's tail: the loss on ``logits.float()``, the logits returned."""

    def __init__(self, update_copy: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(4, 6)
        self.update_copy = update_copy

    def forward(self, x, labels):
        logits = self.head(x)
        wide = logits.float()
        if self.update_copy:
            wide.mul_(2)
        return torch.nn.functional.cross_entropy(wide, labels), logits


def test_o2_returns_the_models_own_float32_copy_instead_of_a_second_one():
    gm = _converted(LossAndLogits(), preset("O2", BF16, "cpu"))
    x, labels = torch.randn(3, 4), torch.tensor([0, 5, 2])
    loss, logits = gm(x, labels)
    (returned,) = [
        n for n in gm.graph.find_nodes(op="output")[0].all_input_nodes if n.name != "cross_entropy"
    ]
    assert returned.op == "call_method" and returned.target == "float"  # the model's copy
    assert not _output_casts(gm)
    assert logits.dtype == F32
    head = gm.head
    expected = torch.nn.functional.linear(x.to(BF16), head.weight.to(BF16), head.bias.to(BF16)).float()
    assert torch.equal(logits, expected)


def test_o2_copies_again_when_the_models_copy_is_updated_in_place():
    gm = _converted(LossAndLogits(update_copy=True), preset("O2", BF16, "cpu"))
    x, labels = torch.randn(3, 4), torch.tensor([0, 5, 2])
    _, logits = gm(x, labels)
    assert [n.name for n in _output_casts(gm)] == ["head_to_float32"]
    head = gm.head
    expected = torch.nn.functional.linear(x.to(BF16), head.weight.to(BF16), head.bias.to(BF16)).float()
    assert torch.equal(logits, expected)  # not the doubled copy
