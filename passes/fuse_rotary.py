"""A convert pass (O2): rotary position embeddings as one call.

A rotary embedding written in torch, ``q * cos + rotate_half(q) * sin``, is six elementwise ops per
tensor each way; at O2 its products run in fp32 (fp32 cos and sin against fp16/bf16 q) and write
fp32 intermediates of q's size. `amp_fx.ops.rotary.rotary_embedding` computes the same fp32 math
in one kernel that reads q in its own dtype and writes the result once. This pass finds the chain
by what it computes, in graphs of either front end (canonical op names from `normalize_ops`), and
replaces it, from the tensor rotated to the output, with one call:

    x * cos + rotate_half(x) * sin                         (products and the sum in any order)
        rotate_half(x) = cat((-x2, x1), -1), where x1, x2 are x's halves along its last dimension:
        x[..., :h] and x[..., h:] (indexing, ``slice``, ``narrow``), ``x.chunk(2, -1)`` or
        ``x.split(h, -1)`` (``split_with_sizes`` in ATen), with h proved to be half of x's width
        (a static shape, or the graph's own ``x.shape[-1] // 2``)
        or interleaved, rotate_every_two(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    cat((rotary(q[..., :r]), q[..., r:]), -1)              partial rotary (GPT-NeoX, Phi, GPT-J)

with the casts amp_fx inserted around it: a widening cast of the passed-through features before
the concatenation, and the cast of the result to the low dtype (its one user) folded into the call
(``dtype=``). Every intermediate must be read only by the chain; anything else (a wrong slice or
sign, a slice another op reads, a non-tensor cos) leaves the chain as it is. Where shapes are
known (the torch.export front end) cos and sin must also fit the kernel (the rotated width, and
broadcast to q without enlarging it); where they are not (torch.fx without example inputs)
`rotary_embedding` checks that at run time and computes the chain op by op when they do not.

Two fused calls that share cos and sin (a layer's query and key) become one
`amp_fx.ops.rotary.rotary_embedding_pair` call where the graph's order allows it: one kernel launch
each way for both, each position's table row read once.

It runs where ``policy.fused_rotary`` (default: O2, on every device: on CPU the call runs the
kernels' torch reference). Each fused call records the nodes it replaced in its report notes.

Example (O2, bf16; Llama's attention, torch.export front end; k's chain, the same on transpose_1
with no cast after it (the KV cache keeps fp32, as under autocast), pairs with q's)::

    before                                          after
    mul_5 = aten.mul(transpose, unsqueeze_14)
    slice_1 = aten.slice(transpose, 3, 0, 4)
    slice_2 = aten.slice(transpose, 3, 4, 2**63 - 1)
    neg = aten.neg(slice_2)
    cat_1 = aten.cat([neg, slice_1], -1)
    mul_6 = aten.mul(cat_1, unsqueeze_15)
    add_4 = aten.add(mul_5, mul_6)                  pair = rotary_embedding_pair(transpose, transpose_1,
    ... k's chain: add_5 ...                            unsqueeze_14, unsqueeze_15, interleaved=False,
                                                        dtypes=(torch.bfloat16, None))
                                                    getitem = pair[0]; getitem_1 = pair[1]
    add_4_to_bfloat16 = add_4.to(torch.bfloat16)    (its users read getitem, add_5's read getitem_1)
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch
import torch.fx

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES, dtype_name
from amp_fx.core.node_info import FX_WRAPPED_KEY, META_KEY, NodeInfo, node_info
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.rotary import rotary_embedding, rotary_embedding_pair, tables_fit
from amp_fx.passes.shared.calls import call_argument
from amp_fx.passes.shared.dtypes import dtype_is_assumed, is_exact_widening

logger = logging.getLogger(__name__)

__all__ = ["fuse_rotary"]

# A slice's stop at or past this is "to the end" (torch.export writes 2**63 - 1).
_TO_THE_END = 2**62
_SLICE_OPS = ("slice", "getitem", "narrow")
# The integer arithmetic torch.fx records for a slice bound (``x.shape[-1] // 2``).
_SIZE_OPS = ("floor_divide", "getitem", "shape", "size")
# Metadata of the replaced output the fused call keeps (its layer, for checkpoint_regions; its
# fake value, for passes that read shapes).
_KEPT_META = ("nn_module_stack", "stack_trace", "val", "tensor_meta")


@dataclasses.dataclass
class _Chain:
    """A matched rotary chain: the call's arguments and the nodes it replaces."""

    x: torch.fx.Node
    cos: torch.fx.Node
    sin: torch.fx.Node
    interleaved: bool
    chunked: bool
    nodes: list[torch.fx.Node]  # every replaced node; the last one's value is the call's
    rotary_dim: Any = None
    dtype: torch.dtype | None = None


