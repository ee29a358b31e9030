"""A convert pass (O2): rotary position embeddings as one call.

A rotary embedding written in torch, ``q * cos + rotate_half(q) * sin``, is six elementwise ops per
tensor each way; at O2 its products run in fp32 (fp32 cos and sin against fp16/bf16 q) and write
fp32 intermediates of q's size. `amp_fx.ops.rotary.rotary_embedding` computes the same fp32 math
in one kernel that reads q in its own dtype and writes the result once. This pass finds the chain
by what it computes, in graphs of either front end (`amp_fx.passes.fuse_rotary.rotary_chains`: canonical
op names, rotate_half as slices, ``chunk`` or ``split`` halves or interleaved pairs, partial
rotary, exactly or not at all), and replaces it, from the tensor rotated to the output, with one
call, folding in amp_fx's cast of the result to the low dtype (``dtype=``) where the chain computes
in float32. Where shapes are unknown (torch.fx without example inputs) `rotary_embedding` checks
at run time that cos and sin fit the kernel and computes the chain op by op when they do not.

Two fused calls that share cos and sin (a layer's query and key) become one
`amp_fx.ops.rotary.rotary_embedding_pair` call where the graph's order allows it: one kernel launch
each way for both, each position's table row read once.

It runs where ``policy.fused_rotary`` (default: O2, on every device: on a CPU an eager call
computes the chain's torch expression). Each fused call records the nodes it replaced in its report notes.

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

import logging
import operator
from typing import Any

import torch
import torch.fx

from amp_fx.core.dtypes import dtype_name
from amp_fx.core.node_info import NodeInfo, node_info
from amp_fx.core.policy import Rule
from amp_fx.ops.rotary import rotary_embedding, rotary_embedding_pair
from amp_fx.passes.fuse_rotary.rotary_chains import SIZE_OPS, RotaryChain, match_rotary_chain
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.fused_calls import insert_call, replace_chain

logger = logging.getLogger(__name__)

__all__ = ["fuse_rotary"]

_REASON = "fused rotary embedding (fused_rotary)"


def _replace(gm: torch.fx.GraphModule, chain: RotaryChain) -> torch.fx.Node:
    last = chain.nodes[-1]
    kwargs: dict[str, Any] = {"interleaved": chain.interleaved}
    if chain.chunked:
        kwargs["chunked"] = True
    if chain.rotary_dim is not None:
        kwargs["rotary_dim"] = chain.rotary_dim
    if chain.dtype is not None:
        kwargs["dtype"] = chain.dtype
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
    info = NodeInfo(
        op="rotary_embedding", rule=Rule.PASSTHROUGH, reason=_REASON, out_dtype=out_dtype, notes=[note]
    )
    # The output's layer (for checkpoint_regions) and fake value (for passes that read shapes).
    fused = insert_call(
        gm,
        rotary_embedding,
        (chain.x, chain.cos, chain.sin),
        kwargs,
        before=last,
        info=info,
        inherits=last,
        value=last.meta.get("val"),
        wrapped=True,
    )
    replace_chain(gm, _with_unread_sizes(chain.nodes), {last: fused})
    return fused


def _with_unread_sizes(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """``nodes`` and the size arithmetic (``x.shape[-1] // 2``) that only they read; sizes of the
    last node, whose readers the fused call takes over, read the call."""
    sizes = {user for node in nodes[:-1] for user in node.users if node_info(user).op in SIZE_OPS}
    pending = [a for node in [*nodes, *sizes] for a in node.all_input_nodes if node_info(a).op in SIZE_OPS]
    while pending:
        node = pending.pop()
        if node not in sizes:
            sizes.add(node)
            pending += [a for a in node.all_input_nodes if node_info(a).op in SIZE_OPS]
    chain = set(nodes) | sizes
    # Size nodes something else still reads stay (they read no erased node's value).
    while kept := {node for node in chain & sizes if any(user not in chain for user in node.users)}:
        chain -= kept
    return chain


def fuse_rotary(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Replace rotary-embedding chains with `rotary_embedding` calls, in place on `gm`
    (``modified``: whether it fused one).

    Example::

        >>> from torch import nn
        >>> from amp_fx import convert
        >>> def rotate_half(x):
        ...     return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)
        >>> class Rope(nn.Module):
        ...     def forward(self, q, cos, sin):
        ...         return q * cos + rotate_half(q) * sin
        >>> gm = convert(Rope(), "O2", dtype=torch.bfloat16)  # calls this pass
        >>> [n.name for n in gm.graph.nodes if n.op == "call_function"]  # no lowered op: no casts
        ['rotary_embedding']
    """
    policy = context.policy
    if not policy.fused_rotary:
        return PassResult(gm, False)
    calls: list[torch.fx.Node] = []
    erased: set[torch.fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in erased or node_info(node).op != "add":
            continue
        chain = match_rotary_chain(node, gm)
        if chain is not None:
            erased.update(chain.nodes)
            calls.append(_replace(gm, chain))
    paired = _pair_calls(gm, calls)
    if calls:
        gm.recompile()
    logger.debug(
        "fuse_rotary %s: %d rotary embeddings fused, %d query/key pairs", policy.opt_level, len(calls), paired
    )
    return PassResult(gm, bool(calls))


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
    values = (first.meta.get("val"), second.meta.get("val"))
    note = f"{first.name} and {second.name} share cos and sin: rotated in one launch each way"
    pair = insert_call(
        gm,
        rotary_embedding_pair,
        (first.args[0], second.args[0], *first.args[1:]),
        {**options, "dtypes": dtypes},
        before=place,
        info=NodeInfo(op="rotary_embedding", rule=Rule.PASSTHROUGH, reason=_REASON, notes=[note]),
        inherits=second,
        value=values if None not in values else None,
        wrapped=True,
    )
    outputs = [
        insert_call(
            gm,
            operator.getitem,
            (pair, index),
            before=place,
            info=node_info(call),
            inherits=call,
            value=call.meta.get("val"),
        )
        for index, call in enumerate((first, second))
    ]
    for call, output in zip((first, second), outputs, strict=True):
        replace_chain(gm, [call], {call: output})
