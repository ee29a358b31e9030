"""Which values an in-place update reaches, and the write-back of an update that lands on a cast.

A node that updates an input in place (``x.add_(1)``, ``x[i] = y``, a training BatchNorm's running
statistics) updates every view of it too. Where that input is one of amp_fx's casts (the entry cast
of a model input, the cast of a buffer), eager code would have updated the value itself, so
`write_back_updates` copies the update back: ``value.copy_(cast)``.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.view(-1).add_(1))
    >>> [alias_base(n).name for n in gm.graph.nodes][:3]
    ['x', 'x', 'x']
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from amp_fx.core.node_info import META_KEY, NodeInfo, node_info
from amp_fx.core.op_facts import RUNNING_STATS_FLAGS, VIEW_OPS
from amp_fx.core.policy import Rule
from amp_fx.passes.shared.call_nodes import is_inplace_call

__all__ = ["mutated_inputs", "alias_base", "updates_in_place", "write_back_updates", "is_write_back"]


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The call's arguments by parameter name (defaults included), or {} where unknown."""
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin without a Python signature: torch's schema
        pair = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        return dict(pair.kwargs) if pair is not None else {}
    bound.apply_defaults()
    return dict(bound.arguments)


def mutated_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes `node` updates in place: the tensor of an in-place call (``x.add_(1)``,
    ``x[i] = y``, ``relu(x, inplace=True)``), an ``out=`` tensor, the running statistics a
    training ``F.batch_norm``/``F.instance_norm`` updates, and an aten op's ``Tensor(a!)``.

    A cast between such an input and `node` would take the update (autocast never casts these);
    `write_back_updates` copies it back.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.add_(1))
    >>> [[a.name for a in mutated_inputs(n)] for n in gm.graph.nodes]
    [[], ['x'], []]
    """
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        # An aten op (torch.export's graphs) says which arguments it writes: Tensor(a!).
        written = [
            node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            for i, argument in enumerate(node.target._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]
        return [value for value in written if isinstance(value, torch.fx.Node)]
    if is_inplace_call(node):
        first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
        return [first] if isinstance(first, torch.fx.Node) else []
    if node.op != "call_function":
        return []
    mutated = [node.kwargs["out"]] if isinstance(node.kwargs.get("out"), torch.fx.Node) else []
    flag = RUNNING_STATS_FLAGS.get(node_info(node).op or "")
    if flag is not None:
        arguments = _arguments(node)
        if arguments.get(flag) is not False:  # True, or only known at run time
            stats = (arguments.get(name) for name in ("running_mean", "running_var"))
            mutated += [s for s in stats if isinstance(s, torch.fx.Node)]
    return mutated


_WRITE_BACK_REASON = "write-back: {node} updates a cast of {value} in place; copied into {value}"


def _write_back(
    gm: torch.fx.GraphModule, node: torch.fx.Node, value: torch.fx.Node, cast: torch.fx.Node
) -> None:
    """After `node`, copy its in-place update of `cast` into `value` (the caller's tensor, a
    buffer), as eager would have updated `value` itself: ``value.copy_(cast)``."""
    reason = _WRITE_BACK_REASON.format(node=node.name, value=value.name)
    with gm.graph.inserting_after(node):
        copy = gm.graph.create_node("call_method", "copy_", (value, cast), name=f"{value.name}_write_back")
    copy.meta[META_KEY] = NodeInfo(
        op="copy_",
        rule=Rule.PASSTHROUGH,
        reason=reason,
        in_dtypes=(node_info(value).out_dtype, node_info(cast).out_dtype),
        out_dtype=node_info(value).out_dtype,
        is_cast=True,  # amp_fx's own node: not cast again, skipped by disable_casts
        cast_reason=reason,
    )


def _is_alias_of_first_argument(node: torch.fx.Node) -> bool:
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in VIEW_OPS or (node_info(node).op or "") in VIEW_OPS or is_inplace_call(node)


def alias_base(node: torch.fx.Node) -> torch.fx.Node:
    """The value whose storage `node` shares, through views and in-place results; an amp_fx cast
    is a copy, so it is a base itself.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.view(-1).add_(1))
    >>> [alias_base(n).name for n in gm.graph.nodes][:3]
    ['x', 'x', 'x']
    """
    while _is_alias_of_first_argument(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _aliases(base: torch.fx.Node) -> set[torch.fx.Node]:
    found, todo = {base}, [base]
    while todo:
        for user in todo.pop().users:
            if user not in found and _is_alias_of_first_argument(user) and user.args[0] in found:
                found.add(user)
                todo.append(user)
    return found


def updates_in_place(cast: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that update `cast` in place, directly or through a view of it, in graph order."""
    aliases = _aliases(cast)
    users = {user for alias in aliases for user in alias.users}
    updating = [user for user in users if not is_write_back(user) and set(mutated_inputs(user)) & aliases]
    if len(updating) < 2:
        return updating  # nothing to order: the usual case, and ordering walks the whole graph
    order = {node: index for index, node in enumerate(cast.graph.nodes)}
    return sorted(updating, key=order.__getitem__)


def write_back_updates(gm: torch.fx.GraphModule) -> int:
    """After every in-place update of an amp_fx cast (the entry cast of a model input, the cast of
    a buffer), copy the update into the value cast: ``value.copy_(cast)``, as eager would have
    updated ``value`` itself. Returns the number of write-backs added.

    Example (O2, bf16; ``x.add_(1); return x``)::

        x_to_bfloat16 = amp_fx_ops_casts_cast_if_floating(x, torch.bfloat16)
        add_ = x_to_bfloat16.add_(1)
        x_write_back = x.copy_(x_to_bfloat16)
        return x
    """
    added = 0
    for cast in list(gm.graph.nodes):
        if not node_info(cast).is_cast or is_write_back(cast) or not cast.args:
            continue
        value = cast.args[0]
        if not isinstance(value, torch.fx.Node):
            continue
        for node in updates_in_place(cast):
            following = node.next
            if is_write_back(following) and following.args == (value, cast):
                continue  # converted before
            _write_back(gm, node, value, cast)
            added += 1
    return added


def is_write_back(node: torch.fx.Node) -> bool:
    """True for the ``value.copy_(cast)`` that `insert_input_casts` adds after an in-place update
    of a cast (see `mutated_inputs`)."""
    info = node_info(node)
    return info.is_cast and node.op == "call_method" and node.target == "copy_"