def _value(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _width(node: torch.fx.Node) -> int | None:
    value = _value(node)
    return value.shape[-1] if value is not None and isinstance(value.shape[-1], int) else None


def _is_last_dim(tensor: torch.fx.Node, dim: Any) -> bool:
    if dim == -1:
        return True
    value = _value(tensor)
    return value is not None and isinstance(dim, int) and dim == value.dim() - 1


def _op(node: Any) -> str | None:
    return node_info(node).op if isinstance(node, torch.fx.Node) else None


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
            all(s == slice(None) for s in leading) and _is_last_dim(x, len(leading))
        )
        if not last:
            return None
        start, stop, step = index[-1].start, index[-1].stop, index[-1].step
    elif op == "slice":
        dim = call_argument(node, 1, "dim", 0)
        start, stop, step = (
            call_argument(node, i, k, d) for i, k, d in ((2, "start", None), (3, "end", None), (4, "step", 1))
        )
        if not _is_last_dim(x, dim):
            return None
    else:  # narrow(x, dim, start, length)
        dim, start, length = (call_argument(node, i, k) for i, k in ((1, "dim"), (2, "start"), (3, "length")))
        if not _is_last_dim(x, dim) or not isinstance(start, int) or not isinstance(length, int):
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
        fits = call_argument(split, 1, "chunks") == 2 and _is_last_dim(x, call_argument(split, 2, "dim", 0))
        return (x, True, [split, first, second]) if fits else None
    if _op(split) in ("split", "split_with_sizes"):
        size = call_argument(split, 1, "split_size_or_sections", call_argument(split, 1, "split_size"))
        sizes = size if isinstance(size, (list, tuple)) else (size, size)
        fits = (
            len(sizes) == 2
            and _same_half(sizes[0], sizes[1], x)
            and _is_last_dim(x, call_argument(split, 2, "dim", 0))
        )
        return (x, False, [split, first, second]) if fits else None
    return None


def _tensors_and_dim(node: torch.fx.Node) -> tuple[Any, Any]:
    return call_argument(node, 0, "tensors"), call_argument(node, 1, "dim", 0)


def _negated(node: Any) -> torch.fx.Node | None:
    return node.args[0] if _op(node) == "neg" and len(node.args) == 1 and not node.kwargs else None


def _rotated(node: Any) -> tuple[torch.fx.Node, bool, bool, list[torch.fx.Node]] | None:
    """(x, interleaved, chunked, nodes) when ``node`` is rotate_half(x) or rotate_every_two(x)."""
    op = _op(node)
    if op == "cat":
        tensors, dim = _tensors_and_dim(node)
        if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
            return None
        negated = _negated(tensors[0])
        halves = _halves(tensors[1], negated) if negated is not None else None
        if halves is None or not _is_last_dim(halves[0], dim):
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
        odd, even = _last_dim_slice(_negated(tensors[0])), _last_dim_slice(tensors[1])
        if (
            odd is None
            or even is None
            or odd[0] is not even[0]
            or odd[1:] != (1, None, 2)
            or even[1:] != (0, None, 2)
        ):
            return None
        x = odd[0]
        value = _value(x)
        if start != -2 and not (value is not None and start == value.dim() - 1):
            return None
        return x, True, False, [tensors[0].args[0], tensors[0], tensors[1], stack, node]
    return None


