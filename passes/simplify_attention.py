"""A convert pass (graphs of the torch.export front end): the SDPA calls eager code makes.

Traced, transformers cannot ask whether a mask is needed (that would read a tensor's value), so
it always builds one, and with a mask it repeats the key and value heads of grouped-query
attention itself. Eagerly, a decoder called without a padding mask passes no mask,
``is_causal=True`` and ``enable_gqa=True``, and ViT's bidirectional attention passes no mask at
all; traced, GPT-2 and Llama get a materialised ``(batch, 1, q, kv)`` boolean mask, Llama's key
and value come repeated to the query's head count, and ViT gets ``arange(n) >= 0``, all True.
So the captured graph ran masked cuDNN attention, whose backward took 2.8x the causal kernel's on
an H200, kept the repeated key and value for the backward (1.1 GB more than autocast for a 0.67B
Llama at 8 x 2048), and was not bit-identical to eager autocast on CUDA. This pass:

- proves from how a boolean mask is built that it is True everywhere (then drops it) or is
  exactly the causal lower triangle ``kv <= q`` (then drops it and sets ``is_causal=True``,
  SDPA's top-left aligned triangle for any ``q, kv``); masks that read an input (padding), shift
  the diagonal or add a window are left alone;
- where the call then has no mask, gives SDPA the key and value from before transformers'
  ``repeat_kv`` (each head repeated in place: ``x[:, :, None].expand(...).reshape(...)``) with
  ``enable_gqa=True``, which repeats them the same way inside the kernel.

The result is the same for every size the graph runs at.

The proof is an abstract evaluation of the mask's nodes. An integer tensor is known when it is
affine in its element's indices, ``const + sum(coef[d] * index[d])`` (``arange``, ``+``, ``-``,
shape ops, ``cumsum`` of a constant, ``diff`` of an affine tensor, ``index`` by affine indices); a
boolean tensor when it is a constant or ``affine <= 0``, ``== 0`` or ``!= 0``. Indices are never
negative and, where a size is an int (a static graph), below it: a comparison those bounds
decide is a constant.
Dimensions are counted from the right, as broadcasting aligns them.

Example::

    >>> class Decoder(torch.nn.Module):
    ...     def forward(self, q):
    ...         pos = torch.arange(q.shape[-2])
    ...         causal = (pos[None, :] <= pos[:, None])[None, None]
    ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=causal)
    >>> gm = torch.export.export(Decoder(), (torch.randn(2, 1, 4, 8),), strict=False).module()
    >>> simplify_attention(gm).graph.find_nodes(op="call_function", target=SDPA)[0].args[3:6]
    (None, 0.0, True)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amp_fx.passes.shared.calls import call_argument

logger = logging.getLogger(__name__)

__all__ = ["simplify_attention", "mask_kind", "repeated_heads", "SDPA"]

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_MASK_INDEX, _DROPOUT_INDEX, _CAUSAL_INDEX = 3, 4, 5


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


def _shape(node: torch.fx.Node) -> tuple[Any, ...] | None:
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
_SAME_VALUE = {aten.clone.default, aten.contiguous.default, aten.alias.default}
_VIEWS = _SAME_VALUE | {
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
        shape, meta = _shape(node), node.meta.get("val")
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
        value, source = self.value(args[0]), _shape(args[0])
        if value is None or source is None:
            return None
        rank = len(source) + 1
        at = args[1] + rank if args[1] < 0 else args[1]
        # Dimensions left of the new one move one further from the right.
        return _remap(value, lambda d: d - 1 if d + len(source) < at else d)

    def _slice(self, args: tuple[Any, ...]) -> Value | None:
        value, source = self.value(args[0]), _shape(args[0])
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
        value, source = self.value(args[0]), _shape(args[0])
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
        source, source_shape = self.value(source_node), _shape(source_node)
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
        value, shape = self.value(source), _shape(source)
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


def _erase_unused(node: torch.fx.Node) -> None:
    # Erase what only the mask or the repeat read; `_and`/`_or` may decide from one operand, so
    # the other's nodes were never evaluated: an impure one stays.
    stack, erased = [node], set()
    while stack:
        current = stack.pop()
        if (
            current not in erased
            and current.op == "call_function"
            and not current.users
            and not current.is_impure()
        ):
            stack.extend(current.all_input_nodes)
            current.graph.erase_node(current)
            erased.add(current)


def _simplify_mask(node: torch.fx.Node) -> str | None:
    """Drop the mask of the SDPA call `node` if it is all True or causal (then ``is_causal``); the kind."""
    mask = call_argument(node, _MASK_INDEX, "attn_mask", None)
    value = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    kind = mask_kind(mask)
    if kind is None or call_argument(node, _CAUSAL_INDEX, "is_causal", False):
        return None
    args = list(node.args[:_MASK_INDEX]) + [None, call_argument(node, _DROPOUT_INDEX, "dropout_p", 0.0)]
    args.append(kind == "causal")
    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
    node.args, node.kwargs = tuple(args) + tuple(node.args[_CAUSAL_INDEX + 1 :]), kwargs
    _erase_unused(mask)
    return kind


# ---------------------------------------------------------------------------------------------
# Grouped-query attention: transformers' repeat_kv,
# x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)
# ---------------------------------------------------------------------------------------------
_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def _whole_slice(node: torch.fx.Node) -> bool:
    args = list(node.args) + [None] * (5 - len(node.args))
    source, dim, start, end, step = args[0], args[1] or 0, args[2], args[3], args[4]
    shape = _shape(source) if isinstance(source, torch.fx.Node) else None
    if shape is None or start not in (None, 0) or step not in (None, 1):
        return False
    size = shape[dim]
    return end is None or (isinstance(end, int) and (end >= torch.iinfo(torch.int64).max or end == size))


def _skip_identities(node: Any) -> Any:
    """`node` seen through whole slices and copies (``x[:, :]``, ``contiguous``)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if (node.target is aten.slice.Tensor and _whole_slice(node)) or (
            node.target in _SAME_VALUE and len(node.args) == 1 and not node.kwargs
        ):
            node = node.args[0]
        else:
            break
    return node


