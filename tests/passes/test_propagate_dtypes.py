"""Tests for `amp_fx.passes.propagate_dtypes`: what each node sees and produces under its rule."""

from __future__ import annotations

import dataclasses
import logging
import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.capture.fx import trace
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule, preset
from amp_fx.ops.activations import fp32_gated_activation
from amp_fx.ops.norms import add_layer_norm_fp32, rms_norm_fp32
from amp_fx.ops.rotary import rotary_embedding
from amp_fx.passes.classify import classify
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.propagate_dtypes import ExampleInputsMismatch, propagate_dtypes
from amp_fx.passes.propagate_dtypes.dtype_rules import UNKNOWN, is_eligible, rule_cast_dtype
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.decisions import plan_parameters
from amp_fx.passes.shared.dtypes import ASSUMED_DTYPE_NOTE

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _classified(
    gm: torch.fx.GraphModule, policy, example_inputs=None
) -> tuple[torch.fx.GraphModule, Conversion]:
    """``gm`` through the passes before `propagate_dtypes`, and the context with its parameter plan."""
    gm = classify(normalize_ops(gm).graph_module, Conversion(policy)).graph_module
    return gm, plan_parameters(gm, Conversion(policy, example_inputs))


def _propagated(model: nn.Module, policy, example_inputs=None) -> dict[str, tuple]:
    gm = propagate_dtypes(*_classified(trace(model), policy, example_inputs)).graph_module
    return {n.name: (node_info(n).in_dtypes, node_info(n).out_dtype) for n in gm.graph.nodes}


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.softmax(self.fc(x), -1)


def test_static_o1_linear_sees_and_produces_low():
    dtypes = _propagated(Mlp(), preset("O1", BF16, "cpu"))
    assert dtypes["x"] == ((), F32)  # a model input is assumed float32
    assert dtypes["fc"] == ((BF16,), BF16)
    assert dtypes["softmax"] == ((BF16,), BF16)  # CPU autocast leaves softmax alone
    assert dtypes["output"] == ((BF16,), None)


def test_static_fp32_rule_sees_float32():
    dtypes = _propagated(Mlp(), preset("O1", F16, "cuda"))
    assert dtypes["softmax"] == ((F32,), F32)


def test_o2_model_input_is_seen_low_but_keeps_its_dtype():
    dtypes = _propagated(Mlp(), preset("O2", BF16, "cpu"))
    assert dtypes["x"] == ((), F32)
    assert dtypes["fc"] == ((BF16,), BF16)
    assert dtypes["softmax"] == ((F32,), F32)  # O2 FP32 island
    assert dtypes["output"] == ((F32,), None)  # cast_model_outputs float32


class Transfers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x, ids):
        e = self.emb(ids)
        mask = x > 0
        idx = x.argmax(-1)
        first_part = torch.split(x, 2, dim=-1)[0]
        values, indices = torch.max(x, dim=-1)
        n = x.size(0)
        as_long = x.long()
        as_half = x.to(torch.float16)
        mixed = torch.cat([as_half, x], -1)
        return e, mask, idx, first_part, values, indices, n, as_long, mixed


def test_static_transfer_rules():
    dtypes = _propagated(Transfers(), preset("O1", BF16, "cpu"))
    out = {name: d[1] for name, d in dtypes.items()}
    assert out["emb"] == F32  # embedding: the weight's dtype
    assert out["gt"] == torch.bool
    assert out["argmax"] == torch.int64
    assert out["getitem"] == F32  # parts[0]
    assert (out["getitem_1"], out["getitem_2"]) == (F32, torch.int64)  # values, indices
    assert out["size"] is None  # not a tensor
    assert out["long"] == torch.int64
    assert out["to"] == F16
    assert out["cat"] == F32  # CPU autocast promote: float16 and float32 -> float32
    assert dtypes["cat"][0] == (F32, F32)


class Membership(nn.Module):
    def forward(self, x, values):
        return torch.isin(x, values)