def _products(node: Any) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    if _op(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    return (a, b) if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) else None


def _match_rotary(add: torch.fx.Node) -> _Chain | None:
    """The chain ``x * cos + rotate(x) * sin`` ending at ``add``, or None."""
    if _op(add) != "add" or len(add.args) != 2 or add.kwargs:
        return None
    for straight, turned in (add.args, add.args[::-1]):
        plain, rotated = _products(straight), _products(turned)
        if plain is None or rotated is None:
            continue
        for rot_node, sin in (rotated, rotated[::-1]):
            match = _rotated(rot_node)
            if match is None:
                continue
            x, interleaved, chunked, nodes = match
            if x not in plain or plain[0] is plain[1]:
                continue
            cos = plain[1] if plain[0] is x else plain[0]
            replaced = [straight, *nodes, turned, add]
            return _Chain(x, cos, sin, interleaved, chunked, replaced)
    return None


def _widened_source(node: Any) -> Any:
    """The value under amp_fx's exact widening cast ``node`` (the passed-through features of a
    partial rotary cast to fp32 for the concatenation), else ``node`` itself."""
    info = node_info(node) if isinstance(node, torch.fx.Node) else None
    if info is None or not info.is_cast or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return node
    source = node_info(node.args[0]).out_dtype
    return node.args[0] if source is not None and is_exact_widening(source, info.out_dtype) else node


def _extend_to_partial(chain: _Chain) -> None:
    """Take in ``cat((chain(q[..., :r]), q[..., r:]), -1)``: then q is rotated with rotary_dim r."""
    add = chain.nodes[-1]
    rotated = _last_dim_slice(chain.x)
    if rotated is None or len(add.users) != 1:
        return
    q, start, r, step = rotated
    cat = next(iter(add.users))
    tensors, dim = _tensors_and_dim(cat) if _op(cat) == "cat" else (None, None)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or tensors[0] is not add:
        return
    passed = _widened_source(tensors[1])
    rest = _last_dim_slice(passed)
    if start != 0 or step != 1 or r is None or rest is None or rest[0] is not q or rest[1:] != (r, None, 1):
        return
    if not _is_last_dim(q, dim):
        return
    casts = [tensors[1]] if tensors[1] is not passed else []
    chain.nodes = [chain.x, passed, *casts, *chain.nodes, cat]
    chain.x, chain.rotary_dim = q, r


def _read_for(node: torch.fx.Node, inside: set[torch.fx.Node]) -> bool:
    """Whether ``node``'s value goes only into ``inside``, directly or through size arithmetic
    (torch.fx's ``x.shape[-1] // 2`` for a slice of the chain)."""
    return node in inside or (_op(node) in _SIZE_OPS and all(_read_for(u, inside) for u in node.users))


def _only_read_inside(chain: _Chain) -> bool:
    """Every replaced node but the last is read only by replaced nodes (or their slice bounds)."""
    inside = set(chain.nodes)
    return all(_read_for(user, inside) for node in chain.nodes[:-1] for user in node.users)


def _fold_output_cast(chain: _Chain) -> None:
    """Take in amp_fx's cast of the result to the low dtype when it is the result's one user and
    the chain computes in float32 (O2's products against fp32 cos and sin): rounding the float32
    result once to the cast's dtype is what the chain and its cast do."""
    end = chain.nodes[-1]
    cast = next(iter(end.users)) if len(end.users) == 1 else None
    if cast is None or not node_info(cast).is_cast or len(cast.args) != 2:
        return
    if (
        node_info(end).out_dtype == torch.float32
        and not dtype_is_assumed(end)
        and cast.args[1] in LOW_PRECISION_DTYPES
    ):
        chain.nodes.append(cast)
        chain.dtype = cast.args[1]


