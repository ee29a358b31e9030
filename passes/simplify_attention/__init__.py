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
  ``enable_gqa=True``, which repeats them the same way inside the kernel;
- where the mask is ``where(mask, bias, min)`` (T5's relative position bias folded into the mask,
  transformers' ``create_position_bias_mask``) and ``mask`` is proved all True or causal, gives
  the ``where`` the mask from before its expand over the batch, as eager code builds it: the mask
  then has the bias's shape, ``(1, heads, q, kv)``, not ``(batch, heads, q, kv)``, so SDPA's
  backward sums the bias's gradient over the batch as eagerly (once, in the low dtype under
  autocast), not the ``where``'s (per element rounded, then in FP32): 0.24% off in T5's bias
  gradient.

The result is the same for every size the graph runs at.

The proof is an abstract evaluation of the mask's nodes (`amp_fx.passes.simplify_attention.affine_masks`).

Example::

    >>> class Decoder(torch.nn.Module):
    ...     def forward(self, q):
    ...         pos = torch.arange(q.shape[-2])
    ...         causal = (pos[None, :] <= pos[:, None])[None, None]
    ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=causal)
    >>> gm = torch.export.export(Decoder(), (torch.randn(2, 1, 4, 8),), strict=False).module()
    >>> simplify_attention(gm).graph_module.graph.find_nodes(op="call_function", target=SDPA)[0].args[3:6]
    (None, 0.0, True)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amp_fx.passes.shared.call_nodes import call_argument
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.simplify_attention.affine_masks import SAME_VALUE_OPS, mask_kind, value_shape

logger = logging.getLogger(__name__)

__all__ = ["simplify_attention", "repeated_heads", "SDPA"]

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_MASK_INDEX, _DROPOUT_INDEX, _CAUSAL_INDEX = 3, 4, 5


def _erase_unused(node: torch.fx.Node) -> None:
    # Erase what only the mask or the repeat read; `mask_kind`'s and/or may decide from one operand, so
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


_RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def _whole_slice(node: torch.fx.Node) -> bool:
    args = list(node.args) + [None] * (5 - len(node.args))
    source, dim, start, end, step = args[0], args[1] or 0, args[2], args[3], args[4]
    shape = value_shape(source) if isinstance(source, torch.fx.Node) else None
    if shape is None or start not in (None, 0) or step not in (None, 1):
        return False
    size = shape[dim]
    return end is None or (isinstance(end, int) and (end >= torch.iinfo(torch.int64).max or end == size))


def _skip_identities(node: Any) -> Any:
    """`node` seen through whole slices and copies (``x[:, :]``, ``contiguous``)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if (node.target is aten.slice.Tensor and _whole_slice(node)) or (
            node.target in SAME_VALUE_OPS and len(node.args) == 1 and not node.kwargs
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
    shapes = [value_shape(n) if isinstance(n, torch.fx.Node) else None for n in (source, expand, node)]
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


_WHERE = {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}


def _recompute_value(node: torch.fx.Node) -> None:
    # The recorded (fake) value of `node` once an input changed shape: its op run on its inputs' values.
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    node.meta["val"] = node.target(*args, **kwargs)


def _unexpand_combined_mask(node: torch.fx.Node) -> bool:
    """Give the ``where(mask, bias, min)`` that the SDPA call `node` reads as its mask the causal or
    all-True mask from before its expand over the batch, as eager code builds it: True if changed."""
    chain, combined = [], call_argument(node, _MASK_INDEX, "attn_mask", None)
    while (
        isinstance(combined, torch.fx.Node)
        and combined.target in SAME_VALUE_OPS
        and len(combined.args) == 1
        and len(combined.users) == 1
    ):
        chain.append(combined)
        combined = combined.args[0]
    if not (isinstance(combined, torch.fx.Node) and combined.target in _WHERE and len(combined.users) == 1):
        return False
    mask = combined.args[0]
    value = mask.meta.get("val") if isinstance(mask, torch.fx.Node) else None
    kind = mask_kind(mask) if isinstance(value, torch.Tensor) and value.dtype == torch.bool else None
    if kind is None:
        return False
    source = mask
    while (
        source.op == "call_function"
        and source.target in (aten.expand.default, *SAME_VALUE_OPS)
        and isinstance(source.args[0], torch.fx.Node)
        and mask_kind(source.args[0]) == kind
    ):
        source = source.args[0]
    if source is mask or any("val" not in n.meta for n in [source, *combined.all_input_nodes]):
        return False
    combined.replace_input_with(mask, source)
    for changed in [combined, *reversed(chain)]:
        _recompute_value(changed)
    _erase_unused(mask)
    return True


def simplify_attention(gm: torch.fx.GraphModule, context: Conversion | None = None) -> PassResult:
    """Make the graph's SDPA calls the ones eager code makes: all-True masks dropped, causal masks
    as ``is_causal=True``, repeated key/value heads as ``enable_gqa=True``, in place on ``gm``
    (``modified``: whether it changed one). It does not read the context."""
    changed = {"all_true": 0, "causal": 0, "grouped": 0, "unexpanded": 0}
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        kind = _simplify_mask(node)
        if kind is not None:
            changed[kind] += 1
        changed["grouped"] += _use_grouped_heads(node)
        changed["unexpanded"] += _unexpand_combined_mask(node)
    if any(changed.values()):
        gm.recompile()
        logger.debug(
            "attention: %(all_true)d all-True masks dropped, %(causal)d made is_causal, %(grouped)d with "
            "enable_gqa, %(unexpanded)d combined masks unexpanded",
            changed,
        )
    return PassResult(gm, any(changed.values()))
