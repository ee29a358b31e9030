"""Which boolean masks are True everywhere, or exactly the causal triangle: `mask_kind`, for
`simplify_attention`.

The proof is an abstract evaluation of the mask's nodes. An integer tensor is known when it is
affine in its element's indices, ``const + sum(coef[d] * index[d])`` (``arange``, ``+``, ``-``,
shape ops, ``cumsum`` of a constant, ``diff`` of an affine tensor, ``index`` by affine indices); a
boolean tensor when it is a constant or ``affine <= 0``, ``== 0`` or ``!= 0``. Indices are never
negative and, where a size is an int (a static graph), below it: a comparison those bounds
decide is a constant.
Dimensions are counted from the right, as broadcasting aligns them.

    >>> CAUSAL
    Compare(affine=Affine(coefs=((-2, -1), (-1, 1)), const=0), op='<=')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

__all__ = ["Affine", "Compare", "Value", "CAUSAL", "SAME_VALUE_OPS", "mask_kind", "value_shape"]

aten = torch.ops.aten


def _reach(
    coefs: tuple[tuple[int, int], ...], shape: tuple[Any, ...], at_last: Callable[[int], bool]
) -> int | None:
    # Sum of coef * index with each index at 0, or at its last value where ``at_last(coef)``:
    # None when that last value is unknown (no shape, or a symbolic size).
    total = 0
    for d, c in coefs:
        if at_last(c):
            size = shape[len(shape) + d] if len(shape) + d >= 0 else None
            if not isinstance(size, int):
                return None
            total += c * (size - 1)
    return total


@dataclasses.dataclass(frozen=True)
class Affine:
    """An integer tensor whose element at ``index`` is ``const + sum(coefs[d] * index[d])``;
    ``d`` counts dimensions from the right (-1 is the last)."""

    coefs: tuple[tuple[int, int], ...]  # sorted (dim, coef), no zero coef
    const: int

    @staticmethod
    def of(coefs: dict[int, int], const: int) -> Affine:
        return Affine(tuple(sorted((d, c) for d, c in coefs.items() if c)), const)

    def combine(self, other: Affine, scale: int = 1) -> Affine:
        coefs = dict(self.coefs)
        for d, c in other.coefs:
            coefs[d] = coefs.get(d, 0) + scale * c
        return Affine.of(coefs, self.const + scale * other.const)

    def scaled(self, factor: int) -> Affine:
        return Affine.of({d: factor * c for d, c in self.coefs}, factor * self.const)

    def shifted(self, amount: int) -> Affine:
        return Affine(self.coefs, self.const + amount)

    def remap(self, key: Callable[[int], int | None]) -> Affine:
        """The same values with dimension ``d`` renamed ``key(d)`` (``None``: the dimension is gone)."""
        coefs: dict[int, int] = {}
        for d, c in self.coefs:
            new = key(d)
            if new is not None:
                coefs[new] = coefs.get(new, 0) + c
        return Affine.of(coefs, self.const)

    def lower_bound(self, shape: tuple[Any, ...] = ()) -> int | None:
        """The least value (indices are >= 0, and < their size where ``shape`` has it as an int)."""
        reach = _reach(self.coefs, shape, lambda c: c < 0)
        return None if reach is None else self.const + reach

    def upper_bound(self, shape: tuple[Any, ...] = ()) -> int | None:
        reach = _reach(self.coefs, shape, lambda c: c > 0)
        return None if reach is None else self.const + reach

    def non_negative(self) -> bool:
        low = self.lower_bound()
        return low is not None and low >= 0


@dataclasses.dataclass(frozen=True)
class Compare:
    """A boolean tensor: ``affine <op> 0`` elementwise, ``op`` one of ``<=``, ``==``, ``!=``."""

    affine: Affine
    op: str


Value = Affine | Compare | bool


CAUSAL = Compare(Affine.of({-1: 1, -2: -1}, 0), "<=")  # kv - q <= 0


def _compare(affine: Affine, op: str, shape: tuple[Any, ...] = ()) -> Value:
    """``affine <op> 0``, decided when the bounds of the indices bound it: >= 0 always, and below
    their size where ``shape`` gives it as an int."""
    low, high = affine.lower_bound(shape), affine.upper_bound(shape)
    if op == "<=":
        if high is not None and high <= 0:
            return True
        if low is not None and low > 0:
            return False
    elif (low is not None and low > 0) or (high is not None and high < 0):
        return op == "!="
    elif not affine.coefs:
        return (affine.const == 0) == (op == "==")
    return Compare(affine, op)


def _negate(value: Value) -> Value:
    if isinstance(value, bool):
        return not value
    if value.op == "<=":  # not (a <= 0)  <=>  a >= 1  <=>  1 - a <= 0 (integers)
        return _compare(value.affine.scaled(-1).shifted(1), "<=")
    return Compare(value.affine, "!=" if value.op == "==" else "==")


def _and(a: Value | None, b: Value | None) -> Value | None:
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True or a == b:
        return a
    return None


def _or(a: Value | None, b: Value | None) -> Value | None:
    if a is True or b is True:
        return True
    if a is False:
        return b
    if b is False or a == b:
        return a
    return None


def value_shape(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """The shape of the tensor `node` computes, as its capture recorded it (``meta["val"]``), or None."""
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _settle(value: Value, shape: tuple[Any, ...]) -> Value:
    # A dimension of size 1 has index 0 only: its coefficient means nothing and must not follow
    # the value into a later expand. Symbolic sizes are never 1 (export specializes 0 and 1).
    # The sizes that are ints then bound the indices of a comparison (a static graph runs at
    # those sizes only: its inputs are checked).
    if isinstance(value, bool):
        return value
    affine = value.affine if isinstance(value, Compare) else value
    rank = len(shape)
    kept = affine.remap(lambda d: None if rank + d < 0 or _is_one(shape[rank + d]) else d)
    return _compare(kept, value.op, shape) if isinstance(value, Compare) else kept


def _is_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def _number(arg: Any) -> Affine | bool | None:
    if isinstance(arg, bool):
        return arg
    if isinstance(arg, int):
        return Affine((), arg)
    return None


def _dim(dim: int, rank: int) -> int:
    """``dim`` counted from the right."""
    return dim - rank if dim >= 0 else dim


_COMPARISONS = {
    "le": lambda d: (d, "<="),
    "lt": lambda d: (d.shifted(1), "<="),
    "ge": lambda d: (d.scaled(-1), "<="),
    "gt": lambda d: (d.scaled(-1).shifted(1), "<="),
    "eq": lambda d: (d, "=="),
    "ne": lambda d: (d, "!="),
}


# Ops that give their first argument's values unchanged (copies), and with these, shape and dtype moves.
SAME_VALUE_OPS = {aten.clone.default, aten.contiguous.default, aten.alias.default}


_VIEWS = SAME_VALUE_OPS | {
    aten.expand.default, aten.expand_as.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten._to_copy.default,
}  # fmt: skip


_CONSTANT_FILLS = {
    aten.ones.default: True, aten.new_ones.default: True, aten.ones_like.default: True,
    aten.zeros.default: False, aten.new_zeros.default: False, aten.zeros_like.default: False,
}  # fmt: skip


_FILLS = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}


# Where each arange overload takes its start and step.
_ARANGES = {aten.arange.default: (None, None), aten.arange.start: (0, None), aten.arange.start_step: (0, 2)}


_ANDS = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}


_ORS = {aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default}


_NOTS = {aten.bitwise_not.default, aten.logical_not.default}


class _Evaluator:
    """Evaluates mask nodes in the abstract domain above; ``None`` is "not known"."""

    def __init__(self) -> None:
        self.memo: dict[torch.fx.Node, Value | None] = {}

    def value(self, arg: Any) -> Value | None:
        if not isinstance(arg, torch.fx.Node):
            return _number(arg)
        if arg not in self.memo:
            self.memo[arg] = self._evaluate(arg)
        return self.memo[arg]

    def _evaluate(self, node: torch.fx.Node) -> Value | None:
        shape, meta = value_shape(node), node.meta.get("val")
        if node.op != "call_function" or shape is None or meta.dtype.is_floating_point:
            return None  # integer reasoning only (a < 0 <=> a + 1 <= 0)
        value = self._rule(node, meta.dtype, len(shape))
        if value is None:
            return None
        if meta.dtype == torch.bool and isinstance(value, Affine):
            return bool(value.const) if not value.coefs else None
        if meta.dtype != torch.bool and not isinstance(value, Affine):
            return Affine((), int(value)) if isinstance(value, bool) else None
        return _settle(value, shape)

    def _rule(self, node: torch.fx.Node, dtype: torch.dtype, rank: int) -> Value | None:
        target, args, kwargs = node.target, node.args, node.kwargs
        if target in _CONSTANT_FILLS:
            return _CONSTANT_FILLS[target]
        if target in _FILLS:
            where = _FILLS[target]
            return _number(args[where] if len(args) > where else kwargs.get("fill_value"))
        if target in _ARANGES:
            return self._arange(args, _ARANGES[target])
        if target in _VIEWS:
            return self.value(args[0])
        if target in _ANDS or target in _ORS:
            # One known operand can decide: False & anything, True | anything.
            return (_and if target in _ANDS else _or)(self.value(args[0]), self.value(args[1]))
        if target in _NOTS:
            a = self.value(args[0])
            return None if a is None else _negate(a)
        name = getattr(target, "__name__", "").split(".")[0]
        if name in _COMPARISONS:
            a, b = self.value(args[0]), self.value(args[1])
            if not (isinstance(a, Affine) and isinstance(b, Affine)):
                return None
            return _compare(*_COMPARISONS[name](a.combine(b, -1)))
        if target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
            a, b = self.value(args[0]), self.value(args[1])
            if not (isinstance(a, Affine) and isinstance(b, Affine)):
                return None
            sign = -1 if target in (aten.sub.Tensor, aten.sub.Scalar) else 1
            alpha = kwargs.get("alpha", 1)
            return a.combine(b, sign * alpha) if isinstance(alpha, int) else None
        if target in (aten.mul.Tensor, aten.mul.Scalar):
            a, b = self.value(args[0]), self.value(args[1])
            if isinstance(a, Affine) and isinstance(b, Affine):
                if not b.coefs:
                    return a.scaled(b.const)
                if not a.coefs:
                    return b.scaled(a.const)
            return None
        if target is aten.unsqueeze.default:
            return self._unsqueeze(args)
        if target is aten.slice.Tensor:
            return self._slice(args)
        if target is aten.select.int:
            return self._select(args)
        if target is aten.transpose.int:
            return self._transpose(args, rank)
        if target is aten.index.Tensor:
            return self._index(node)
        if target is aten.cumsum.default:
            return self._cumsum(args, rank)
        if target is aten.diff.default:
            return self._diff(node)
        return None

    def _arange(self, args: tuple[Any, ...], where: tuple[int | None, int | None]) -> Value | None:
        start_at, step_at = where
        start = args[start_at] if start_at is not None else 0
        step = args[step_at] if step_at is not None and len(args) > step_at else 1
        if not (isinstance(start, int) and isinstance(step, int)):
            return None
        return Affine.of({-1: step}, start)

    def _unsqueeze(self, args: tuple[Any, ...]) -> Value | None:
        value, source = self.value(args[0]), value_shape(args[0])
        if value is None or source is None:
            return None
        rank = len(source) + 1
        at = args[1] + rank if args[1] < 0 else args[1]
        # Dimensions left of the new one move one further from the right.
        return _remap(value, lambda d: d - 1 if d + len(source) < at else d)

    def _slice(self, args: tuple[Any, ...]) -> Value | None:
        value, source = self.value(args[0]), value_shape(args[0])
        dim = args[1] if len(args) > 1 else 0
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        step = args[4] if len(args) > 4 else 1
        if not isinstance(value, Affine) or source is None or not isinstance(start, int) or start < 0:
            return None
        d = _dim(dim, len(source))
        coef = dict(value.coefs).get(d, 0)
        # Element i of the slice is element start + step * i of the source.
        return Affine.of({**dict(value.coefs), d: coef * step}, value.const + coef * start)

    def _select(self, args: tuple[Any, ...]) -> Value | None:
        value, source = self.value(args[0]), value_shape(args[0])
        if not isinstance(value, Affine) or source is None or not isinstance(args[2], int) or args[2] < 0:
            return None
        d = _dim(args[1], len(source))
        coefs = dict(value.coefs)
        picked = value.const + coefs.pop(d, 0) * args[2]
        return Affine.of(coefs, picked).remap(lambda k: k + 1 if k < d else k)

    def _transpose(self, args: tuple[Any, ...], rank: int) -> Value | None:
        value = self.value(args[0])
        if value is None:
            return None
        a, b = _dim(args[1], rank), _dim(args[2], rank)
        return _remap(value, lambda d: b if d == a else a if d == b else d)

    def _index(self, node: torch.fx.Node) -> Value | None:
        # x[i0, ..., i(m-1)] with every index given and affine: element p of the result is
        # x[i0[p], ..., i(m-1)[p], rest], the index dims first, x's trailing dims after them.
        source_node, indices = node.args
        source, source_shape = self.value(source_node), value_shape(source_node)
        if not isinstance(source, Affine) or source_shape is None or any(i is None for i in indices):
            return None
        rank, trailing = len(source_shape), len(source_shape) - len(indices)
        values = [self.value(i) for i in indices]
        if not all(isinstance(v, Affine) and v.non_negative() for v in values):
            return None  # a negative index would count from the end
        coefs = dict(source.coefs)
        result = Affine.of({d: c for d, c in coefs.items() if d >= -trailing}, source.const)
        for position, index in enumerate(values):
            coef = coefs.get(position - rank, 0)
            result = result.combine(index.remap(lambda d: d - trailing), coef)
        return result

    def _cumsum(self, args: tuple[Any, ...], rank: int) -> Value | None:
        value = self.value(args[0])
        step = int(value) if isinstance(value, bool) else value.const if isinstance(value, Affine) else None
        if step is None or (isinstance(value, Affine) and value.coefs):
            return None
        return Affine.of({_dim(args[1], rank): step}, step)

    def _diff(self, node: torch.fx.Node) -> Value | None:
        args = list(node.args) + [None] * (5 - len(node.args))
        source, n, dim, prepend, append = args[0], args[1], args[2], args[3], args[4]
        n, dim = 1 if n is None else n, -1 if dim is None else dim
        value, shape = self.value(source), value_shape(source)
        if not isinstance(value, Affine) or shape is None or n != 1 or append is not None:
            return None
        d = _dim(dim, len(shape))
        step = dict(value.coefs).get(d, 0)
        if prepend is not None:
            # The first difference is source[0] - prepend: equal to the others only when prepend
            # is the source one step before its start.
            before = Affine.of({k: c for k, c in value.coefs if k != d}, value.const - step)
            if self.value(prepend) != before:
                return None
        return Affine((), step)


def _remap(value: Value, key: Callable[[int], int | None]) -> Value:
    if isinstance(value, bool):
        return value
    if isinstance(value, Compare):
        return Compare(value.affine.remap(key), value.op)
    return value.remap(key)


def mask_kind(mask: Any) -> str | None:
    """``"all_true"`` or ``"causal"`` (``kv <= q`` over the last two dims) when the boolean mask
    node ``mask`` is proved so for every size, else ``None``."""
    value = _Evaluator().value(mask) if isinstance(mask, torch.fx.Node) else None
    if value is True:
        return "all_true"
    if value == CAUSAL:
        return "causal"
    return None
