"""A convert pass: a concatenation of one tensor with empty ones is that tensor.

A key/value cache's first update appends the step's keys to an empty tensor
(``torch.cat([torch.tensor([]), key], dim=-2)`` in Hugging Face's ``DynamicCache``), and torch.export
records it as it is: a copy of the keys into a new contiguous tensor. The copy costs little by
itself, but attention then reads and differentiates keys laid out unlike the ones it would read
without a cache, and backward copies their gradients back: 2.8 ms of a 107 ms GPT-2 step on an
H200 (BENCHMARKS.md). This pass gives the concatenation's users the one tensor that is not empty,
so a default call computes exactly what a call without a cache computes, and the cache holds that
tensor (values equal; a view instead of a copy).

It acts where the graph proves it exact: every other input has no element, shares the kept
tensor's dtype and device, and the output has the kept tensor's shape and dtype (from the
tensors' recorded values, so graphs without them, torch.fx's, are left alone). The constant
empty tensors and their copies go when nothing else reads them.

Example (torch.export front end, the first layer of a GPT-2 default call)::

    before                                              after
    lift_fresh_copy = aten.lift_fresh_copy(lifted_0)    (removed)
    detach_ = aten.detach_(lift_fresh_copy)             (removed)
    cat = aten.cat([detach_, key], -2)                  (removed)
    attention(query, cat, ...)                          attention(query, key, ...)
"""

from __future__ import annotations

import logging

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amp_fx.core.node_info import node_info
from amp_fx.passes.shared.conversion import Conversion, PassResult

logger = logging.getLogger(__name__)

__all__ = ["drop_empty_concats"]

_CONCATS = (torch.ops.aten.cat.default,)


def _value(node: object) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_empty(value: torch.Tensor) -> bool:
    return statically_known_true(value.numel() == 0)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dim() != b.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True))


def _kept_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one input of ``cat`` that is not empty, where the rest change nothing; else None."""
    tensors = node.args[0] if node.args else None
    output = _value(node)
    if not isinstance(tensors, (list, tuple)) or output is None or len(tensors) < 2:
        return None
    values = [_value(t) for t in tensors]
    if any(v is None for v in values):
        return None
    kept = [t for t, v in zip(tensors, values, strict=True) if not _is_empty(v)]
    if len(kept) != 1:
        return None
    value = _value(kept[0])
    if any(v.dtype != value.dtype or v.device != value.device for v in values):
        return None
    if output.dtype != value.dtype or not _same_shape(output, value):
        return None
    return kept[0]


def _erase_unread(nodes: list[torch.fx.Node], graph: torch.fx.Graph) -> None:
    # The empty inputs' producers (a lifted constant, its fresh copy detached in place) read nothing
    # else; they go with their last reader.
    for node in nodes:
        while isinstance(node, torch.fx.Node) and node.op in ("call_function", "get_attr") and not node.users:
            source = node.args[0] if node.args else None
            graph.erase_node(node)
            node = source


def drop_empty_concats(gm: torch.fx.GraphModule, context: Conversion | None = None) -> PassResult:
    """Give users of ``cat([empty..., x, empty...])`` the tensor ``x``; changes ``gm`` in place
    (``modified``: whether it dropped one). It does not read the context.

    Example:
        >>> class Cache(torch.nn.Module):
        ...     def forward(self, key):
        ...         return torch.cat([torch.tensor([]), key.transpose(0, 1)], dim=-2) * 2
        >>> gm = torch.export.export(Cache(), (torch.randn(3, 4),)).module()
        >>> "cat" in gm.code, "cat" in drop_empty_concats(gm).graph_module.code
        (True, False)
    """
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CONCATS:
            continue
        kept = _kept_input(node)
        if kept is None:
            continue
        others = [t for t in node.args[0] if t is not kept]
        node.replace_all_uses_with(kept)
        gm.graph.erase_node(node)
        _erase_unread(others, gm.graph)
        node_info(kept).notes.append("kept in place of its concatenation with empty tensors")
        dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    logger.debug("drop_empty_concats: %d concatenations with empty tensors dropped", dropped)
    return PassResult(gm, bool(dropped))
