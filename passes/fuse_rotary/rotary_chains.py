"""Rotary position embeddings as graphs spell them, found by what they compute: `match_rotary_chain`.

One description serves both front ends: nodes are matched by their canonical op
(``node_info(node).op``, set by `normalize_ops`). A rotary chain is::

    x * cos + rotate_half(x) * sin                         (products and the sum in any order)
        rotate_half(x) = cat((-x2, x1), -1), where x1, x2 are x's halves along its last dimension:
        x[..., :h] and x[..., h:] (indexing, ``slice``, ``narrow``), ``x.chunk(2, -1)`` or
        ``x.split(h, -1)`` (``split_with_sizes`` in ATen), with h proved to be half of x's width
        (a static shape, or the graph's own ``x.shape[-1] // 2``)
        or interleaved, rotate_every_two(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    cat((rotary(q[..., :r]), q[..., r:]), -1)              partial rotary (GPT-NeoX, Phi, GPT-J)

with the casts amp_fx inserted around it: a widening cast of the passed-through features before
the concatenation, and the cast of the result to the low dtype (its one user), which the fused
call takes in (``dtype=``) where the chain computes in float32. Every intermediate must be read
only by the chain (or by the size arithmetic of its slice bounds), and every op must be a plain
call (no in-place update, no extra argument); anything else (a wrong slice or sign, a slice
another op reads, a non-tensor cos) is no match. Where shapes are known (the torch.export front
end) cos and sin must also fit the kernel (`amp_fx.ops.rotary.tables_fit`: the rotated width,
and broadcast to q without enlarging it); where they are not, `rotary_embedding` checks that at
run time.

    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> def rope(q, cos, sin):  # q's width unknown: the halves are its own shape[-1] // 2
    ...     half = q.shape[-1] // 2
    ...     return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
    >>> gm = normalize_ops(torch.fx.symbolic_trace(rope)).graph_module
    >>> chain = match_rotary_chain(list(gm.graph.nodes)[-2], gm)
    >>> chain.x.name, chain.interleaved, len(chain.nodes)
    ('q', False, 7)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.node_info import node_info
from amp_fx.ops.rotary import tables_fit
from amp_fx.passes.shared.call_nodes import call_argument
from amp_fx.passes.shared.cast_walk import is_amp_fx_cast, under_casts
from amp_fx.passes.shared.dtypes import dtype_is_assumed, is_exact_widening
from amp_fx.passes.shared.op_patterns import (
    Op,
    Var,
    call_operands,
    is_last_dim,
    matches,
    only_user,
    read_only_inside,
    tensor_value,
)

__all__ = ["SIZE_OPS", "RotaryChain", "match_rotary_chain"]

# A slice's stop at or past this is "to the end" (torch.export writes 2**63 - 1).
_TO_THE_END = 2**62
_SLICE_OPS = ("slice", "getitem", "narrow")
# The integer arithmetic torch.fx records for a slice bound (``x.shape[-1] // 2``).
SIZE_OPS = ("floor_divide", "getitem", "shape", "size")


@dataclasses.dataclass
class RotaryChain:
    """A matched rotary chain: the fused call's arguments and the nodes it replaces."""

    x: torch.fx.Node
    cos: torch.fx.Node
    sin: torch.fx.Node
    interleaved: bool
    chunked: bool
    nodes: list[torch.fx.Node]  # every replaced node; the last one's value is the call's
    rotary_dim: Any = None
    dtype: torch.dtype | None = None  # the low dtype of the cast taken in


def _op(node: Any) -> str | None:
    return node_info(node).op if isinstance(node, torch.fx.Node) else None


def _width(node: torch.fx.Node) -> int | None:
    value = tensor_value(node)
    return value.shape[-1] if value is not None and isinstance(value.shape[-1], int) else None


def _last_dim_slice(node: Any) -> tuple[torch.fx.Node, Any, Any, int] | None:
    """(x, start, stop, step) for ``x[..., start:stop:step]`` spelled as indexing, ``slice`` or
    ``narrow`` along x's last dimension; start 0 for none, stop None for "to the end"."""
    op = _op(node)
    if op not in _SLICE_OPS or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    x = node.args[0]
    if op == "getitem":
        index = node.args[1] if len(node.args) == 2 else None
        if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
            return None
        leading = index[:-1]
        last = leading == (Ellipsis,) or (
            all(s == slice(None) for s in leading) and is_last_dim(x, len(leading))
        )
        if not last:
            return None
        start, stop, step = index[-1].start, index[-1].stop, index[-1].step
    elif op == "slice":
        dim = call_argument(node, 1, "dim", 0)
        start, stop, step = (
            call_argument(node, i, k, d) for i, k, d in ((2, "start", None), (3, "end", None), (4, "step", 1))
        )
        if not is_last_dim(x, dim):
            return None
    else:  # narrow(x, dim, start, length)
        dim, start, length = (call_argument(node, i, k) for i, k in ((1, "dim"), (2, "start"), (3, "length")))
        if not is_last_dim(x, dim) or not isinstance(start, int) or not isinstance(length, int):
            return None
        stop, step = start + length, 1
    if isinstance(stop, int) and stop >= _TO_THE_END:
        stop = None
    return x, 0 if start is None else start, stop, 1 if step is None else step


