"""A matched head and loss (`amp_fx.passes.shared.linear_loss_chains.LinearLoss`) replaced by one
call: the one replacement of `fuse_linear_loss` and `fuse_chunked_linear_loss`.

`head_arguments` makes what the fused call reads (the head's input and bias times the chain's
logit scale, its parameters read by name), `replace_head_and_loss` puts the call in the loss's
place. The call is recorded as the loss (its `NodeInfo`, an FP32 cross-entropy, noting what it
replaced) computed by the head's module: it is the op that reads the head's parameters, so a
sharded head's weight is gathered for it (FSDP2, `shard_regions`); the loss reads none, and
without a module of its own a node joins its readers' region, which for a loss is the model's.
Logits the graph's output returned become None there (Liger-Kernel's convention).

>>> import amp_fx
>>> import torch.nn.functional as F
>>> from torch import nn
>>> from amp_fx.core.policy import preset
>>> from amp_fx.passes.shared.linear_loss_chains import match_linear_loss
>>> class Head(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.head = nn.Linear(4, 6)
...     def forward(self, h, t):
...         return F.cross_entropy(self.head(h).view(-1, 6), t)
>>> policy = preset("O2", torch.bfloat16, fused_losses=False)  # converted, left unfused
>>> gm = amp_fx.convert(Head(), "O2", policy=policy)
>>> *_, loss, output = gm.graph.nodes
>>> match = match_linear_loss(gm, loss, output)
>>> from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy as fused_loss
>>> args = (*head_arguments(gm, match), match.arguments["target"])
>>> fused = replace_head_and_loss(gm, match, output, fused_loss, args, {}, note="fused")
>>> [n.name for n in gm.graph.nodes]
['h', 't', 'h_to_bfloat16', 'head_weight', 'head_bias', 'chunked_linear_cross_entropy', 'output']
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from amp_fx.core.node_info import NodeInfo, node_info
from amp_fx.core.policy import Rule
from amp_fx.passes.shared.fused_calls import insert_call, parameter_node, replace_chain
from amp_fx.passes.shared.linear_loss_chains import LinearLoss

__all__ = ["head_arguments", "replace_head_and_loss"]


def head_arguments(
    gm: torch.fx.GraphModule, match: LinearLoss
) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None]:
    """(input, weight, bias) of the fused call, inserted before the loss: the head's weight and
    bias as nodes (a module's read with new get_attr nodes, typed as the head computes), and its
    input and bias times the chain's logit scale where there is one (``(h @ W.T + b) * c`` is
    ``(h * c) @ W.T + b * c``)."""
    dtype = node_info(match.head).out_dtype
    with gm.graph.inserting_before(match.loss):
        weight = parameter_node(gm, match.weight, dtype)
        bias = parameter_node(gm, match.bias, dtype)
    if match.scale == 1.0:
        return match.input, weight, bias
    return _scaled(gm, match, match.input), weight, None if bias is None else _scaled(gm, match, bias)


def _scaled(gm: torch.fx.GraphModule, match: LinearLoss, value: torch.fx.Node) -> torch.fx.Node:
    dtype = node_info(value).out_dtype
    note = f"the logit scale {match.scale:g} of the fused head, applied to its arguments (exact)"
    info = NodeInfo(op="mul", rule=Rule.PASSTHROUGH, in_dtypes=(dtype,), out_dtype=dtype, notes=[note])
    return insert_call(
        gm, operator.mul, (value, match.scale), before=match.loss, info=info, inherits=match.head
    )


def replace_head_and_loss(
    gm: torch.fx.GraphModule,
    match: LinearLoss,
    output: torch.fx.Node,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    note: str,
) -> torch.fx.Node:
    """Put a call of ``function`` on ``args`` and ``kwargs`` in the place of the loss, and erase
    the loss and every node it replaced (logits ``output`` returned become None there); returns
    the call, noted ``note`` (module docstring)."""
    loss = match.loss
    info = node_info(loss)
    notes = [*info.notes, *([] if note in info.notes else [note])]
    info = dataclasses.replace(info, op="cross_entropy_loss", rule=Rule.FP32, in_dtypes=(), notes=notes)
    # Recorded as one call if the graph is traced again.
    fused = insert_call(gm, function, args, kwargs, before=loss, info=info, inherits=match.head, wrapped=True)
    dropped = set(match.removed)
    output.args = map_arg(output.args, lambda node: None if node in dropped else node)
    replace_chain(gm, [*match.removed, loss], {loss: fused})
    return fused
