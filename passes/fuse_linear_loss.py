"""A convert pass (O2 on CUDA): a language model's head and its FP32 loss as one call.

At O2 a head's loss reads its low-precision logits: ``fp32_cross_entropy(lm_head(h).view(-1, V), t)``
in a torch.fx graph after `fuse_losses`, ``cross_entropy_loss(to(linear(h, W), float32), t)`` in a
torch.export graph. The backward still reads those logits and writes their gradient, a [rows, V]
pass as large as the loss's forward. `amp_fx.ops.cross_entropy.linear_cross_entropy` computes the
gradient in the loss's forward kernel, over the logits' own buffer, and its backward is only the
head's matmuls on it (under torch.compile; eagerly it runs the two calls, which are faster
there). This pass makes that replacement where it is exact: the pattern is
`amp_fx.passes.shared.linear_loss_chains`' one description for both front ends (a linear head ->
casts and row views -> cross-entropy, or nll_loss of its log_softmax; the loss reading 2-D rows of
V classes, made by a view or shown by the recorded shapes; arguments the kernel computes), and here
also nothing may return the logits: they are never made.

The head's input is reshaped to ``(-1, d)`` instead, and `linear_cross_entropy` gets the head's
weight and bias and the loss's arguments. It runs only where ``policy.fused_linear_loss``
(default True at O2 on CUDA: 0.3-0.5 ms less per compiled GPT-2 step on an H200, BENCHMARKS.md).
Left alone: a torch.fx graph's 2-D head read by the loss with no view (its rank is not known from
the graph), ``torch.matmul`` heads, hooked modules and softcapped logits (``c * tanh(x / c)``,
which `linear_cross_entropy` does not compute). It runs before `fuse_chunked_linear_loss`,
so in a graph captured in training mode a head whose logits nothing returns is this pass's; one
whose logits are returned (Hugging Face's) is the chunked pass's.

Example (O2, fp16, ``fused_linear_loss=True``)::

    before                                            after
    logits = self.lm_head(x)                          size = x.size(-1)
    view = logits.view(-1, 50304)                     rows = x.reshape(-1, size)
    loss = fp32_cross_entropy(view, t, ...)           loss = linear_cross_entropy(rows,
                                                          lm_head.weight, None, t, -100, "mean")
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule
from amp_fx.ops.cross_entropy import linear_cross_entropy
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.linear_loss_calls import head_arguments, replace_head_and_loss
from amp_fx.passes.shared.linear_loss_chains import LinearLoss, match_linear_loss

logger = logging.getLogger(__name__)

__all__ = ["fuse_linear_loss"]


def _replace(gm: torch.fx.GraphModule, match: LinearLoss, output: torch.fx.Node) -> None:
    graph = gm.graph
    input, weight, bias = head_arguments(gm, match)
    with graph.inserting_before(match.loss):
        size = graph.call_method("size", (input, -1))
        node_info(size).op, node_info(size).rule = "size", Rule.PASSTHROUGH
        rows = graph.call_method("reshape", (input, -1, size))
        rows_info = node_info(rows)
        rows_info.op, rows_info.rule = "reshape", Rule.PASSTHROUGH
        rows_info.in_dtypes, rows_info.out_dtype = (node_info(input).out_dtype,), node_info(input).out_dtype
    kwargs = {name: match.arguments[name] for name in ("ignore_index", "reduction")}
    note = (
        f"fused with the linear layer {match.head_name}: amp_fx.ops.cross_entropy.linear_cross_entropy "
        f"(under torch.compile, the gradient in the forward); replaced {match.replaced_names}"
    )
    args = (rows, weight, bias, match.arguments["target"])
    replace_head_and_loss(gm, match, output, linear_cross_entropy, args, kwargs, note=note)


def fuse_linear_loss(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Replace linear layer -> casts and row views -> cross-entropy by `linear_cross_entropy`, in
    graphs of either front end, in place on `gm` (``modified``: whether it
    fused one). Runs after `fuse_losses`.

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
    policy = context.policy
    if not (policy.fused_losses and policy.fused_linear_loss):
        return PassResult(gm, False)
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    fused = 0
    for loss in list(gm.graph.nodes):
        match = match_linear_loss(gm, loss, output)
        # linear_cross_entropy computes no softcap: such a chain is the chunked pass's.
        if match is None or match.returned or match.softcap is not None:
            continue
        _replace(gm, match, output)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    logger.debug("fuse_linear_loss %s: %d linear layers fused with their loss", policy.opt_level, fused)
    return PassResult(gm, bool(fused))