def _is_width_of(node: Any, x: torch.fx.Node) -> bool:
    """``x.shape[-1]`` or ``x.size(-1)`` in the graph (torch.fx's spelling of x's width)."""
    op = _op(node)
    if op == "size":
        return node.args[:1] == (x,) and call_argument(node, 1, "dim") == -1
    if op == "getitem" and len(node.args) == 2 and node.args[1] == -1:
        source = node.args[0]
        return (_op(source) == "shape" and source.args[:1] == (x,)) or (
            _op(source) == "size" and source.args[:1] == (x,) and len(source.args) == 1 and not source.kwargs
        )
    return False


def _is_half_of(h: Any, x: torch.fx.Node) -> bool:
    """Whether ``h`` is half of x's width: an int where x's width is known, or ``width // 2``."""
    if isinstance(h, int) and not isinstance(h, bool):
        return _width(x) == 2 * h
    return _op(h) == "floor_divide" and len(h.args) == 2 and h.args[1] == 2 and _is_width_of(h.args[0], x)


def _same_half(a: Any, b: Any, x: torch.fx.Node) -> bool:
    return (a == b if isinstance(a, int) else True) and _is_half_of(a, x) and _is_half_of(b, x)


def _halves(first: Any, second: Any) -> tuple[torch.fx.Node, bool, list[torch.fx.Node]] | None:
    """(x, chunked, nodes) when ``first`` and ``second`` are x's two halves, in that order."""
    one, two = _last_dim_slice(first), _last_dim_slice(second)
    if one is not None and two is not None:
        (x, start1, stop1, step1), (x2, start2, stop2, step2) = one, two
        if x is not x2 or step1 != 1 or step2 != 1 or start1 != 0 or stop2 not in (None, _width(x)):
            return None
        return (x, False, [first, second]) if _same_half(stop1, start2, x) else None
    # getitem(chunk(x, 2, -1), 0|1) or getitem(split(x, h, -1), 0|1): both halves of one split.
    if not all(_op(n) == "getitem" and len(n.args) == 2 for n in (first, second)):
        return None
    split = first.args[0]
    if split is not second.args[0] or (first.args[1], second.args[1]) != (0, 1) or len(split.users) != 2:
        return None
    if not split.args or not isinstance(split.args[0], torch.fx.Node):
        return None
    x = split.args[0]
    if _op(split) == "chunk":
        fits = call_argument(split, 1, "chunks") == 2 and is_last_dim(x, call_argument(split, 2, "dim", 0))
        return (x, True, [split, first, second]) if fits else None
    if _op(split) in ("split", "split_with_sizes"):
        size = call_argument(split, 1, "split_size_or_sections", call_argument(split, 1, "split_size"))
        sizes = size if isinstance(size, (list, tuple)) else (size, size)
        fits = (
            len(sizes) == 2
            and _same_half(sizes[0], sizes[1], x)
            and is_last_dim(x, call_argument(split, 2, "dim", 0))
        )
        return (x, False, [split, first, second]) if fits else None
    return None


def _tensors_and_dim(node: torch.fx.Node) -> tuple[Any, Any]:
    return call_argument(node, 0, "tensors"), call_argument(node, 1, "dim", 0)


