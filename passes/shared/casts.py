"""amp_fx's cast nodes: making them, sharing them, and inserting the casts a node's recorded
``in_dtypes`` ask for (`insert_input_casts`, the core of `insert_casts` and `cast_outputs`).

One cast per parameter, model input or exact widening and dtype is shared by every later user, as
autocast caches its weight casts; an activation narrowed to the low dtype gets one cast per user
(`may_share_cast`). The cache of shared casts forgets a value's casts once it is updated in place.

    >>> import collections
    >>> gm = torch.fx.symbolic_trace(lambda x: collections.namedtuple("Out", "y")(x * 2))
    >>> [is_output_structure(n) for n in gm.graph.nodes]
    [False, False, True, False]
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from amp_fx.core.dtypes import dtype_name
from amp_fx.core.node_info import FX_WRAPPED_KEY, META_KEY, NodeInfo, node_info
from amp_fx.core.policy import Rule
from amp_fx.ops.casts import cast_if_floating
from amp_fx.passes.shared.dtypes import dtype_is_assumed, is_exact_widening
from amp_fx.passes.shared.in_place_updates import alias_base, mutated_inputs

logger = logging.getLogger(__name__)

__all__ = [
    "CastCache",
    "make_cast",
    "may_share_cast",
    "is_output_structure",
    "insert_input_casts",
    "forget_casts",
]


# (value, dtype) -> the cast of value to dtype that every later user may share (`may_share_cast`).
CastCache = dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node]


def make_cast(
    graph: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype, *, guarded: bool, reason: str
) -> torch.fx.Node:
    """Create (at the graph's insertion point) a cast node named ``<value>_to_<dtype>``."""
    name = f"{value.name}_to_{dtype_name(dtype)}"
    if guarded:
        cast = graph.create_node("call_function", cast_if_floating, (value, dtype), name=name)
        # Recorded as a call if the converted graph is ever traced again (fx.wrap semantics);
        # tracing into it would drop the cast (isinstance of a Proxy is False).
        cast.meta[FX_WRAPPED_KEY] = True
    else:
        cast = graph.create_node("call_method", "to", (value, dtype), name=name)
    cast.meta[META_KEY] = NodeInfo(
        op="to",
        rule=Rule.PASSTHROUGH,
        reason=reason,
        in_dtypes=(node_info(value).out_dtype,),
        out_dtype=dtype,
        is_cast=True,
        cast_reason=reason,
    )
    return cast


def _cast_reason(node: torch.fx.Node, dtype: torch.dtype, value: torch.fx.Node) -> str:
    info = node_info(node)
    what = info.op or str(node.target)
    if node.op == "output" or is_output_structure(node):
        return f"model output cast to {dtype_name(dtype)} (cast_model_outputs)"
    if value.op == "placeholder" and info.rule in (Rule.PASSTHROUGH, None):
        return f"model input cast to {dtype_name(dtype)} at entry"
    if info.rule is Rule.PASSTHROUGH:
        return f"{what} runs in its parameters' dtype: input cast to {dtype_name(dtype)}"
    rule = info.rule.value.upper() if info.rule is not None else "input"
    return f"{rule} {what}: input cast to {dtype_name(dtype)}"


def is_output_structure(node: torch.fx.Node) -> bool:
    """True for a node that only builds the model's return value: a tuple, list, dict or
    namedtuple constructed from the results and read by nothing but the output (or by another
    such node). Its inputs are model outputs, cast by `cast_outputs`.

    >>> import collections
    >>> gm = torch.fx.symbolic_trace(lambda x: collections.namedtuple("Out", "y")(x * 2))
    >>> [is_output_structure(n) for n in gm.graph.nodes]
    [False, False, True, False]
    """
    target = node.target
    if (
        node.op != "call_function"
        or not isinstance(target, type)
        or not issubclass(target, (tuple, list, dict))
    ):
        return False
    return all(user.op == "output" or is_output_structure(user) for user in node.users)


def may_share_cast(source: torch.fx.Node, dtype: torch.dtype) -> bool:
    """True when one cast of `source` to `dtype` may serve every user without changing gradients.

    A shared cast sums its users' gradients in `dtype` before casting them back. That is what
    autocast does for parameters (it caches their casts) and harmless for model inputs and exact
    widenings; for an activation narrowed to fp16 it is not: autocast casts once per consumer and
    sums the gradients in fp32, where an fp16 sum can overflow. So those casts stay one per user.

    Example: ``h`` (float32) feeding two LOWER matmuls gets ``h_to_float16`` and
    ``h_to_float16_1``, one each, as under autocast; ``fc.weight`` read twice gets one cast.
    """
    if source.op in ("get_attr", "placeholder"):
        return True
    source_dtype = node_info(source).out_dtype
    return source_dtype is not None and is_exact_widening(source_dtype, dtype)


def insert_input_casts(gm: torch.fx.GraphModule, node: torch.fx.Node, cache: CastCache) -> int:
    """Make `node` see the dtypes of its ``in_dtypes``: cast each input whose producer's
    ``out_dtype`` differs. Returns the number of new cast nodes."""
    info = node_info(node)
    inputs = node.all_input_nodes
    mutated = mutated_inputs(node)
    if len(info.in_dtypes) != len(inputs):
        logger.debug("%s has no dtypes for its inputs; left as is", node.name)
        _forget_casts(cache, mutated)
        return 0
    created = 0
    for value, want in zip(inputs, info.in_dtypes, strict=True):
        have = node_info(value).out_dtype
        if want is None or want == have:
            continue
        shared = may_share_cast(value, want)
        cast = cache.get((value, want)) if shared else None
        if cast is None:
            with gm.graph.inserting_before(node):
                guarded = have is None or dtype_is_assumed(value)
                cast = make_cast(
                    gm.graph, value, want, guarded=guarded, reason=_cast_reason(node, want, value)
                )
            if shared:
                cache[(value, want)] = cast
            created += 1
        node.replace_input_with(value, cast)
    _forget_casts(cache, mutated)
    return created


def forget_casts(cache: dict[Any, torch.fx.Node], updated: set[torch.fx.Node]) -> None:
    """Drop the cached casts (keyed by value first) of the values ``updated`` in place: users after
    an update must see it, and casts made before it are stale."""
    if updated:
        for key in [key for key in cache if key[0] in updated]:
            del cache[key]


def _forget_casts(cache: CastCache, mutated: list[torch.fx.Node]) -> None:
    # The value a mutated view views is the one whose casts are stale.
    forget_casts(cache, {alias_base(value) for value in mutated})
