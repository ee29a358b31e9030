"""op_patterns: what a pattern matches, on graphs traced from real code and named by
`normalize_ops` (the references: the nodes the code made, named by what they compute).

The fusion passes' own tests check the patterns they write (test_fuse_activations, test_fuse_norms,
test_fuse_rotary, the linear-loss tests); these check the language: numbers bound by name, calls
checked by ``where``, every match in order, in-place calls, the casts looked through.
"""

from __future__ import annotations

import torch
import torch.fx

from amp_fx.core.node_info import NodeInfo, node_info
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.shared.call_nodes import call_argument
from amp_fx.passes.shared.op_patterns import AnyOf, Const, Num, Op, Var, match, matches


def _graph(function) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    gm = normalize_ops(torch.fx.symbolic_trace(function)).graph_module
    return gm, {node.name: node for node in gm.graph.nodes}


def _root(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The node the graph returns."""
    return next(iter(gm.graph.output_node().all_input_nodes))


SCALED_SHIFT = Op("add", (Op("mul", (Var("x"), Num("c")), commutative=True), Num("c")), commutative=True)


def test_a_number_is_bound_and_must_recur_the_same() -> None:
    gm, nodes = _graph(lambda x: x * 3 + 3)
    found = match(SCALED_SHIFT, _root(gm), gm)
    assert found is not None and found.numbers == {"c": 3} and found.inputs == {"x": nodes["x"]}
    gm, _ = _graph(lambda x: x * 3 + 2)
    assert match(SCALED_SHIFT, _root(gm), gm) is None


def _over_last_dim(mean: torch.fx.Node) -> bool:
    return call_argument(mean, 1, "dim") in (-1, [-1]) and call_argument(mean, 2, "keepdim") is True


MEAN = Op("mean", (Var("x"),), where=_over_last_dim)


def test_where_checks_the_other_arguments_in_any_spelling() -> None:
    for spelling in (
        lambda x: x.mean(-1, keepdim=True),
        lambda x: x.mean(dim=[-1], keepdim=True),
        lambda x: torch.mean(x, -1, True),
    ):
        gm, nodes = _graph(spelling)
        found = match(MEAN, _root(gm), gm)
        assert found is not None and found.inputs["x"] is nodes["x"]
    for near_miss in (lambda x: x.mean(0, keepdim=True), lambda x: x.mean(-1)):
        gm, _ = _graph(near_miss)
        assert match(MEAN, _root(gm), gm) is None


def test_matches_yields_every_binding_in_operand_order() -> None:
    gm, nodes = _graph(lambda x, y: x * y)
    found = [m.inputs for m in matches(Op("mul", (Var("a"), Var("b")), commutative=True), _root(gm), gm)]
    assert found == [{"a": nodes["x"], "b": nodes["y"]}, {"a": nodes["y"], "b": nodes["x"]}]
    ordered = Op("mul", (Var("a"), Var("b")))
    assert [m.inputs["a"] for m in matches(ordered, _root(gm), gm)] == [nodes["x"]]


def test_an_alternative_that_fails_gives_way_to_the_next() -> None:
    gm, nodes = _graph(lambda x: torch.rsqrt(x) * 2)
    pattern = Op("mul", (AnyOf((Op("sqrt", (Var("x"),)), Op("rsqrt", (Var("x"),)))), Const(2.0)))
    found = match(pattern, _root(gm), gm)
    assert found is not None and {n.name for n in found.nodes} == {"mul", "rsqrt"}


def _exp_plus_one(x):
    return x.exp().add_(1)


def _updated_value_read_twice(x):
    e = x.exp()
    e.add_(1)
    return e * 2


PLUS_ONE = Op("add", (Op("exp", (Var("x"),)), Const(1.0)))


def test_in_place_calls_match_only_on_values_read_by_them_alone() -> None:
    gm, _ = _graph(_exp_plus_one)
    assert match(PLUS_ONE, _root(gm), gm) is None  # in place: not by default
    found = match(PLUS_ONE, _root(gm), gm, in_place=True)
    assert found is not None and {n.name for n in found.nodes} == {"exp", "add_"}
    gm, nodes = _graph(_updated_value_read_twice)
    assert match(PLUS_ONE, nodes["add_"], gm, in_place=True, closed=False) is None


def test_closed_refuses_an_expression_read_from_outside() -> None:
    gm, nodes = _graph(lambda x: (lambda e: e * 2 + e)(x.exp()))
    pattern = Op("mul", (Op("exp", (Var("x"),)), Const(2.0)))
    assert match(pattern, nodes["mul"], gm) is None
    found = match(pattern, nodes["mul"], gm, closed=False)
    assert found is not None and found.nodes == {nodes["exp"], nodes["mul"]}


def test_which_casts_are_looked_through_is_the_matchers_choice() -> None:
    gm, nodes = _graph(lambda x: x.float().tanh())
    cast = nodes["float_1"]
    cast.meta["amp_fx"] = NodeInfo(op="to", is_cast=True, out_dtype=torch.float32)  # amp_fx's own
    tanh = Op("tanh", (Var("x"),))
    found = match(tanh, _root(gm), gm)  # amp_fx's casts: the input's
    assert found.inputs["x"] is nodes["x"] and found.input_casts == {cast}
    found = match(tanh, _root(gm), gm, casts=None)
    assert found.inputs["x"] is cast and not found.input_casts
    node_info(cast).is_cast = False  # a model's own cast is looked through only where named
    assert match(tanh, _root(gm), gm).inputs["x"] is cast
    found = match(tanh, _root(gm), gm, casts=lambda node: node_info(node).op == "to")
    assert found.inputs["x"] is nodes["x"]