def test_static_isin_is_bool():
    """The worked example of docs/DESIGN.md ("Op facts"): one entry in BOOL_OPS."""
    dtypes = _propagated(Membership(), preset("O1", BF16, "cpu"))
    assert dtypes["isin"][1] == torch.bool
    x, values = torch.randn(4), torch.randn(2)
    assert torch.isin(x, values).dtype == dtypes["isin"][1]  # the reference: what torch returns


def test_static_fused_ops_are_typed_as_their_table_rows_say():
    """A graph holding amp_fx's fused calls (a converted graph converted again): each output's
    static dtype is what the call returns (`amp_fx.core.fusions`: ``out_dtype=``, the sum and
    ``out_dtype=``, or the promoted inputs)."""
    graph = torch.fx.Graph()
    x, residual, weight, cos, sin = (graph.placeholder(n) for n in ("x", "residual", "weight", "cos", "sin"))
    norm = graph.call_function(rms_norm_fp32, (x, weight, 1e-6), {"out_dtype": BF16})
    pair = graph.call_function(add_layer_norm_fp32, (x, residual, [8], weight, None), {"out_dtype": BF16})
    summed, normed = (graph.call_function(operator.getitem, (pair, index)) for index in (0, 1))
    gated = graph.call_function(fp32_gated_activation, (norm, normed, "silu"))
    rotated = graph.call_function(rotary_embedding, (gated, cos, sin))
    graph.output((norm, summed, normed, gated, rotated))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    policy = preset("O2", BF16, "cpu")
    propagate_dtypes(*_classified(gm, policy))
    static = [node_info(node).out_dtype for node in (norm, summed, normed, gated, rotated)]
    assert static == [BF16, F32, BF16, BF16, F32]
    inputs = (torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8), torch.rand(8), torch.randn(2, 1, 3, 8))
    outputs = gm(*inputs, torch.randn(2, 1, 3, 8))
    assert static == [output.dtype for output in outputs]  # the reference: what the calls return


class Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.attn(x, x, x)[0])


def test_opaque_output_is_unknown_statically_and_exact_with_examples():
    static = _propagated(Opaque(), preset("O1", BF16, "cpu"))
    assert static["attn"][1] is None and static["getitem"][1] is None
    assert static["fc"] == ((BF16,), BF16)  # an unknown value is still cast for a LOWER op
    exact = _propagated(Opaque(), preset("O1", BF16, "cpu"), (torch.randn(2, 3, 4),))
    assert exact["getitem"][1] == BF16  # MHA's out_proj under autocast
    assert exact["fc"] == ((BF16,), BF16)


def test_exact_integer_input_is_never_cast():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    ids = torch.tensor([[1, 2, 3]])
    dtypes = _propagated(model, preset("O3", F16, "cpu"), (ids,))  # O3: a low embedding table
    assert dtypes["input_1"] == ((), torch.int64)
    assert dtypes["_0"] == ((torch.int64,), F16)  # the embedding sees the ids as they are
    assert dtypes["_1"] == ((F16,), F16)


def test_exact_low_precision_input_at_o1():
    dtypes = _propagated(Mlp(), preset("O1", BF16, "cpu"), (torch.randn(2, 4, dtype=BF16),))
    assert dtypes["x"] == ((), BF16)
    assert dtypes["fc"] == ((BF16,), BF16)


def test_an_assumed_input_dtype_is_noted_and_a_known_one_is_not():
    policy = preset("O1", BF16, "cpu")
    gm, context = _classified(trace(Mlp()), policy)
    (x,) = gm.graph.find_nodes(op="placeholder")
    propagate_dtypes(gm, context)
    assert ASSUMED_DTYPE_NOTE in node_info(x).notes
    propagate_dtypes(gm, dataclasses.replace(context, example_inputs=(torch.randn(2, 4),)))
    assert ASSUMED_DTYPE_NOTE not in node_info(x).notes and node_info(x).out_dtype == F32


class ExplicitDtype(nn.Module):
    def forward(self, x):
        return F.softmax(x, -1, dtype=torch.float64), torch.softmax(x, -1)


