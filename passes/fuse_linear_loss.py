"""A convert pass (O2 on CUDA): a language model's head and its FP32 loss as one call.

After `fuse_losses`, a GPT's loss reads its low-precision logits directly:
``fp32_cross_entropy(lm_head(h).view(-1, V), t)``. The backward still reads those logits and writes
their gradient, a [rows, V] pass as large as the loss's forward.
`amp_fx.ops.cross_entropy.linear_cross_entropy` computes the gradient in the loss's forward kernel,
over the logits' own buffer, and its backward is only the head's matmuls on it (under
torch.compile; eagerly it runs the two calls, which are faster there). This pass makes that
replacement where it is exact:

- the loss is a fused `fp32_cross_entropy` (so its arguments are ones the kernel computes);
- its input comes from a linear layer (``nn.Linear`` without hooks, or ``F.linear``) through views
  that keep rows: ``view``/``reshape`` to ``(-1, V)`` (V written as a number or as
  ``x.size(-1)`` / ``x.shape[-1]`` of that chain), ``flatten(0, -2)``, ``contiguous``; at least one
  of them, so the loss reads 2-D (rows, V) logits;
- nothing else reads the layer's output or those views (a read of their sizes only is fine).

The linear layer's input is reshaped to ``(-1, d)`` instead, and `linear_cross_entropy` gets the
layer's weight and bias and the loss's arguments. It runs only where ``policy.fused_linear_loss``
(default True at O2 on CUDA: 0.3-0.5 ms less per compiled GPT-2 step on an H200, BENCHMARKS.md).
Left alone: a 2-D head read by the loss with no view (its rank is not known from the graph),
``torch.matmul`` heads and hooked modules. A chunked head that never holds the whole [rows, V]
logits is `fuse_chunked_linear_loss`'s, in graphs captured in training mode.

Example (O2, fp16, ``fused_linear_loss=True``)::

    before                                            after
    logits = self.lm_head(x)                          size = x.size(-1)
    view = logits.view(-1, 50304)                     rows = x.reshape(-1, size)
    loss = fp32_cross_entropy(view, t, ...)           loss = linear_cross_entropy(rows,
                                                          lm_head.weight, None, t, -100, "mean")
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.core.node_info import FX_WRAPPED_KEY, META_KEY, node_info
from amp_fx.core.op_facts import SHAPE_METHODS
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.cross_entropy import fp32_cross_entropy, linear_cross_entropy
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.losses import is_fusable_loss, is_last_size_of

logger = logging.getLogger(__name__)

__all__ = ["fuse_linear_loss"]


def _is_plain_linear(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return (
            isinstance(module, nn.Linear)
            and type(module).forward is nn.Linear.forward
            and not has_forward_hooks(module)
            and len(node.args) == 1
            and not node.kwargs
        )
    return node.op == "call_function" and node.target is F.linear


def _linear_arguments(
    gm: torch.fx.GraphModule, linear: torch.fx.Node
) -> tuple[torch.fx.Node, torch.fx.Node | str, torch.fx.Node | str | None] | None:
    """(input, weight, bias) of the linear call: nodes, or attribute paths of the module's own
    parameters (made get_attr nodes by the caller); None when they cannot be read."""
    if linear.op == "call_module":
        module = gm.get_submodule(linear.target)
        bias = f"{linear.target}.bias" if module.bias is not None else None
        return linear.args[0], f"{linear.target}.weight", bias
    names = ("input", "weight", "bias")
    if len(linear.args) > 3 or not set(linear.kwargs) <= set(names):
        return None
    arguments = dict(zip(names, linear.args, strict=False)) | dict(linear.kwargs)
    if not isinstance(arguments.get("input"), torch.fx.Node) or not isinstance(
        arguments.get("weight"), torch.fx.Node
    ):
        return None
    bias = arguments.get("bias")
    if bias is not None and not isinstance(bias, torch.fx.Node):
        return None
    return arguments["input"], arguments["weight"], bias


def _keeps_rows(view: torch.fx.Node, chain: set[torch.fx.Node], num_classes: int | None) -> bool | None:
    """True for a view to (-1, last dim) or flatten(0, -2), None for contiguous (no change),
    False otherwise."""
    if view.op != "call_method" or not view.args:
        return False
    name = view.target
    if name == "contiguous":
        return None if len(view.args) == 1 and not view.kwargs else False
    if name == "flatten":
        arguments = dict(zip(("start_dim", "end_dim"), view.args[1:], strict=False)) | dict(view.kwargs)
        return arguments.get("start_dim", 0) == 0 and arguments.get("end_dim") == -2
    if name not in ("view", "reshape") or view.kwargs:
        return False
    shape = list(view.args[1:])
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = list(shape[0])
    if len(shape) != 2 or shape[0] != -1:
        return False
    last = shape[1]
    return (num_classes is not None and last == num_classes) or is_last_size_of(last, chain)


def _row_view_chain(
    gm: torch.fx.GraphModule, logits: torch.fx.Node
) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the linear node, the views from it to ``logits``) when ``logits`` is a row-keeping view
    chain of a plain linear call, else None."""
    views: list[torch.fx.Node] = []
    node = logits
    while not _is_plain_linear(gm, node):
        if node.op != "call_method" or node.target not in ("view", "reshape", "flatten", "contiguous"):
            return None
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        views.append(node)
        node = node.args[0]
    linear = node
    views.reverse()
    num_classes = gm.get_submodule(linear.target).out_features if linear.op == "call_module" else None
    chain = {linear}
    flattened = False
    for view in views:
        keeps = _keeps_rows(view, chain, num_classes)
        if keeps is False:
            return None
        flattened = flattened or keeps is True
        chain.add(view)
    return (linear, views) if flattened else None


