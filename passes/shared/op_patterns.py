"""Expression patterns over canonical op names: one description matches the graphs of both front
ends.

A pattern is a tree of `Op` (a call whose canonical op name, ``node_info(node).op`` from
`normalize_ops`, is given, with sub-patterns for its operands), `Const` (a Python number, equal
in float32), `Var` (any value, the same node wherever the name recurs) and `AnyOf`
(alternatives). ``torch.tanh(x)``, ``x.tanh()``, ``nn.Tanh()(x)`` and ``aten.tanh.default(x)`` are
all ``Op("tanh", (x,))``; a commutative op matches its operands in either order, so ``0.5 * x``
(torch.fx records ``mul(0.5, x)``) and ATen's ``mul(x, 0.5)`` are one pattern. Casts amp_fx
inserted (``node_info(node).is_cast``) are looked through: inside the pattern they belong to the
match, at a `Var` they are the input's casts.

`match` returns a `Match` (the nodes of the expression, the bound inputs) only when the whole
expression is there and nothing outside it reads a value inside it (the root aside): a replacement
never leaves half an expression behind.

The node facts the matchers written by hand (`amp_fx.passes.fuse_norms.norm_chains`,
`amp_fx.passes.fuse_rotary.rotary_chains`) share with this one live here too: `call_operands` (a call
of one op on its operands alone), `only_user`, `read_only_inside`, `is_last_dim`, `tensor_value`
and `is_number`; the casts they all walk through, `amp_fx.passes.shared.cast_walk`.

    >>> gm = torch.fx.symbolic_trace(lambda x, y: torch.sigmoid(x) * y)
    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> root = [n for n in normalize_ops(gm).graph.nodes if n.name == "mul"][0]
    >>> found = match(Op("mul", (Op("sigmoid", (Var("x"),)), Var("y")), commutative=True), root, gm)
    >>> sorted(n.name for n in found.nodes), found.inputs["x"].name
    (['mul', 'sigmoid'], 'x')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.call_nodes import is_inplace_call
from amp_fx.passes.shared.cast_walk import is_amp_fx_cast, under_casts

__all__ = [
    "AnyOf",
    "CALL_FORMS",
    "CallForm",
    "Const",
    "Match",
    "Op",
    "Pattern",
    "Var",
    "call_operands",
    "is_last_dim",
    "is_number",
    "match",
    "only_user",
    "read_only_inside",
    "tensor_value",
]


@dataclasses.dataclass(frozen=True)
class Var:
    """Any value, bound to its name: every occurrence of the name must be the same node."""

    name: str


@dataclasses.dataclass(frozen=True)
class Const:
    """A Python number equal to ``value`` in float32 (the precision the math runs in)."""

    value: float


@dataclasses.dataclass(frozen=True)
class Op:
    """A call of canonical op ``op`` on ``operands`` (positional, in order unless ``commutative``)
    with ``keywords``: the values its keyword parameters must have (see `CALL_FORMS`; a parameter
    not given here must have its default). In-place calls never match."""

    op: str
    operands: tuple[Pattern, ...]
    commutative: bool = False
    keywords: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """The first of ``alternatives`` that matches."""

    alternatives: tuple[Pattern, ...]


Pattern = Var | Const | Op | AnyOf


@dataclasses.dataclass(frozen=True)
class CallForm:
    """How an op's call may look beyond its operands: the torch module that computes it (called as
    a leaf by torch.fx, matched only with that class's own forward and no hooks) and its keyword
    parameters (name, default) in positional order, also the module's attributes of those names."""

    module: type[nn.Module] | None = None
    keywords: tuple[tuple[str, Any], ...] = ()


# The ops whose calls carry more than their operands. Any other op matches a function or method
# call of its operands alone, never a module.
CALL_FORMS: dict[str, CallForm] = {
    "gelu": CallForm(nn.GELU, (("approximate", "none"),)),
    "silu": CallForm(nn.SiLU, (("inplace", False),)),
    "tanh": CallForm(nn.Tanh),
}


@dataclasses.dataclass(frozen=True)
class Match:
    """A matched expression: ``nodes``, every node it replaces (the root and amp_fx's casts inside
    included); ``inputs``, each `Var`'s node; ``input_casts``, amp_fx's casts of the inputs that the
    expression read (they may have other readers)."""

    root: torch.fx.Node
    nodes: frozenset[torch.fx.Node]
    inputs: Mapping[str, torch.fx.Node]
    input_casts: frozenset[torch.fx.Node]


@dataclasses.dataclass(frozen=True)
class _State:
    inputs: Mapping[str, torch.fx.Node]
    nodes: frozenset[torch.fx.Node]
    input_casts: frozenset[torch.fx.Node]


