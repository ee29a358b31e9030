"""Pass 2b of convert (graphs of the torch.export front end): drop attention masks that are all True.

Traced, transformers cannot ask whether a mask is needed (that would read a tensor's value), so
it always builds one: ViT's bidirectional attention gets ``arange(n) >= 0`` expanded to
``(batch, 1, n, n)``, all True. Eagerly it passes no mask. SDPA with a mask cannot run the fused
flash or memory-efficient kernels, so the captured graph took the math kernel where eager
autocast took a fused one: slower, and not bit-identical to autocast on CUDA. A boolean mask that
is True everywhere changes nothing, so this pass removes it from ``aten.scaled_dot_product_attention``
(and the nodes only it read).

A mask is proved all True from how it is built, for every size: ``ones``/``new_ones``/``full``
with a true fill, ``x >= c`` with ``x`` non-negative (``arange`` from 0, sums of non-negative
values) and ``c <= 0``, ``&`` of all-True masks, ``|`` with one, and shape ops of an all-True
mask. Masks that read an input (padding) or compare positions (causal) are left alone.

Example::

    >>> class Encoder(torch.nn.Module):
    ...     def forward(self, q):
    ...         keep = (torch.arange(q.shape[-2]) >= 0)[None, None, None, :].expand(2, 1, 4, 4)
    ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=keep)
    >>> gm = torch.export.export(Encoder(), (torch.randn(2, 1, 4, 8),), strict=False).module()
    >>> drop_true_masks(gm).graph.find_nodes(op="call_function", target=SDPA)[0].args[3:]
    (None,)
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

logger = logging.getLogger(__name__)

__all__ = ["drop_true_masks", "is_all_true", "SDPA"]

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_MASK_INDEX = 3

# Ops that move or view values without changing them: a mask built only through them keeps its
# property (all True, non-negative).
_SHAPE_OPS = {
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor,
    aten.select.int, aten.transpose.int, aten.permute.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.repeat.default, aten.expand_as.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
}  # fmt: skip
_ONES = {aten.ones.default, aten.new_ones.default, aten.ones_like.default}
_FULLS = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}
_ANDS = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_ORS = {aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default}
_ARANGES = {aten.arange.default: None, aten.arange.start: 0, aten.arange.start_step: 0}
_ADDS = {aten.add.Tensor, aten.add.Scalar, operator.add}


def _is_number(value: Any, test: Any) -> bool:
    return isinstance(value, (int, float, bool)) and not isinstance(value, torch.Tensor) and test(value)


def _non_negative(value: Any) -> bool:
    if _is_number(value, lambda v: v >= 0):
        return True
    if not isinstance(value, torch.fx.Node) or value.op != "call_function":
        return False
    target, args = value.target, value.args
    if target in _ARANGES:
        start = _ARANGES[target]
        return start is None or _is_number(args[start], lambda v: v >= 0)
    if target in _ADDS:
        return all(_non_negative(arg) for arg in args[:2])
    if target in _SHAPE_OPS:
        return _non_negative(args[0])
    return False


def is_all_true(value: Any) -> bool:
    """True when the node ``value`` is True everywhere, for every size (rules in the module docstring)."""
    if not isinstance(value, torch.fx.Node) or value.op != "call_function":
        return False
    target, args = value.target, value.args
    if target in _ONES:
        return True
    if target in _FULLS:
        fill = args[_FULLS[target]] if len(args) > _FULLS[target] else value.kwargs.get("fill_value")
        return _is_number(fill, bool)
    if target is aten.ge.Scalar:
        return _non_negative(args[0]) and _is_number(args[1], lambda v: v <= 0)
    if target is aten.gt.Scalar:
        return _non_negative(args[0]) and _is_number(args[1], lambda v: v < 0)
    if target in _ANDS:
        return all(is_all_true(arg) for arg in args[:2])
    if target in _ORS:
        return any(is_all_true(arg) for arg in args[:2])
    if target in _SHAPE_OPS:
        return is_all_true(args[0])
    return False


def _erase_unused(node: torch.fx.Node) -> None:
    # The mask's own nodes are pure (the rules above admit no in-place op): erase those no longer read.
    stack = [node]
    while stack:
        current = stack.pop()
        if current.op == "call_function" and not current.users:
            inputs = current.all_input_nodes
            current.graph.erase_node(current)
            stack.extend(inputs)


def drop_true_masks(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove all-True boolean masks from the graph's SDPA calls; returns ``gm``."""
    dropped = 0
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        args = list(node.args)
        mask = args[_MASK_INDEX] if len(args) > _MASK_INDEX else node.kwargs.get("attn_mask")
        value = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool and is_all_true(mask)):
            continue
        if len(args) > _MASK_INDEX:
            args[_MASK_INDEX] = None
            node.args = tuple(args)
        else:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
        _erase_unused(mask)
        dropped += 1
    if dropped:
        gm.recompile()
        logger.debug("drop_true_masks: %d all-True attention masks removed", dropped)
    return gm
