"""Tests for `amp_fx.passes.simplify_casts`: no-op casts go, duplicates merge, exact round trips cancel."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.core.policy import preset
from amp_fx.passes.shared.casts import make_cast
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.dtypes import ASSUMED_DTYPE_NOTE, is_exact_widening
from amp_fx.passes.simplify_casts import simplify_casts

F16, F32 = torch.float16, torch.float32
CONTEXT = Conversion(preset("O2", F16, "cpu"))


def _node(graph: torch.fx.Graph, target, args, out_dtype) -> torch.fx.Node:
    node = graph.call_function(target, args)
    info = node_info(node)
    info.out_dtype = out_dtype
    info.in_dtypes = tuple(node_info(a).out_dtype for a in node.all_input_nodes)
    return node


def _cast(graph: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    return make_cast(graph, value, dtype, guarded=False, reason="test")


def _casts(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if node_info(n).is_cast]


def _build() -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node_info(x).out_dtype = F16
    node_info(x).notes.append(ASSUMED_DTYPE_NOTE)  # no example_inputs: the dtype is a guess
    a = _node(graph, torch.relu, (x,), F16)
    up = _cast(graph, a, F32)  # a float16 value, widened for an FP32 op
    soft = _node(graph, torch.softmax, (up, -1), F32)
    back = _cast(graph, up, F16)  # exact round trip: float16 -> float32 -> float16
    prod = _node(graph, torch.mul, (back, back), F16)
    up_again = _cast(graph, a, F32)  # duplicate of `up`
    logsoft = _node(graph, torch.log_softmax, (up_again, -1), F32)
    noop = _cast(graph, a, F16)  # a is float16 already
    down = _cast(graph, soft, F16)  # lossy: float32 -> float16 ...
    lossy = _cast(graph, down, F32)  # ... -> float32 must stay
    user_cast = graph.call_method("to", (a, F16))  # written by the user: not amp_fx's
    node_info(user_cast).out_dtype = F16
    entry = _cast(graph, x, F16)  # the input's dtype is only assumed: kept
    graph.output((soft, prod, logsoft, noop, lossy, user_cast, entry))
    return torch.fx.GraphModule(nn.Module(), graph)


def test_simplify_removes_noops_merges_duplicates_and_cancels_exact_round_trips():
    gm = _build()
    x = torch.randn(3, 4).to(F16)
    expected = gm(x)
    assert simplify_casts(gm, CONTEXT).modified is True
    gm.graph.lint()
    gm.recompile()
    casts = _casts(gm)
    assert "relu_to_float32_1" not in casts  # the duplicate merged into relu_to_float32
    assert "relu_to_float32" in casts
    assert "relu_to_float32_to_float16" not in casts  # exact round trip
    assert "relu_to_float16" not in casts  # no-op
    assert "softmax_to_float16" in casts and "softmax_to_float16_to_float32" in casts  # lossy: kept
    assert "x_to_float16" in casts
    mul = next(n for n in gm.graph.nodes if n.target is torch.mul)
    assert mul.args == (mul.args[0], mul.args[0]) and mul.args[0].target is torch.relu
    log_softmax = next(n for n in gm.graph.nodes if n.target is torch.log_softmax)
    assert log_softmax.args[0].name == "relu_to_float32"
    assert sum(1 for n in gm.graph.nodes if n.op == "call_method" and not node_info(n).is_cast) == 1
    for got, want in zip(gm(x), expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_users_keep_in_dtypes_aligned_with_their_inputs():
    gm = _build()
    simplify_casts(gm, CONTEXT)
    for node in gm.graph.nodes:
        info = node_info(node)
        if node.op == "call_function" and info.in_dtypes:
            assert len(info.in_dtypes) == len(node.all_input_nodes)
            for value, seen in zip(node.all_input_nodes, info.in_dtypes, strict=True):
                assert node_info(value).out_dtype == seen


def test_simplify_is_idempotent():
    gm = simplify_casts(_build(), CONTEXT).graph_module
    before = _casts(gm)
    result = simplify_casts(gm, CONTEXT)
    assert _casts(result.graph_module) == before and result.modified is False


def test_exact_widenings():
    assert is_exact_widening(torch.bfloat16, F32)
    assert is_exact_widening(F16, torch.float64)
    assert not is_exact_widening(F32, F16)
    assert not is_exact_widening(torch.bfloat16, F16)  # bf16 has more exponent range than fp16