def is_number(value: object) -> bool:
    """A Python int or float, not a bool: a constant operand as graphs record it.

    >>> is_number(2), is_number(0.5), is_number(True)
    (True, True, False)
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def tensor_value(node: Any) -> torch.Tensor | None:
    """The (fake) tensor recorded as ``node``'s value (``meta["val"]``, where shapes are known),
    else None.

    >>> gm = torch.fx.symbolic_trace(lambda x: x)  # traced without shapes
    >>> tensor_value(next(iter(gm.graph.nodes))) is None
    True
    """
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def is_last_dim(node: Any, dim: Any) -> bool:
    """Whether ``dim`` (an int, or one in a list as reductions take it) names ``node``'s last
    dimension: -1, or its rank - 1 where its value is known.

    >>> gm = torch.fx.symbolic_trace(lambda x: x)
    >>> x = next(iter(gm.graph.nodes))
    >>> is_last_dim(x, [-1]), is_last_dim(x, 2)  # x's rank unknown
    (True, False)
    """
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if isinstance(dim, int) and dim == -1:
        return True
    value = tensor_value(node)
    return value is not None and isinstance(dim, int) and not isinstance(dim, bool) and dim == value.dim() - 1


def only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one node that reads ``node``, or None when there are none or several.

    >>> x, exp, add, _ = torch.fx.symbolic_trace(lambda x: x.exp() + x).graph.nodes
    >>> only_user(x), only_user(exp).name
    (None, 'add')
    """
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def read_only_inside(
    nodes: Collection[torch.fx.Node],
    handed_on: Collection[torch.fx.Node] = (),
    reads_inside: Callable[[torch.fx.Node], bool] | None = None,
) -> bool:
    """Whether every reader of ``nodes`` is one of them (or passes ``reads_inside``), but for the
    readers of those ``handed_on`` (the values a replacement hands on): a replaced expression is
    then all there is of it.

    >>> x, exp, neg, _ = torch.fx.symbolic_trace(lambda x: x.exp().neg()).graph.nodes
    >>> read_only_inside([exp]), read_only_inside([exp, neg], handed_on=[neg])
    (False, True)
    """
    inside = set(nodes)
    reads = reads_inside or inside.__contains__
    return all(reads(user) for node in inside.difference(handed_on) for user in node.users)


def call_operands(
    node: Any, gm: torch.fx.GraphModule, op: str, count: int, keywords: Mapping[str, Any] | None = None
) -> tuple[Any, ...] | None:
    """``node``'s ``count`` operands when it is a call of canonical op ``op`` on them, not in
    place, with ``keywords``' values for the op's keyword parameters (`CALL_FORMS`; any other at
    its default) and nothing else; else None.

    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> gm = normalize_ops(torch.fx.symbolic_trace(lambda x: x.neg() * 2))
    >>> mul = [n for n in gm.graph.nodes if n.name == "mul"][0]
    >>> call_operands(mul, gm, "mul", 2)[1], call_operands(mul, gm, "add", 2)
    (2, None)
    """
    if not isinstance(node, torch.fx.Node) or node_info(node).op != op or is_inplace_call(node):
        return None
    keywords = keywords or {}
    form = CALL_FORMS.get(op, CallForm())
    parameters = form.keywords
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if form.module is None or type(module).forward is not form.module.forward:
            return None
        if has_forward_hooks(module) or len(node.args) != count or node.kwargs:
            return None
        given = {name: getattr(module, name, default) for name, default in parameters}
    elif node.op in ("call_function", "call_method"):
        if len(node.args) < count or len(node.args) > count + len(parameters):
            return None
        names = [name for name, _ in parameters]
        given = dict(zip(names, node.args[count:], strict=False))
        if not set(node.kwargs) <= set(names) - set(given):
            return None
        given.update(node.kwargs)
    else:
        return None
    for name, default in parameters:
        if given.get(name, default) != keywords.get(name, default):
            return None
    return tuple(node.args[:count])


def _match(pattern: Pattern, value: Any, state: _State, gm: torch.fx.GraphModule) -> Iterator[_State]:
    """Every way ``value`` matches ``pattern`` given ``state``, each as the state after it."""
    if isinstance(pattern, AnyOf):
        for alternative in pattern.alternatives:
            yield from _match(alternative, value, state, gm)
        return
    if isinstance(pattern, Const):
        if is_number(value):
            wide = torch.tensor([value, pattern.value], dtype=torch.float64).float()
            if wide[0] == wide[1]:
                yield state
        return
    base, casts = under_casts(value, is_amp_fx_cast)
    if not isinstance(base, torch.fx.Node):
        return
    if isinstance(pattern, Var):
        bound = state.inputs.get(pattern.name)
        if bound is None:
            yield _State({**state.inputs, pattern.name: base}, state.nodes, state.input_casts | set(casts))
        elif bound is base:
            yield dataclasses.replace(state, input_casts=state.input_casts | set(casts))
        return
    if base in state.nodes:
        return  # an expression is a tree of nodes: no node twice
    operands = call_operands(base, gm, pattern.op, len(pattern.operands), pattern.keywords)
    if operands is None:
        return
    inner = dataclasses.replace(state, nodes=state.nodes | {base, *casts})
    orders = [operands]
    if pattern.commutative and len(operands) == 2 and operands[0] is not operands[1]:
        orders.append(operands[::-1])
    for order in orders:
        yield from _match_all(pattern.operands, order, inner, gm)


def _match_all(
    patterns: tuple[Pattern, ...], values: tuple[Any, ...], state: _State, gm: torch.fx.GraphModule
) -> Iterator[_State]:
    if not patterns:
        yield state
        return
    for after_first in _match(patterns[0], values[0], state, gm):
        yield from _match_all(patterns[1:], values[1:], after_first, gm)


def match(pattern: Pattern, root: torch.fx.Node, gm: torch.fx.GraphModule) -> Match | None:
    """``root`` as the value of ``pattern``, or None: the first complete match in which nothing
    outside the expression reads a node inside it (the root's own readers aside), and no input is
    a node of the expression.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.tanh(x) * 2.0)
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> root = list(normalize_ops(gm).graph.nodes)[2]
        >>> match(Op("mul", (Op("tanh", (Var("x"),)), Const(2.0))), root, gm) is not None
        True
        >>> match(Op("mul", (Op("tanh", (Var("x"),)), Const(3.0))), root, gm) is None
        True
    """
    if is_amp_fx_cast(root):
        return None  # the expression's value is its root's; a cast there is the reader's
    for state in _match(pattern, root, _State({}, frozenset(), frozenset()), gm):
        inside = state.nodes
        if not read_only_inside(inside, handed_on=(root,)):
            continue
        if any(node in inside for node in state.inputs.values()):
            continue
        return Match(root, inside, dict(state.inputs), state.input_casts - inside)
    return None
