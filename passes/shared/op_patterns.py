"""Expression patterns over canonical op names: one description matches the graphs of both front
ends.

A pattern is a tree of `Op` (a call whose canonical op name, ``node_info(node).op`` from
`normalize_ops`, is given, with sub-patterns for its operands), `Const` (a Python number, equal
in float32), `Num` (any Python number, bound to a name), `Var` (any value, the same node wherever
the name recurs) and `AnyOf` (alternatives). ``torch.tanh(x)``, ``x.tanh()``, ``nn.Tanh()(x)``
and ``aten.tanh.default(x)`` are all ``Op("tanh", (x,))``; a commutative op matches its operands
in either order, so ``0.5 * x`` (torch.fx records ``mul(0.5, x)``) and ATen's ``mul(x, 0.5)`` are
one pattern. Casts amp_fx inserted (``node_info(node).is_cast``) are looked through: inside the
pattern they belong to the match, at a `Var` they are the input's casts (a matcher may name other
casts, or none).

`match` returns a `Match` (the nodes of the expression, the bound inputs and numbers) only when
the whole expression is there and nothing outside it reads a value inside it (the root aside): a
replacement never leaves half an expression behind. A matcher whose chain goes on past the
pattern asks for every match (`matches`) and checks the readers of the whole chain itself.

The node facts the parts of matchers written by hand (`amp_fx.passes.fuse_norms.norm_chains`,
`amp_fx.passes.fuse_rotary.rotary_chains`, `amp_fx.passes.shared.linear_loss_chains`) share with
patterns live here too: `call_operands` (a call of one op on its operands alone), `only_user`,
`read_only_inside`, `updates_only_its_own`, `is_last_dim`, `tensor_value` and `is_number`; the
casts they all walk through, `amp_fx.passes.shared.cast_walk`.

    >>> gm = torch.fx.symbolic_trace(lambda x, y: torch.sigmoid(x) * y)
    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> root = [n for n in normalize_ops(gm).graph_module.graph.nodes if n.name == "mul"][0]
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
    "Num",
    "Op",
    "Pattern",
    "Var",
    "call_operands",
    "is_last_dim",
    "is_number",
    "match",
    "matches",
    "only_user",
    "read_only_inside",
    "tensor_value",
    "updates_only_its_own",
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
class Num:
    """Any Python number (not a bool), bound to its name: every occurrence of the name must be the
    same number (an eps, a softcap)."""

    name: str


@dataclasses.dataclass(frozen=True)
class Op:
    """A call of canonical op ``op`` on ``operands`` (positional, in order unless ``commutative``)
    with ``keywords``: the values its keyword parameters must have (see `CALL_FORMS`; a parameter
    not given here must have its default). Or, with ``where``, a function or method call whose
    other arguments (positional or by keyword) pass that check instead: ``mean(x, -1, True)``,
    ``mean(x, [-1], keepdim=True)`` and ``mean(x, dim=2, keepdim=True)`` of a 3-D x all average
    over the last dimension. In-place calls match only where `match` lets them."""

    op: str
    operands: tuple[Pattern, ...]
    commutative: bool = False
    keywords: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    where: Callable[[torch.fx.Node], bool] | None = None


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """The first of ``alternatives`` that matches."""

    alternatives: tuple[Pattern, ...]


Pattern = Var | Num | Const | Op | AnyOf


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
    """A matched expression: ``nodes``, every node it replaces (the root and the casts inside
    included); ``inputs``, each `Var`'s node; ``input_casts``, the casts of the inputs that the
    expression read (they may have other readers); ``numbers``, each `Num`'s number."""

    root: torch.fx.Node
    nodes: frozenset[torch.fx.Node]
    inputs: Mapping[str, torch.fx.Node]
    input_casts: frozenset[torch.fx.Node]
    numbers: Mapping[str, int | float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _State:
    inputs: Mapping[str, torch.fx.Node]
    nodes: frozenset[torch.fx.Node]
    input_casts: frozenset[torch.fx.Node]
    numbers: Mapping[str, int | float]


@dataclasses.dataclass(frozen=True)
class _Rules:
    casts: Callable[[torch.fx.Node], bool] | None  # the casts looked through
    in_place: bool  # in-place calls of a value read by them alone match


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


def updates_only_its_own(node: torch.fx.Node) -> bool:
    """Whether a call that updates its first argument in place updates a value nothing else
    reads: it then computes what the call that is not in place would (``variance.add_(eps)``).

    >>> x, exp, add, _ = torch.fx.symbolic_trace(lambda x: x.exp().add_(1)).graph.nodes
    >>> updates_only_its_own(add)
    True
    """
    updated = node.args[0] if node.args else None
    return not isinstance(updated, torch.fx.Node) or set(updated.users) == {node}


def call_operands(
    node: Any,
    gm: torch.fx.GraphModule,
    op: str,
    count: int,
    keywords: Mapping[str, Any] | None = None,
    *,
    in_place: bool = False,
) -> tuple[Any, ...] | None:
    """``node``'s ``count`` operands when it is a call of canonical op ``op`` on them, not in
    place (or, with ``in_place``, in place on a value only it reads), with ``keywords``' values
    for the op's keyword parameters (`CALL_FORMS`; any other at its default) and nothing else;
    else None.

    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> gm = normalize_ops(torch.fx.symbolic_trace(lambda x: x.neg() * 2)).graph_module
    >>> mul = [n for n in gm.graph.nodes if n.name == "mul"][0]
    >>> call_operands(mul, gm, "mul", 2)[1], call_operands(mul, gm, "add", 2)
    (2, None)
    """
    if not isinstance(node, torch.fx.Node) or node_info(node).op != op:
        return None
    if is_inplace_call(node) and not (in_place and updates_only_its_own(node)):
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


def _operands(
    node: torch.fx.Node, gm: torch.fx.GraphModule, pattern: Op, rules: _Rules
) -> tuple[Any, ...] | None:
    count = len(pattern.operands)
    if pattern.where is None:
        return call_operands(node, gm, pattern.op, count, pattern.keywords, in_place=rules.in_place)
    if node_info(node).op != pattern.op or node.op not in ("call_function", "call_method"):
        return None
    if is_inplace_call(node) and not (rules.in_place and updates_only_its_own(node)):
        return None
    return tuple(node.args[:count]) if len(node.args) >= count and pattern.where(node) else None


def _match(
    pattern: Pattern, value: Any, state: _State, gm: torch.fx.GraphModule, rules: _Rules
) -> Iterator[_State]:
    """Every way ``value`` matches ``pattern`` given ``state``, each as the state after it."""
    if isinstance(pattern, AnyOf):
        for alternative in pattern.alternatives:
            yield from _match(alternative, value, state, gm, rules)
        return
    if isinstance(pattern, Const):
        if is_number(value):
            wide = torch.tensor([value, pattern.value], dtype=torch.float64).float()
            if wide[0] == wide[1]:
                yield state
        return
    if isinstance(pattern, Num):
        bound = state.numbers.get(pattern.name)
        if is_number(value) and (bound is None or bound == value):
            yield dataclasses.replace(state, numbers={**state.numbers, pattern.name: value})
        return
    base, casts = under_casts(value, rules.casts) if rules.casts is not None else (value, [])
    if not isinstance(base, torch.fx.Node):
        return
    if isinstance(pattern, Var):
        bound = state.inputs.get(pattern.name)
        if bound is None:
            inputs = {**state.inputs, pattern.name: base}
            yield dataclasses.replace(state, inputs=inputs, input_casts=state.input_casts | set(casts))
        elif bound is base:
            yield dataclasses.replace(state, input_casts=state.input_casts | set(casts))
        return
    if base in state.nodes:
        return  # an expression is a tree of nodes: no node twice
    operands = _operands(base, gm, pattern, rules)
    if operands is None:
        return
    inner = dataclasses.replace(state, nodes=state.nodes | {base, *casts})
    orders = [operands]
    if pattern.commutative and len(operands) == 2 and operands[0] is not operands[1]:
        orders.append(operands[::-1])
    for order in orders:
        yield from _match_all(pattern.operands, order, inner, gm, rules)


def _match_all(
    patterns: tuple[Pattern, ...],
    values: tuple[Any, ...],
    state: _State,
    gm: torch.fx.GraphModule,
    rules: _Rules,
) -> Iterator[_State]:
    if not patterns:
        yield state
        return
    for after_first in _match(patterns[0], values[0], state, gm, rules):
        yield from _match_all(patterns[1:], values[1:], after_first, gm, rules)


def matches(
    pattern: Pattern,
    root: torch.fx.Node,
    gm: torch.fx.GraphModule,
    *,
    casts: Callable[[torch.fx.Node], bool] | None = is_amp_fx_cast,
    in_place: bool = False,
    closed: bool = True,
) -> Iterator[Match]:
    """Every match of ``pattern`` whose value is ``root``, in the order of its alternatives and
    operand orders: no input is a node of the expression and, where ``closed``, nothing outside
    the expression reads a node inside it (the root's own readers aside). ``casts``: the casts
    looked through (default amp_fx's; None for none); ``in_place``: in-place calls match where
    the value they update is read by them alone.

    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> gm = normalize_ops(torch.fx.symbolic_trace(lambda x, y: x * (y + 2))).graph_module
    >>> root = list(gm.graph.nodes)[-2]
    >>> pattern = Op("mul", (Var("a"), Op("add", (Var("b"), Num("c")))), commutative=True)
    >>> [(m.inputs["a"].name, m.numbers["c"]) for m in matches(pattern, root, gm)]
    [('x', 2)]
    """
    if casts is not None and under_casts(root, casts)[1]:
        return  # the expression's value is its root's; a cast there is the reader's
    rules = _Rules(casts, in_place)
    for state in _match(pattern, root, _State({}, frozenset(), frozenset(), {}), gm, rules):
        inside = state.nodes
        if closed and not read_only_inside(inside, handed_on=(root,)):
            continue
        if any(node in inside for node in state.inputs.values()):
            continue
        yield Match(root, inside, dict(state.inputs), state.input_casts - inside, dict(state.numbers))


def match(
    pattern: Pattern,
    root: torch.fx.Node,
    gm: torch.fx.GraphModule,
    *,
    casts: Callable[[torch.fx.Node], bool] | None = is_amp_fx_cast,
    in_place: bool = False,
    closed: bool = True,
) -> Match | None:
    """``root`` as the value of ``pattern``, or None: the first of its `matches`.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.tanh(x) * 2.0)
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> root = list(normalize_ops(gm).graph_module.graph.nodes)[2]
        >>> match(Op("mul", (Op("tanh", (Var("x"),)), Const(2.0))), root, gm) is not None
        True
        >>> match(Op("mul", (Op("tanh", (Var("x"),)), Const(3.0))), root, gm) is None
        True
    """
    return next(matches(pattern, root, gm, casts=casts, in_place=in_place, closed=closed), None)