def _negated(node: Any, gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    operands = call_operands(node, gm, "neg", 1)
    return operands[0] if operands is not None else None


# (x, interleaved, chunked, the nodes of the rotation)
_Rotation = tuple[torch.fx.Node, bool, bool, list[torch.fx.Node]]


def _rotated(node: Any, gm: torch.fx.GraphModule) -> _Rotation | None:
    """(x, interleaved, chunked, nodes) when ``node`` is rotate_half(x) or rotate_every_two(x)."""
    op = _op(node)
    if op == "cat":
        tensors, dim = _tensors_and_dim(node)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
            return None
        negated = _negated(tensors[0], gm)
        halves = _halves(tensors[1], negated) if negated is not None else None
        if halves is None or not is_last_dim(halves[0], dim):
            return None
        x, chunked, nodes = halves
        return x, False, chunked, [*nodes, tensors[0], node]
    if op == "flatten":
        start, end = call_argument(node, 1, "start_dim", 0), call_argument(node, 2, "end_dim", -1)
        stack = node.args[0] if node.args else None
        if _op(stack) != "stack" or end != -1:
            return None
        tensors, dim = _tensors_and_dim(stack)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or dim != -1:
            return None
        odd, even = _last_dim_slice(_negated(tensors[0], gm)), _last_dim_slice(tensors[1])
        if (
            odd is None
            or even is None
            or odd[0] is not even[0]
            or odd[1:] != (1, None, 2)
            or even[1:] != (0, None, 2)
        ):
            return None
        x = odd[0]
        value = tensor_value(x)
        if start != -2 and not (value is not None and start == value.dim() - 1):
            return None
        return x, True, False, [tensors[0].args[0], tensors[0], tensors[1], stack, node]
    return None


# x * cos + rotate(x) * sin, the products and the sum in any order.
_ROTARY_SUM = Op(
    "add",
    (
        Op("mul", (Var("x"), Var("cos")), commutative=True),
        Op("mul", (Var("rotated"), Var("sin")), commutative=True),
    ),
    commutative=True,
)


def _match_rotary(add: torch.fx.Node, gm: torch.fx.GraphModule) -> RotaryChain | None:
    """The chain ``x * cos + rotate(x) * sin`` ending at ``add``, or None."""
    for found in matches(_ROTARY_SUM, add, gm, casts=None, closed=False):
        x, cos, sin = found.inputs["x"], found.inputs["cos"], found.inputs["sin"]
        rotation = _rotated(found.inputs["rotated"], gm)
        if rotation is None or rotation[0] is not x or x is cos:
            continue
        _, interleaved, chunked, nodes = rotation
        straight = next(term for term in add.args if set(term.args) == {x, cos})
        turned = next(term for term in add.args if term is not straight)
        return RotaryChain(x, cos, sin, interleaved, chunked, [straight, *nodes, turned, add])
    return None


def _is_exact_widening_cast(cast: torch.fx.Node) -> bool:
    """amp_fx's cast of a value to a dtype that holds it exactly (the passed-through features of a
    partial rotary, cast to fp32 for the concatenation)."""
    source, widened = node_info(cast.args[0]).out_dtype, node_info(cast).out_dtype
    return is_amp_fx_cast(cast) and source is not None and is_exact_widening(source, widened)


def _extend_to_partial(chain: RotaryChain) -> None:
    """Take in ``cat((chain(q[..., :r]), q[..., r:]), -1)``: then q is rotated with rotary_dim r."""
    add = chain.nodes[-1]
    rotated, cat = _last_dim_slice(chain.x), only_user(add)
    if rotated is None or cat is None:
        return
    q, start, r, step = rotated
    tensors, dim = _tensors_and_dim(cat) if _op(cat) == "cat" else (None, None)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or tensors[0] is not add:
        return
    passed, casts = under_casts(tensors[1], _is_exact_widening_cast)
    rest = _last_dim_slice(passed)
    if start != 0 or step != 1 or r is None or rest is None or rest[0] is not q or rest[1:] != (r, None, 1):
        return
    if not is_last_dim(q, dim):
        return
    chain.nodes = [chain.x, passed, *casts, *chain.nodes, cat]
    chain.x, chain.rotary_dim = q, r


def _read_for(node: torch.fx.Node, inside: set[torch.fx.Node]) -> bool:
    """Whether ``node``'s value goes only into ``inside``, directly or through size arithmetic
    (torch.fx's ``x.shape[-1] // 2`` for a slice of the chain)."""
    return node in inside or (_op(node) in SIZE_OPS and all(_read_for(u, inside) for u in node.users))


def _only_read_inside(chain: RotaryChain) -> bool:
    """Every replaced node but the last is read only by replaced nodes (or their slice bounds)."""
    inside = set(chain.nodes)
    return read_only_inside(inside, chain.nodes[-1:], lambda user: _read_for(user, inside))


def _fold_output_cast(chain: RotaryChain) -> None:
    """Take in amp_fx's cast of the result to the low dtype when it is the result's one user and
    the chain computes in float32 (O2's products against fp32 cos and sin): rounding the float32
    result once to the cast's dtype is what the chain and its cast do."""
    end = chain.nodes[-1]
    cast = only_user(end)
    if not is_amp_fx_cast(cast) or len(cast.args) != 2:
        return
    if (
        node_info(end).out_dtype == torch.float32
        and not dtype_is_assumed(end)
        and cast.args[1] in LOW_PRECISION_DTYPES
    ):
        chain.nodes.append(cast)
        chain.dtype = cast.args[1]


def _fits_statically(chain: RotaryChain) -> bool:
    """False where known shapes show cos and sin do not fit the kernel (unknown shapes: checked at
    run time by `rotary_embedding`)."""
    x, cos, sin = (tensor_value(n) for n in (chain.x, chain.cos, chain.sin))
    if x is None or cos is None or sin is None:
        return True
    try:
        return tables_fit(x.shape, cos.shape, sin.shape, chain.rotary_dim)
    except (RuntimeError, TypeError):  # symbolic sizes not comparable here: the call checks at run time
        return True


def match_rotary_chain(add: torch.fx.Node, gm: torch.fx.GraphModule) -> RotaryChain | None:
    """The rotary chain whose sum is ``add`` (partial rotary and the cast after it taken in), or
    None when the graph around it is not exactly one (module docstring)."""
    chain = _match_rotary(add, gm)
    if chain is None:
        return None
    _extend_to_partial(chain)
    if not _only_read_inside(chain):
        return None
    _fold_output_cast(chain)
    return chain if _fits_statically(chain) else None
