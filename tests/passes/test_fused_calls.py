"""fused_calls: the one way the fusion passes put a call in a chain's place, on graphs traced from
real code (the reference: the values the graph computes before and after)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from amp_fx.core.node_info import FX_WRAPPED_KEY, NodeInfo, node_info
from amp_fx.core.policy import Rule
from amp_fx.passes.shared.fused_calls import INHERITED_META, insert_call, replace_chain, retarget_call


def _graph(function) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    gm = torch.fx.symbolic_trace(function)
    return gm, {node.name: node for node in gm.graph.nodes}


def _softplus_then_more(x):
    s = torch.log1p(torch.exp(x))  # the chain a fused softplus replaces
    return s * 2, s.sum()


def test_a_chain_becomes_one_call_that_computes_the_same() -> None:
    gm, nodes = _graph(_softplus_then_more)
    x = torch.randn(5)
    expected = gm(x)
    log1p = nodes["log1p"]
    log1p.meta.update({"nn_module_stack": {"act": ("act", torch.nn.Softplus)}, "stack_trace": "line 1"})
    node_info(nodes["x"]).out_dtype = torch.float32
    info = NodeInfo(op="softplus", rule=Rule.PASSTHROUGH, notes=["replaced exp, log1p"])
    fused = insert_call(
        gm, torch.nn.functional.softplus, (nodes["x"],), before=nodes["exp"], info=info, inherits=log1p
    )
    replace_chain(gm, [nodes["exp"], log1p], {log1p: fused})
    gm.recompile()
    assert [n.name for n in gm.graph.nodes] == ["x", "softplus", "mul", "sum_1", "output"]
    assert all(torch.allclose(a, b) for a, b in zip(gm(x), expected, strict=True))
    assert node_info(fused).in_dtypes == (torch.float32,)  # read from its input, none given
    assert {key: fused.meta[key] for key in INHERITED_META if key in fused.meta} == {
        "nn_module_stack": log1p.meta["nn_module_stack"],
        "stack_trace": "line 1",
    }
    assert FX_WRAPPED_KEY not in fused.meta


def _pair(x):
    a, b = x.exp(), x.neg()
    return a + 1, b * 2


def exp_and_neg(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.exp(), x.neg()


def test_values_are_rewired_in_order_and_items_follow_the_call() -> None:
    gm, nodes = _graph(_pair)
    x = torch.randn(3)
    expected = gm(x)
    info = NodeInfo(op="exp_and_neg", in_dtypes=(torch.float16,))
    pair = insert_call(gm, exp_and_neg, (nodes["x"],), before=nodes["add"], info=info)
    items = [
        insert_call(gm, operator.getitem, (pair, i), before=nodes["add"], info=NodeInfo(op="getitem"))
        for i in (0, 1)
    ]
    replace_chain(
        gm, [nodes["exp"], nodes["neg"]], dict(zip((nodes["exp"], nodes["neg"]), items, strict=True))
    )
    gm.recompile()
    assert [n.name for n in gm.graph.nodes] == [
        "x",
        "exp_and_neg",
        "getitem",
        "getitem_1",
        "add",
        "mul",
        "output",
    ]
    assert node_info(pair).in_dtypes == (torch.float16,)  # as given
    assert all(torch.equal(a, b) for a, b in zip(gm(x), expected, strict=True))


def test_a_chain_read_from_outside_cannot_be_erased() -> None:
    gm, nodes = _graph(_softplus_then_more)
    with pytest.raises(RuntimeError):
        replace_chain(gm, [nodes["exp"]], {})


def test_retarget_keeps_the_record_and_notes_once() -> None:
    gm, nodes = _graph(lambda x: torch.relu(x))
    relu = nodes["relu"]
    node_info(relu).rule = Rule.PASSTHROUGH
    for _ in range(2):
        retarget_call(relu, torch.nn.functional.relu, (nodes["x"],), {}, note="functional relu")
    assert relu.target is torch.nn.functional.relu and relu.meta[FX_WRAPPED_KEY]
    assert node_info(relu).rule is Rule.PASSTHROUGH and node_info(relu).notes == ["functional relu"]