def _fits_statically(chain: _Chain) -> bool:
    """False where known shapes show cos and sin do not fit the kernel (unknown shapes: checked at
    run time by `rotary_embedding`)."""
    x, cos, sin = (_value(n) for n in (chain.x, chain.cos, chain.sin))
    if x is None or cos is None or sin is None:
        return True
    try:
        return tables_fit(x.shape, cos.shape, sin.shape, chain.rotary_dim)
    except (RuntimeError, TypeError):  # symbolic sizes not comparable here: the call checks at run time
        return True


def _match(add: torch.fx.Node) -> _Chain | None:
    chain = _match_rotary(add)
    if chain is None:
        return None
    _extend_to_partial(chain)
    if not _only_read_inside(chain):
        return None
    _fold_output_cast(chain)
    return chain if _fits_statically(chain) else None


def _replace(gm: torch.fx.GraphModule, chain: _Chain) -> torch.fx.Node:
    last = chain.nodes[-1]
    kwargs: dict[str, Any] = {"interleaved": chain.interleaved}
    if chain.chunked:
        kwargs["chunked"] = True
    if chain.rotary_dim is not None:
        kwargs["rotary_dim"] = chain.rotary_dim
    if chain.dtype is not None:
        kwargs["dtype"] = chain.dtype
    with gm.graph.inserting_before(last):
        fused = gm.graph.call_function(rotary_embedding, (chain.x, chain.cos, chain.sin), kwargs)
    fused.meta.update({key: last.meta[key] for key in _KEPT_META if key in last.meta})
    fused.meta[FX_WRAPPED_KEY] = True
    out_dtype = node_info(last).out_dtype
    x_dtype = node_info(chain.x).out_dtype
    reads = dtype_name(x_dtype) if x_dtype is not None else "its"
    writes = dtype_name(out_dtype) if out_dtype is not None else "the chain's dtype"
    form = "interleaved pairs" if chain.interleaved else "rotate_half"
    if chain.rotary_dim is not None:
        form += f", first {getattr(chain.rotary_dim, 'name', chain.rotary_dim)} features rotated"
    replaced = ", ".join(node.name for node in chain.nodes)
    note = (
        f"fused rotary embedding ({form}): replaces {replaced} with one call "
        f"(amp_fx.ops.rotary.rotary_embedding): reads {reads} {chain.x.name}, computes in float32, "
        f"writes {writes}"
    )
    fused.meta[META_KEY] = NodeInfo(
        op="rotary_embedding",
        rule=Rule.PASSTHROUGH,
        reason="fused rotary embedding (fused_rotary)",
        in_dtypes=tuple(node_info(n).out_dtype for n in fused.all_input_nodes),
        out_dtype=out_dtype,
        notes=[note],
    )
    last.replace_all_uses_with(fused)
    _erase_with_their_sizes(gm, chain.nodes)
    return fused


