"""Tests for `amp_fx.passes.classify`: every call node gets the policy's rule and reason."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.capture.fx import trace
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule, preset
from amp_fx.passes.classify import classify
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.shared.call_nodes import calling_module, is_inplace_call
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.decisions import decide_node


def _classified(model: nn.Module, policy) -> torch.fx.GraphModule:
    return classify(normalize_ops(trace(model)).graph_module, Conversion(policy)).graph_module


def _rules(gm: torch.fx.GraphModule) -> dict[str, Rule | None]:
    return {n.name: node_info(n).rule for n in gm.graph.nodes}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = self.norm(self.fc(x))
        return torch.softmax(h, -1).exp_()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        h = self.block(x)
        return self.attn(h, h, h)[0] + 1


def test_o1_cpu_rules_follow_autocast_lists():
    gm = _classified(Net(), preset("O1", torch.bfloat16, "cpu"))
    rules = _rules(gm)
    assert rules["block_fc"] is Rule.LOWER
    assert rules["block_norm"] is Rule.PASSTHROUGH  # layer_norm is on no CPU list
    assert rules["softmax"] is Rule.PASSTHROUGH
    assert rules["attn"] is Rule.OPAQUE
    assert rules["add"] is Rule.PASSTHROUGH
    assert rules["x"] is None and rules["output"] is None
    assert "lower_precision_fp" in node_info(next(n for n in gm.graph.nodes if n.name == "block_fc")).reason


def test_o1_cuda_and_o2_rules_differ_from_cpu():
    cuda = _rules(_classified(Net(), preset("O1", torch.float16, "cuda")))
    assert cuda["softmax"] is Rule.FP32 and cuda["block_norm"] is Rule.FP32
    o2 = _rules(_classified(Net(), preset("O2", torch.float16, "cpu")))
    assert o2["softmax"] is Rule.FP32 and o2["block_fc"] is Rule.LOWER


def test_inplace_call_is_passthrough_even_when_the_op_is_fp32():
    # exp is an O2 FP32 island, but exp_ writes into its input: a cast would write into a copy.
    gm = _classified(Net(), preset("O2", torch.float16, "cpu"))
    exp_ = next(n for n in gm.graph.nodes if n.target == "exp_")
    assert is_inplace_call(exp_)
    assert node_info(exp_).rule is Rule.PASSTHROUGH
    assert "in-place" in node_info(exp_).reason


def test_opaque_reason_names_the_module():
    gm = _classified(Net(), preset("O1", torch.bfloat16, "cpu"))
    attn = next(n for n in gm.graph.nodes if n.name == "attn")
    assert "MultiheadAttention" in node_info(attn).reason


def test_module_name_override_covers_ops_inside_a_traced_through_module():
    policy = preset("O2", torch.float16, "cpu").set_module_name("block", Rule.FP32)
    gm = _classified(Net(), policy)
    softmax = next(n for n in gm.graph.nodes if n.name == "softmax")
    assert calling_module(softmax, gm) == ("block", Block)
    assert node_info(softmax).rule is Rule.FP32
    assert "module name 'block'" in node_info(softmax).reason
    # A leaf inside the block is decided by its own name: no override for "block.fc".
    assert node_info(next(n for n in gm.graph.nodes if n.name == "block_fc")).rule is Rule.LOWER


def test_classify_leaves_the_graph_unchanged():
    gm = normalize_ops(trace(Net())).graph_module
    before = gm.code
    assert classify(gm, Conversion(preset("O1", torch.bfloat16, "cpu"))).modified is False
    gm.recompile()
    assert gm.code == before


def test_functions_and_methods_spellings_get_one_rule():
    class Spellings(nn.Module):
        def forward(self, x, w):
            return F.linear(x, w) + torch.matmul(x, w) + x @ w + x.matmul(w)

    gm = _classified(Spellings(), preset("O1", torch.bfloat16, "cpu"))
    lowered = [n for n in gm.graph.nodes if node_info(n).rule is Rule.LOWER]
    assert len(lowered) == 4


def test_decide_node_keeps_amp_fx_casts_passthrough():
    gm = _classified(nn.Sequential(nn.Linear(2, 2)), preset("O1", torch.bfloat16, "cpu"))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    node_info(node).is_cast = True
    node_info(node).cast_reason = "test cast"
    decision = decide_node(node, gm, preset("O1", torch.bfloat16, "cpu"))
    assert decision.rule is Rule.PASSTHROUGH and decision.reason == "test cast"