def repeated_heads(node: Any) -> tuple[torch.fx.Node, int] | None:
    """``(x, n)`` when `node` is ``x`` of shape (b, h, s, d) with each head repeated ``n`` times in
    place, heads ``0, 0, 1, 1, ...`` (what SDPA's ``enable_gqa`` does), else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _RESHAPES):
        return None
    expand = _skip_identities(node.args[0])
    if not (isinstance(expand, torch.fx.Node) and expand.target is aten.expand.default):
        return None
    unsqueeze = _skip_identities(expand.args[0])
    if not (isinstance(unsqueeze, torch.fx.Node) and unsqueeze.target is aten.unsqueeze.default):
        return None
    source = _skip_identities(unsqueeze.args[0])
    shapes = [_shape(n) if isinstance(n, torch.fx.Node) else None for n in (source, expand, node)]
    if unsqueeze.args[1] not in (2, -3) or [len(s) if s else 0 for s in shapes] != [4, 5, 4]:
        return None
    (b, h, s, d), (b2, h2, n, s2, d2), out = shapes
    if not (isinstance(h, int) and isinstance(n, int) and out[1] == h * n):
        return None
    if not all(
        statically_known_true(x == y)
        for x, y in ((b, b2), (b, out[0]), (h, h2), (s, s2), (s, out[2]), (d, d2), (d, out[3]))
    ):
        return None
    return source, n


def _use_grouped_heads(node: torch.fx.Node) -> bool:
    """Give the SDPA call `node` its key and value before repeat_kv, with ``enable_gqa=True``."""
    if call_argument(node, _MASK_INDEX, "attn_mask", None) is not None or node.kwargs.get("enable_gqa"):
        return False  # eager transformers uses enable_gqa only without a mask (the fused kernels)
    key, value = repeated_heads(node.args[1]), repeated_heads(node.args[2])
    if key is None or value is None or key[1] != value[1]:
        return False
    repeated = node.args[1:3]
    node.args = (node.args[0], key[0], value[0], *node.args[3:])
    node.kwargs = {**node.kwargs, "enable_gqa": True} if key[1] > 1 else dict(node.kwargs)
    for tensor in repeated:
        _erase_unused(tensor)
    return True


def simplify_attention(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Make the graph's SDPA calls the ones eager code makes: all-True masks dropped, causal masks
    as ``is_causal=True``, repeated key/value heads as ``enable_gqa=True``; returns ``gm``."""
    changed = {"all_true": 0, "causal": 0, "grouped": 0}
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        kind = _simplify_mask(node)
        if kind is not None:
            changed[kind] += 1
        changed["grouped"] += _use_grouped_heads(node)
    if any(changed.values()):
        gm.recompile()
        logger.debug(
            "attention: %(all_true)d all-True masks dropped, %(causal)d made is_causal, %(grouped)d with "
            "enable_gqa",
            changed,
        )
    return gm
