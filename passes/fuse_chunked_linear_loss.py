"""A convert pass (O2, graphs captured in training mode): a language model's head and its
cross-entropy as one chunked call that never holds the [rows, V] logits.

What it finds, by canonical op names (`node_info(node).op`), so one description serves the
torch.export front end's ATen graphs and torch.fx graphs alike::

    logits = linear(h, W[, b])                  the head (W may be tied to the embedding)
    x      = to(logits, float32) | view | reshape | flatten | contiguous | alias   (any chain)
    rows   = view(x, [-1, V])                   (at least one reshape to rows of V classes)
    loss   = cross_entropy_loss(rows, target, ignore_index=i, reduction="mean" | "sum")

That is Hugging Face's ``ForCausalLMLoss`` (``logits.float()``, ``view(-1, vocab_size)``,
``fixed_cross_entropy``: a mean, or a sum later divided by ``num_items_in_batch``, which stays in
the graph and divides the fused loss) and nanoGPT's loss alike. The loss must be one the chunked
op computes exactly: no class weights, no label smoothing, no ``reduction="none"``. The logits,
and the casts and views of them, may be read only by that loss, by size reads, and by the graph's
output (the model returning them).

The head and loss become ``chunked_linear_cross_entropy(h, W, b, target, i, reduction)``
(`amp_fx.ops.chunked_cross_entropy`): low-precision cuBLAS matmuls and the fused cross-entropy
kernel per chunk of rows, gradients computed in the forward. Nodes replaced: the head's linear
call, the chain of casts and views to the loss, the loss itself and size reads only they used.
The call is recorded as the head module's op (its ``nn_module_stack``): under FSDP2 an untied
head is a group of its own, gathered for its ops alone (`shard_regions`).

Returned logits follow Liger-Kernel's convention: the output holds None in their place (a Hugging
Face model's output then has ``logits=None`` and a real ``loss``). Hence the pass runs only on
graphs whose mode is known to be training (`TRAINING_MODE_KEY`, recorded by the torch.export
front end): eval graphs keep their logits and are left alone, and a torch.fx graph, which serves
both modes, too. With ``policy.keep_logits`` heads whose logits are returned are left alone.
It runs where ``policy.fused_chunked_linear_loss`` (default True at O2, on every device: on a CPU
the op runs the kernels' pure-torch reference), after `fuse_losses` and `fuse_linear_loss`, so a
loss those fused already is left to them.

Example (O2, bf16, a Hugging Face causal LM in training)::

    before                                          after
    linear = aten.linear(h, lm_head_weight)         chunked = chunked_linear_cross_entropy(
    to_1 = aten.to(linear, torch.float32)               h, lm_head_weight, None, target,
    view = aten.view(to_1, [-1, 32000])                 ignore_index=-100, reduction="sum")
    loss = aten.cross_entropy_loss(view, t, None, 2)
    div = aten.div(loss, num_items)                 div = aten.div(chunked, num_items)
    return (div, to_1, ...)                         return (div, None, ...)
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.node import map_arg

from amp_fx.core.node_info import FX_WRAPPED_KEY, META_KEY, TRAINING_MODE_KEY, node_info
from amp_fx.core.op_facts import METADATA_ATTRIBUTES, RESHAPE_OPS, SHAPE_METHODS
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.calls import call_argument
from amp_fx.passes.shared.losses import cross_entropy_call_arguments, is_last_size_of
from amp_fx.passes.shared.module_regions import computed_by_module_of

logger = logging.getLogger(__name__)

__all__ = ["fuse_chunked_linear_loss"]

# Ops that pass the logits on unchanged in value and row order (a widening cast included).
_CHAIN_OPS = RESHAPE_OPS | {"alias", "to"}
_METADATA_READS = SHAPE_METHODS | METADATA_ATTRIBUTES


def _head_arguments(gm: torch.fx.GraphModule, linear: torch.fx.Node) -> tuple[Any, Any, Any, int] | None:
    """(input, weight, bias, number of classes) of a head call; the weight and bias are nodes, or
    the attribute paths of a plain nn.Linear's parameters; None when they cannot be read."""
    if node_info(linear).op != "linear":
        return None
    if linear.op == "call_module":
        module = gm.get_submodule(linear.target)
        if (
            not isinstance(module, nn.Linear)
            or type(module).forward is not nn.Linear.forward
            or has_forward_hooks(module)
            or len(linear.args) != 1
            or linear.kwargs
        ):
            return None
        bias = f"{linear.target}.bias" if module.bias is not None else None
        return linear.args[0], f"{linear.target}.weight", bias, module.out_features
    if linear.op != "call_function" or linear.target not in (F.linear, torch.ops.aten.linear.default):
        return None
    input, weight = call_argument(linear, 0, "input"), call_argument(linear, 1, "weight")
    bias = call_argument(linear, 2, "bias")
    if not all(isinstance(n, torch.fx.Node) for n in (input, weight)):
        return None
    if bias is not None and not isinstance(bias, torch.fx.Node):
        return None
    num_classes = _rows_of(gm, weight)
    return None if num_classes is None else (input, weight, bias, num_classes)