def test_fp32_rule_respects_an_explicit_dtype():
    dtypes = _propagated(ExplicitDtype(), preset("O1", F16, "cuda"))
    assert dtypes["softmax"] == ((F32,), torch.float64)  # seen as produced, output as asked
    assert dtypes["softmax_1"] == ((F32,), F32)
    entry = _propagated(ExplicitDtype(), preset("O2", F16, "cpu", cast_inputs_at_entry=True))
    assert entry["softmax"] == ((F16,), torch.float64)  # the entry cast applies, no FP32 cast
    assert entry["softmax_1"] == ((F32,), F32)
    o2 = _propagated(ExplicitDtype(), preset("O2", F16, "cpu"))
    assert o2["softmax"] == ((F32,), torch.float64)  # the input as it is: no lowered op reads it first


def test_rule_cast_dtype_and_eligibility():
    o1 = preset("O1", BF16, "cpu")
    assert rule_cast_dtype(Rule.LOWER, o1, []) == BF16
    assert rule_cast_dtype(Rule.FP32, o1, []) == F32
    assert rule_cast_dtype(Rule.PASSTHROUGH, o1, [F32]) is None
    assert rule_cast_dtype(Rule.PROMOTE, o1, [BF16, BF16, torch.int64]) == BF16
    assert rule_cast_dtype(Rule.PROMOTE, o1, [BF16, F32]) == F32
    assert rule_cast_dtype(Rule.PROMOTE, o1, [BF16, torch.float64]) == BF16  # float64 is ignored
    assert rule_cast_dtype(Rule.PROMOTE, o1, [BF16, UNKNOWN]) is None  # undecidable statically
    assert rule_cast_dtype(Rule.OPAQUE, o1, []) is None
    assert rule_cast_dtype(Rule.OPAQUE, preset("O2", BF16, "cpu"), []) == BF16
    assert is_eligible(F16) and not is_eligible(torch.float64) and not is_eligible(torch.bool)
    assert is_eligible(UNKNOWN) is None


class DataDependent(nn.Module):
    def forward(self, x, y):
        return torch.nonzero(x).float() @ torch.ones(2, 2), y.to(torch.float64) + 1


def test_exact_propagation_continues_with_static_rules_where_fake_tensors_cannot_run(caplog):
    examples = (torch.randn(3, 2), torch.randn(2, dtype=F16))
    with caplog.at_level(logging.INFO, logger="amp_fx.passes.propagate_dtypes"):
        dtypes = _propagated(DataDependent(), preset("O1", BF16, "cpu"), examples)
    assert "fake tensors cannot run nonzero" in caplog.text
    assert dtypes["nonzero"][1] == torch.int64  # from the static rules, and so on downstream
    assert dtypes["matmul"] == ((BF16, BF16), BF16)
    assert dtypes["y"] == ((), F16)  # elsewhere the dtypes stay exact
    assert dtypes["add"] == ((torch.float64,), torch.float64)


def test_example_inputs_must_match_the_forward():
    with pytest.raises(ValueError, match="example_inputs has 2 values"):
        _propagated(Mlp(), preset("O1", BF16, "cpu"), (torch.randn(2, 4), torch.randn(2, 4)))


def _annotations(gm: torch.fx.GraphModule) -> dict[str, tuple]:
    return {
        n.name: (node_info(n).in_dtypes, node_info(n).out_dtype, list(node_info(n).notes))
        for n in gm.graph.nodes
    }


def test_wrong_shaped_example_inputs_are_refused_naming_the_mismatch_and_change_nothing():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    policy = preset("O2", BF16, "cpu")
    gm, context = _classified(trace(model), policy, (torch.randn(3, 5),))
    before = _annotations(gm)
    mismatch = r"_0 \(linear\) rejects the shapes .*\[3, 5\] X \[8, 4\].*shapes: \(3, 5\)"
    with pytest.raises(ExampleInputsMismatch, match=mismatch):
        propagate_dtypes(gm, context)
    assert _annotations(gm) == before
    with pytest.raises(ValueError, match="example_inputs do not fit the model"):
        amp_fx.convert(model, "O2", dtype=BF16, example_inputs=(torch.randn(3, 5),))