def _erase_with_their_sizes(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
    """Erase ``nodes`` and the size arithmetic (``x.shape[-1] // 2``) nothing else reads, users first."""
    pending = set(nodes)
    pending |= {user for node in nodes for user in node.users if _op(user) in _SIZE_OPS}
    pending |= {a for node in nodes for a in node.all_input_nodes if _op(a) in _SIZE_OPS}
    while pending:
        free = [node for node in pending if not node.users]
        if not free:
            break  # size nodes something else still reads stay (they read no erased node's value)
        for node in free:
            pending.discard(node)
            pending |= {a for a in node.all_input_nodes if _op(a) in _SIZE_OPS}
            gm.graph.erase_node(node)


def fuse_rotary(gm: torch.fx.GraphModule, policy: Policy) -> torch.fx.GraphModule:
    """Replace rotary-embedding chains with `rotary_embedding` calls; returns `gm`.

    Example::

        >>> from torch import nn
        >>> from amp_fx import convert
        >>> def rotate_half(x):
        ...     return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)
        >>> class Rope(nn.Module):
        ...     def forward(self, q, cos, sin):
        ...         return q * cos + rotate_half(q) * sin
        >>> gm = convert(Rope(), "O2", dtype=torch.bfloat16)  # calls this pass
        >>> [n.name for n in gm.graph.nodes if n.op == "call_function"]
        ['q_to_bfloat16', 'cos_to_bfloat16', 'sin_to_bfloat16', 'rotary_embedding', 'add_to_float32']
    """
    if not policy.fused_rotary:
        return gm
    calls: list[torch.fx.Node] = []
    erased: set[torch.fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or _op(node) != "add":
            continue
        chain = _match(node)
        if chain is not None:
            erased.update(chain.nodes)
            calls.append(_replace(gm, chain))
    paired = _pair_calls(gm, calls)
    if calls:
        gm.recompile()
    logger.debug(
        "fuse_rotary %s: %d rotary embeddings fused, %d query/key pairs", policy.opt_level, len(calls), paired
    )
    return gm


def _pair_key(call: torch.fx.Node) -> tuple[Any, ...]:
    """What two calls must share to run as one pair: cos, sin and every option but the dtype."""
    options = tuple(sorted((k, v) for k, v in call.kwargs.items() if k != "dtype"))
    return (call.args[1], call.args[2], options)


def _pair_calls(gm: torch.fx.GraphModule, calls: list[torch.fx.Node]) -> int:
    """Merge calls that share cos and sin (a layer's query and key) two by two into one
    `rotary_embedding_pair` call at the later one's place, where nothing reads the earlier one's
    result before it. Returns the number of pairs."""
    waiting: dict[tuple[Any, ...], torch.fx.Node] = {}
    paired = 0
    for call in calls:
        key = _pair_key(call)
        first = waiting.pop(key, None)
        if first is None:
            waiting[key] = call
            continue
        # Positions as the graph stands (each merge inserts nodes). A call sits at its chain's last
        # node (the query's at the cast before attention, after the key's): the pair goes at the
        # earlier call if the later one's inputs exist there, else at the later one if nothing
        # reads the earlier one's result before it.
        position = {node: index for index, node in enumerate(gm.graph.nodes)}
        early, late = sorted((first, call), key=position.__getitem__)
        if all(position[value] < position[early] for value in late.all_input_nodes):
            place = early
        elif all(position[user] > position[late] for user in early.users):
            place = late
        else:
            waiting[key] = call
            continue
        _merge(gm, first, call, place)
        paired += 1
    return paired


def _merge(
    gm: torch.fx.GraphModule, first: torch.fx.Node, second: torch.fx.Node, place: torch.fx.Node
) -> None:
    """One `rotary_embedding_pair` call for ``first`` and ``second``, inserted before ``place``."""
    options = {k: v for k, v in first.kwargs.items() if k != "dtype"}
    dtypes = (first.kwargs.get("dtype"), second.kwargs.get("dtype"))
    with gm.graph.inserting_before(place):
        pair = gm.graph.call_function(
            rotary_embedding_pair,
            (first.args[0], second.args[0], *first.args[1:]),
            {**options, "dtypes": dtypes},
        )
        outputs = [gm.graph.call_function(operator.getitem, (pair, index)) for index in (0, 1)]
    pair.meta.update({key: second.meta[key] for key in _KEPT_META if key in second.meta and key != "val"})
    pair.meta[FX_WRAPPED_KEY] = True
    if "val" in first.meta and "val" in second.meta:
        pair.meta["val"] = (first.meta["val"], second.meta["val"])
    pair.meta[META_KEY] = NodeInfo(
        op="rotary_embedding",
        rule=Rule.PASSTHROUGH,
        reason="fused rotary embedding (fused_rotary)",
        in_dtypes=tuple(node_info(n).out_dtype for n in pair.all_input_nodes),
        notes=[f"{first.name} and {second.name} share cos and sin: rotated in one launch each way"],
    )
    for call, output in zip((first, second), outputs, strict=True):
        output.meta.update({key: call.meta[key] for key in _KEPT_META if key in call.meta})
        output.meta[META_KEY] = node_info(call)
        call.replace_all_uses_with(output)
        gm.graph.erase_node(call)