def _rows_of(gm: torch.fx.GraphModule, weight: torch.fx.Node) -> int | None:
    """The first dimension of the head's weight: from the captured value, else from the
    parameter that the weight node reads, through casts."""
    value = weight.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        return int(value.shape[0])
    while node_info(weight).op == "to" and weight.args and isinstance(weight.args[0], torch.fx.Node):
        weight = weight.args[0]
    if weight.op == "get_attr":
        tensor = gm
        for name in str(weight.target).split("."):
            tensor = getattr(tensor, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
            return int(tensor.shape[0])
    return None


def _step_keeps_rows(node: torch.fx.Node, chain: set[torch.fx.Node], num_classes: int) -> bool | None:
    """For one node between the head and the loss: True if it reshapes to (-1, V) rows, None if it
    changes neither values nor shape (a widening cast, contiguous, alias), False otherwise."""
    info = node_info(node)
    if info.op not in _CHAIN_OPS or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if info.op == "to":
        source = node_info(node.args[0]).out_dtype
        widening = info.out_dtype == torch.float32 and source in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
        )
        return None if widening else False
    if info.op in ("contiguous", "alias"):
        return None if len(node.args) == 1 else False
    if info.op == "flatten":
        start, end = call_argument(node, 1, "start_dim", 0), call_argument(node, 2, "end_dim", -1)
        return start == 0 and end == -2
    shape = list(node.args[1:]) or list(node.kwargs.get("shape", node.kwargs.get("size", ())))
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = list(shape[0])
    if len(shape) != 2 or shape[0] != -1:
        return False
    return shape[1] == num_classes or is_last_size_of(shape[1], chain)


def _chain_to_head(
    gm: torch.fx.GraphModule, rows: torch.fx.Node
) -> tuple[torch.fx.Node, list[torch.fx.Node], tuple[Any, Any, Any, int]] | None:
    """(the head's linear node, the nodes from it to ``rows`` in order, its arguments) when
    ``rows`` is the head's logits in rows of V classes, else None."""
    path: list[torch.fx.Node] = []
    node = rows
    while (arguments := _head_arguments(gm, node)) is None:
        if (
            node_info(node).op not in _CHAIN_OPS
            or not node.args
            or not isinstance(node.args[0], torch.fx.Node)
        ):
            return None
        path.append(node)
        node = node.args[0]
    path.reverse()
    seen, made_rows = {node}, False
    for step in path:
        keeps = _step_keeps_rows(step, seen, arguments[3])
        if keeps is False:
            return None
        made_rows = made_rows or keeps is True
        seen.add(step)
    return (node, path, arguments) if made_rows else None


def _logit_nodes(
    head: torch.fx.Node, loss: torch.fx.Node, output: torch.fx.Node
) -> tuple[list[torch.fx.Node], list[torch.fx.Node], bool] | None:
    """Everything the fusion removes: the head and every cast or view of its logits (``values``),
    the size reads only they use (``reads``), and whether the output returns any of them. None
    when anything else reads them."""
    values, reads, returned = [head], [], False
    pending = [head]
    while pending:
        node = pending.pop()
        for user in node.users:
            if user is loss or user in values or user in reads:
                continue
            if user is output:
                returned = True
            elif node_info(user).op in _METADATA_READS:
                reads.append(user)
            elif node_info(user).op in _CHAIN_OPS and user.args and user.args[0] is node:
                values.append(user)
                pending.append(user)
            else:
                return None
    removed = set(values) | set(reads) | {loss}
    # A size read may feed a view of the chain, or an item of itself ([-1]) that does; nothing else.
    for read in list(reads):
        for user in read.users:
            if user in removed:
                continue
            if user.op == "call_function" and user.target is operator.getitem and set(user.users) <= removed:
                reads.append(user)
                removed.add(user)
            else:
                return None
    return values, reads, returned


