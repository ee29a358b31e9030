"""A convert pass: remove the casts that change nothing and merge the ones that repeat.

Works on amp_fx's own cast nodes (``node_info(n).is_cast``) only; casts the user wrote are
left as written. Reads the dtypes recorded by `propagate_dtypes` and `insert_casts` (run
`propagate_dtypes` again first on a graph changed by other means), then:

- removes a cast whose input already has the target dtype (a no-op; without ``example_inputs``
  a model input's dtype is only assumed, so its casts are kept);
- merges casts of one value to one dtype into the first of them (one cast feeding every user);
- cancels a round trip ``a -> wide -> a`` where it is exact: float16/bfloat16 -> float32 ->
  back returns the same bits, so users of the second cast read ``a`` itself. ``float32 ->
  float16 -> float32`` rounds, and stays;
- erases casts left without users.

In-place updates are respected (`mutated_inputs`): a cast made before an update of its value is
not shared with users after it, a cast that is updated in place is never replaced by the value
it copies (the update would land on that value), and a write-back that became ``x.copy_(x)``
(its cast removed as a no-op) goes too.

Example::

    before                                       after
    h16 = linear(...)              (float16)      h16 = linear(...)
    h32 = h16.to(torch.float32)                   h32 = h16.to(torch.float32)
    a = softmax(h32)                              a = softmax(h32)
    h16_again = h32.to(torch.float16)             (removed: exact round trip)
    b = matmul(h16_again, w)                      b = matmul(h16, w)
    h32_dup = h16.to(torch.float32)               (merged into h32)
    c = log_softmax(h32_dup)                      c = log_softmax(h32)
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.passes.shared.casts import forget_casts, may_share_cast
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.dtypes import dtype_is_assumed, is_exact_widening
from amp_fx.passes.shared.in_place_updates import alias_base, is_write_back, mutated_inputs, updates_in_place

logger = logging.getLogger(__name__)

__all__ = ["simplify_casts"]


def _cast_parts(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.dtype] | None:
    if not node_info(node).is_cast or len(node.args) < 2:
        return None
    source, dtype = node.args[0], node.args[1]
    if not isinstance(source, torch.fx.Node) or not isinstance(dtype, torch.dtype):
        return None
    return source, dtype


def _replace(node: torch.fx.Node, replacement: torch.fx.Node) -> None:
    # Users keep in_dtypes aligned with all_input_nodes: they see `replacement` as they saw `node`.
    seen = node_info(node).out_dtype
    for user in list(node.users):
        info = node_info(user)
        inputs = user.all_input_nodes
        aligned = len(inputs) == len(info.in_dtypes)
        before = dict(zip(inputs, info.in_dtypes, strict=False))
        user.replace_input_with(node, replacement)
        if aligned:
            info.in_dtypes = tuple(seen if a is replacement else before.get(a) for a in user.all_input_nodes)


def _forget_updated(
    first_cast: dict[tuple[torch.fx.Node, torch.dtype, object], torch.fx.Node], node: torch.fx.Node
) -> None:
    """After `node` updates a value (or a cast of it) in place, earlier casts of it are stale."""
    updated = {alias_base(value) for value in mutated_inputs(node)}
    updated |= {parts[0] for value in list(updated) if (parts := _cast_parts(value)) is not None}
    forget_casts(first_cast, updated)


def simplify_casts(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Remove no-op casts, merge duplicates, cancel exact round trips (see the module docstring).

    Example (a bfloat16 result cast to float32 and back, an exact round trip)::

        >>> from amp_fx.core.policy import preset
        >>> from amp_fx.passes.classify import classify
        >>> from amp_fx.passes.insert_casts import insert_casts
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> from amp_fx.passes.propagate_dtypes import propagate_dtypes
        >>> from amp_fx.passes.shared.casts import make_cast
        >>> from amp_fx.passes.shared.decisions import plan_parameters
        >>> from amp_fx.capture.fx import trace
        >>> gm, context = trace(torch.nn.Linear(4, 2)), Conversion(preset("O1", torch.bfloat16, "cpu"))
        >>> gm = classify(normalize_ops(gm).graph_module, context).graph_module
        >>> context = plan_parameters(gm, context)
        >>> gm = insert_casts(propagate_dtypes(gm, context).graph_module, context).graph_module
        >>> linear = next(n for n in gm.graph.nodes if node_info(n).op == "linear")
        >>> with gm.graph.inserting_after(linear):
        ...     wide = make_cast(gm.graph, linear, torch.float32, guarded=False, reason="up")
        >>> with gm.graph.inserting_after(wide):
        ...     back = make_cast(gm.graph, wide, torch.bfloat16, guarded=False, reason="down")
        >>> gm.graph.output_node().replace_input_with(linear, back)
        >>> [n.name for n in simplify_casts(gm, context).graph_module.graph.nodes if node_info(n).is_cast]
        ['input_1_to_bfloat16', 'weight_to_bfloat16', 'bias_to_bfloat16']
    """
    graph = gm.graph
    first_cast: dict[tuple[torch.fx.Node, torch.dtype, object], torch.fx.Node] = {}
    removed = {"no-op": 0, "duplicate": 0, "round trip": 0, "unused": 0}
    for node in list(graph.nodes):
        _forget_updated(first_cast, node)
        parts = _cast_parts(node)
        if parts is None:
            continue
        source, dtype = parts
        source_dtype = node_info(source).out_dtype
        replacement, why = None, None
        if source_dtype == dtype and not dtype_is_assumed(source):
            replacement, why = source, "no-op"
        else:
            inner = _cast_parts(source)
            if inner is not None:
                origin = inner[0]
                origin_dtype = node_info(origin).out_dtype
                if (
                    origin_dtype == dtype
                    and not dtype_is_assumed(origin)
                    and is_exact_widening(dtype, inner[1])
                    and not updates_in_place(node)
                ):
                    replacement, why = origin, "round trip"
            if replacement is None and may_share_cast(source, dtype):
                # Same value, same dtype, same kind of cast (x.to vs cast_if_floating): one node.
                key = (source, dtype, node.target)
                earlier = first_cast.setdefault(key, node)
                if earlier is not node:
                    replacement, why = earlier, "duplicate"
        if replacement is not None:
            _replace(node, replacement)
            graph.erase_node(node)
            removed[why] += 1
    for node in reversed(list(graph.nodes)):
        if is_write_back(node) and node.args[0] is node.args[1]:
            graph.erase_node(node)  # the update already landed on the value itself
            removed["no-op"] += 1
        elif _cast_parts(node) is not None and not node.users:
            graph.erase_node(node)
            removed["unused"] += 1
    logger.debug("simplify_casts: removed %s", removed)
    return PassResult(gm, any(removed.values()))