def _metadata_readers(chain: list[torch.fx.Node], loss: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The size/shape reads of the chain's nodes (and their [-1] items) that only the chain uses:
    erased with it. None when a node of the chain has any other reader."""
    inside = set(chain) | {loss}
    readers: list[torch.fx.Node] = []
    for node in chain:
        for user in node.users:
            if user in inside:
                continue
            is_size = user.op == "call_method" and user.target in SHAPE_METHODS
            is_shape = (
                user.op == "call_function" and user.target is getattr and list(user.args[1:]) == ["shape"]
            )
            if not (is_size or is_shape):
                return None
            readers.append(user)
    items = [item for reader in readers for item in reader.users if item not in inside]
    for item in items:
        if not (item.op == "call_function" and item.target is operator.getitem and set(item.users) <= inside):
            return None
    if any(not set(reader.users) <= inside | set(items) for reader in readers):
        return None
    return items + readers


def _replace(
    gm: torch.fx.GraphModule,
    loss: torch.fx.Node,
    linear: torch.fx.Node,
    views: list[torch.fx.Node],
    dead_readers: list[torch.fx.Node],
    arguments: tuple,
) -> None:
    graph = gm.graph
    input, weight, bias = arguments
    low = node_info(linear).out_dtype
    with graph.inserting_before(loss):
        if isinstance(weight, str):
            weight = graph.get_attr(weight)
            node_info(weight).out_dtype = low
        if isinstance(bias, str):
            bias = graph.get_attr(bias)
            node_info(bias).out_dtype = low
        size = graph.call_method("size", (input, -1))
        node_info(size).op, node_info(size).rule = "size", Rule.PASSTHROUGH
        rows = graph.call_method("reshape", (input, -1, size))
        rows_info = node_info(rows)
        rows_info.op, rows_info.rule = "reshape", node_info(views[0]).rule
        rows_info.in_dtypes, rows_info.out_dtype = (node_info(input).out_dtype,), node_info(input).out_dtype
        kwargs = {name: loss.kwargs[name] for name in ("ignore_index", "reduction")}
        fused = graph.call_function(linear_cross_entropy, (rows, weight, bias, loss.kwargs["target"]), kwargs)
    # Recorded as one call if the graph is traced again.
    fused.meta[FX_WRAPPED_KEY] = True
    info = node_info(loss)
    fused.meta[META_KEY] = info
    info.in_dtypes = tuple(node_info(n).out_dtype for n in fused.all_input_nodes)
    where = linear.target if linear.op == "call_module" else linear.name
    note = (
        f"fused with the linear layer {where}: amp_fx.ops.cross_entropy.linear_cross_entropy "
        "(under torch.compile, the gradient in the forward)"
    )
    if note not in info.notes:
        info.notes.append(note)
    loss.replace_all_uses_with(fused)
    for node in (loss, *reversed(views), *dead_readers, linear):
        graph.erase_node(node)


def fuse_linear_loss(gm: torch.fx.GraphModule, policy: Policy) -> torch.fx.GraphModule:
    """Replace linear layer -> row views -> `fp32_cross_entropy` by `linear_cross_entropy`;
    returns `gm`. Runs after `fuse_losses`.

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from amp_fx import convert
        >>> from amp_fx.core.policy import preset
        >>> class LmWithLoss(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        ...     def forward(self, idx, targets):
        ...         logits = self.head(self.emb(idx))
        ...         return F.cross_entropy(logits.view(-1, 16), targets.view(-1))
        >>> policy = preset("O2", torch.float16, fused_linear_loss=True)
        >>> gm = convert(LmWithLoss(), "O2", policy=policy)  # calls this pass
        >>> [n.target.__name__ for n in gm.graph.nodes if "cross_entropy" in n.name]
        ['linear_cross_entropy']
    """
    if not (policy.fused_losses and policy.fused_linear_loss):
        return gm
    fused = 0
    for loss in list(gm.graph.nodes):
        if loss.op != "call_function" or loss.target is not fp32_cross_entropy:
            continue
        # As fuse_losses writes it: the logits, the rest by name (the kernel's arguments only).
        if len(loss.args) != 1 or not is_fusable_loss({"input": loss.args[0], **loss.kwargs}):
            continue
        found = _row_view_chain(gm, loss.args[0])
        if found is None:
            continue
        linear, views = found
        if len(views[-1].users) != 1:
            continue
        dead_readers = _metadata_readers([linear, *views], loss)
        arguments = _linear_arguments(gm, linear)
        if dead_readers is None or arguments is None:
            continue
        _replace(gm, loss, linear, views, dead_readers, arguments)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    logger.debug("fuse_linear_loss %s: %d linear layers fused with their loss", policy.opt_level, fused)
    return gm
