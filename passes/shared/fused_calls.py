"""Putting a fused call in place of a matched chain, the one way every fusion pass does it.

`insert_call` makes the call (before a node of the chain): its `NodeInfo` (op, rule, reason,
dtypes, the note naming what it replaced), whether it is recorded as one call if the graph is
traced again (``fx.wrap``), and the metadata it inherits from the node whose place it takes
(`INHERITED_META`: its module for the report, checkpoint and FSDP regions, its source line for
errors). `replace_chain` hands each value the chain gave its readers over to its replacement
and erases the chain. `retarget_call` points a node at another function in place (a call whose
values stay those of the call it was), and `parameter_node` reads a module's parameter that a
matcher named.

    >>> import operator
    >>> from amp_fx.core.policy import Rule
    >>> gm = torch.fx.symbolic_trace(lambda x: x.neg().neg() + 1)
    >>> x, neg, neg_1, add, _ = gm.graph.nodes
    >>> info = NodeInfo(op="pos", rule=Rule.PASSTHROUGH, notes=["neg(neg(x)) is x"])
    >>> fused = insert_call(gm, operator.pos, (x,), before=neg, info=info, inherits=neg_1)
    >>> replace_chain(gm, [neg, neg_1], {neg_1: fused})
    >>> [n.name for n in gm.graph.nodes], node_info(fused).in_dtypes
    (['x', 'pos', 'add', 'output'], (None,))
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

import torch
import torch.fx
from torch.fx.node import map_arg

from amp_fx.core.node_info import FX_WRAPPED_KEY, META_KEY, NodeInfo, node_info

__all__ = ["INHERITED_META", "insert_call", "parameter_node", "replace_chain", "retarget_call"]

# node.meta keys a fused call takes over from the node it stands for: where it came from, for the
# report, gradient checkpointing's and FSDP's regions (nn_module_stack) and error messages.
INHERITED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node", "seq_nr")


def _input_nodes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.fx.Node]:
    """The nodes a call of ``args`` and ``kwargs`` reads, in order, each once (its
    ``all_input_nodes``)."""
    found: dict[torch.fx.Node, None] = {}
    map_arg((args, dict(kwargs)), lambda node: found.setdefault(node))
    return list(found)


def insert_call(
    gm: torch.fx.GraphModule,
    target: Callable[..., Any] | str,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    before: torch.fx.Node,
    info: NodeInfo,
    inherits: torch.fx.Node | None = None,
    value: Any = None,
    wrapped: bool = False,
    kind: Literal["call_function", "call_method", "call_module"] = "call_function",
) -> torch.fx.Node:
    """A call of ``target`` (a function; a method or module name for those ``kind``\\ s), inserted
    before ``before``, recorded with ``info`` (its ``in_dtypes``, when empty, are those its input
    nodes have), with ``inherits``' `INHERITED_META` and, where given, ``value`` as its fake value
    (``meta["val"]``, for the passes that read shapes). ``wrapped``: recorded as one call if the
    graph is traced again (fx.wrap semantics), for calls whose checks read tensor shapes or that
    a trace would not record whole.

    >>> gm = torch.fx.symbolic_trace(lambda x: x + 1)
    >>> x, add, _ = gm.graph.nodes
    >>> neg = insert_call(gm, torch.neg, (x,), before=add, info=NodeInfo(op="neg"), wrapped=True)
    >>> [n.name for n in gm.graph.nodes], neg.meta["is_wrapped"]
    (['x', 'neg', 'add', 'output'], True)
    """
    kwargs = dict(kwargs or {})
    with gm.graph.inserting_before(before):
        call = gm.graph.create_node(kind, target, args, kwargs)
    if wrapped:
        call.meta[FX_WRAPPED_KEY] = True
    if inherits is not None:
        call.meta.update({key: inherits.meta[key] for key in INHERITED_META if key in inherits.meta})
    if value is not None:
        call.meta["val"] = value
    if not info.in_dtypes:
        info.in_dtypes = tuple(node_info(node).out_dtype for node in _input_nodes(args, kwargs))
    call.meta[META_KEY] = info
    return call


def replace_chain(
    gm: torch.fx.GraphModule, chain: Collection[torch.fx.Node], values: Mapping[torch.fx.Node, torch.fx.Node]
) -> None:
    """Give each reader outside ``chain`` of a node of ``values`` that node's replacement, in the
    order given, then erase ``chain`` (readers first): every one of its nodes must then be read
    by the chain alone.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.neg().neg() * 2)
    >>> x, neg, neg_1, mul, _ = gm.graph.nodes
    >>> replace_chain(gm, [neg, neg_1], {neg_1: x})
    >>> mul.args
    (x, 2)
    """
    inside = set(chain)
    for node, replacement in values.items():
        node.replace_all_uses_with(replacement, delete_user_cb=lambda user: user not in inside)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    for node in sorted(inside, key=order.__getitem__, reverse=True):
        gm.graph.erase_node(node)


def retarget_call(
    node: torch.fx.Node,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    note: str,
) -> None:
    """Make ``node`` a call of ``function`` on ``args`` and ``kwargs``, recorded as one call if
    the graph is traced again (its checks read tensors), its `NodeInfo` kept and given ``note``
    (once): the node computes the values it did, another way.

    >>> gm = torch.fx.symbolic_trace(lambda x: torch.relu(x))
    >>> relu = list(gm.graph.nodes)[1]
    >>> retarget_call(relu, torch.nn.functional.relu, (relu.args[0],), {}, note="functional")
    >>> relu.target is torch.nn.functional.relu, node_info(relu).notes
    (True, ['functional'])
    """
    node.op, node.target = "call_function", function
    node.args, node.kwargs = tuple(args), dict(kwargs)
    node.meta[FX_WRAPPED_KEY] = True
    info = node_info(node)
    if note not in info.notes:
        info.notes.append(note)


def parameter_node(
    gm: torch.fx.GraphModule, parameter: torch.fx.Node | str | None, dtype: torch.dtype | None = None
) -> torch.fx.Node | None:
    """A node for a parameter a matcher found: the node itself, or a get_attr of a module's
    parameter given by qualified name (inserted where the graph inserts), recorded as of ``dtype``
    (by default the parameter's own).

    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    >>> with gm.graph.inserting_before(list(gm.graph.nodes)[1]):
    ...     weight = parameter_node(gm, "weight")
    >>> weight.op, node_info(weight).out_dtype
    ('get_attr', torch.float32)
    """
    if not isinstance(parameter, str):
        return parameter
    node = gm.graph.get_attr(parameter)
    node_info(node).out_dtype = gm.get_parameter(parameter).dtype if dtype is None else dtype
    return node