def _replace(
    gm: torch.fx.GraphModule,
    loss: torch.fx.Node,
    head_arguments: tuple[Any, Any, Any, int],
    arguments: dict[str, Any],
    removed: list[torch.fx.Node],
    output: torch.fx.Node,
) -> None:
    graph = gm.graph
    input, weight, bias, _ = head_arguments
    head = removed[0]
    low = node_info(head).out_dtype
    with graph.inserting_before(loss):
        parameters = []
        for value in (weight, bias):
            if isinstance(value, str):
                value = graph.get_attr(value)
                node_info(value).out_dtype = low
            parameters.append(value)
        kwargs = {"ignore_index": arguments["ignore_index"], "reduction": arguments["reduction"]}
        fused = graph.call_function(
            chunked_linear_cross_entropy, (input, *parameters, arguments["target"]), kwargs
        )
    # Recorded as one call if the graph is traced again.
    fused.meta[FX_WRAPPED_KEY] = True
    # The head's op: a sharded head's weight is gathered for it (an untied head is an FSDP2 group).
    computed_by_module_of(fused, head)
    info = node_info(loss)
    fused.meta[META_KEY] = info
    info.rule = Rule.FP32
    info.in_dtypes = tuple(node_info(n).out_dtype for n in fused.all_input_nodes)
    note = (
        "fused with the language model's head: amp_fx.ops.chunked_cross_entropy."
        "chunked_linear_cross_entropy (never the whole logits; gradients in the forward)"
    )
    if note not in info.notes:
        info.notes.append(note)
    loss.replace_all_uses_with(fused)
    dropped = set(removed)
    output.args = map_arg(output.args, lambda node: None if node in dropped else node)
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in sorted([loss, *removed], key=order.__getitem__, reverse=True):
        graph.erase_node(node)


def fuse_chunked_linear_loss(gm: torch.fx.GraphModule, policy: Policy) -> torch.fx.GraphModule:
    """Replace a language model's head -> casts and row views -> cross-entropy by one
    `chunked_linear_cross_entropy` call in graphs captured in training mode; returns `gm`.

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> import amp_fx
        >>> from amp_fx.captured_model import capture_states
        >>> class TinyLm(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        ...     def forward(self, ids, labels):
        ...         logits = self.head(self.embed(ids))
        ...         loss = F.cross_entropy(logits.float().view(-1, 16), labels.view(-1))
        ...         return loss, logits
        >>> model = amp_fx.convert(TinyLm(), "O2", dtype=torch.bfloat16, front_end="export")
        >>> ids = torch.randint(0, 16, (2, 5))
        >>> loss, logits = model(ids, ids)  # calls this pass: captured in training mode
        >>> type(loss) is torch.Tensor, logits
        (True, None)
        >>> graph = capture_states(model)[0][1].graphs[0]
        >>> [n.target.__name__ for n in graph.graph.nodes if n.name.startswith("chunked")]
        ['chunked_linear_cross_entropy']
    """
    if not policy.fused_chunked_linear_loss or gm.meta.get(TRAINING_MODE_KEY) is not True:
        return gm
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    fused = 0
    for loss in list(gm.graph.nodes):
        if node_info(loss).op != "cross_entropy_loss":
            continue
        arguments = cross_entropy_call_arguments(loss)
        if not _computes(arguments):
            continue
        found = _chain_to_head(gm, arguments["input"])
        if found is None:
            continue
        head, _, head_arguments = found
        logits = _logit_nodes(head, loss, output)
        if logits is None:
            continue
        values, reads, returned = logits
        if returned and policy.keep_logits:
            continue
        _replace(gm, loss, head_arguments, arguments, [*values, *reads], output)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    logger.debug("fuse_chunked_linear_loss %s: %d heads fused with their loss", policy.opt_level, fused)
    return gm


def _computes(arguments: dict[str, Any] | None) -> bool:
    """Whether the chunked op computes this cross-entropy exactly."""
    return (
        arguments is not None
        and isinstance(arguments["input"], torch.fx.Node)
        and isinstance(arguments["target"], torch.fx.Node)
        and arguments["weight"] is None
        and arguments["size_average"] is None
        and arguments["reduce"] is None
        and arguments["label_smoothing"] == 0.0
        and arguments["reduction"] in ("mean", "sum")
        and isinstance(arguments["ignore_index"], int)
        and not isinstance(arguments["ignore_index"], bool)
    )
