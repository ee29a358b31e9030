"""A convert pass (O2, graphs captured in training mode): a language model's head and its
cross-entropy as one chunked call that never holds the [rows, V] logits.

What it finds is `amp_fx.passes.shared.linear_loss_chains`' one description, by canonical op names,
so it serves the torch.export front end's ATen graphs and torch.fx graphs alike::

    logits = linear(h, W[, b])                  the head (W may be tied to the embedding)
    x      = to(logits, float32) | view | reshape | flatten | contiguous | alias   (any chain)
             | x * c | x / c                    (c a power of two <= 1: the call reads h * c)
             | x / c, tanh, * c                 a softcap (any positive c, Gemma2's final logit
                                                softcapping): the call's softcap=c
    rows   = view(x, [-1, V])                   (rows of V classes: a view, or recorded shapes)
    loss   = cross_entropy_loss(rows, target, ignore_index=i, reduction="mean" | "sum")
             (or nll_loss of the rows' log_softmax)

That is Hugging Face's ``ForCausalLMLoss`` (``logits.float()``, ``view(-1, vocab_size)``,
``fixed_cross_entropy``: a mean, or a sum later divided by ``num_items_in_batch``, which stays in
the graph and divides the fused loss) and nanoGPT's loss alike. The loss must be one the chunked
op computes exactly: float32 math, no class weights, no label smoothing, no ``reduction="none"``.
The logits, and the casts and views of them, may be read only by that loss, by size reads, and by
the graph's output (the model returning them).

The head and loss become ``chunked_linear_cross_entropy(h, W, b, target, i, reduction)``
(`amp_fx.ops.chunked_cross_entropy`): low-precision cuBLAS matmuls and the fused cross-entropy
kernel per chunk of rows, gradients computed in the forward. A softcap is computed by the call in
float32 (``softcap=c``), where the graph rounded after each of its steps at O2. Nodes replaced:
the head's linear call, the chain of casts and views (and softcap) to the loss, the loss itself
and size reads only they used.
The call is recorded as the head module's op (its ``nn_module_stack``): under FSDP2 an untied
head is a group of its own, gathered for its ops alone (`shard_regions`).

Returned logits follow Liger-Kernel's convention: the output holds None in their place (a Hugging
Face model's output then has ``logits=None`` and a real ``loss``). Hence the pass runs only on
graphs whose mode is known to be training (``context.training``, known to the torch.export
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

import torch
import torch.fx

from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.linear_loss_calls import head_arguments, replace_head_and_loss
from amp_fx.passes.shared.linear_loss_chains import LinearLoss, match_linear_loss

logger = logging.getLogger(__name__)

__all__ = ["fuse_chunked_linear_loss"]

# The reductions the chunked op computes ("none" would need the per-row losses it never keeps).
_REDUCTIONS = ("mean", "sum")


def _replace(gm: torch.fx.GraphModule, match: LinearLoss, output: torch.fx.Node) -> None:
    kwargs = {name: match.arguments[name] for name in ("ignore_index", "reduction")}
    if match.softcap is not None:
        kwargs["softcap"] = match.softcap
    note = (
        f"fused with the language model's head {match.head_name}: amp_fx.ops.chunked_cross_entropy."
        "chunked_linear_cross_entropy (never the whole logits; gradients in the forward); replaced "
        + match.replaced_names
    )
    args = (*head_arguments(gm, match), match.arguments["target"])
    replace_head_and_loss(gm, match, output, chunked_linear_cross_entropy, args, kwargs, note=note)


def fuse_chunked_linear_loss(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Replace a language model's head -> casts and row views -> cross-entropy by one
    `chunked_linear_cross_entropy` call in graphs captured in training mode (``context.training``), in
    place on `gm` (``modified``: whether it fused one).

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> import amp_fx
        >>> from amp_fx.capture.captured_model import capture_states
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
    policy = context.policy
    if not policy.fused_chunked_linear_loss or context.training is not True:
        return PassResult(gm, False)
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    fused = 0
    for loss in list(gm.graph.nodes):
        match = match_linear_loss(gm, loss, output)
        if match is None or match.arguments["reduction"] not in _REDUCTIONS:
            continue
        if match.returned and policy.keep_logits:
            continue
        _replace(gm, match, output)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    logger.debug("fuse_chunked_linear_loss %s: %d heads fused with their loss", policy.opt_level, fused)
    return PassResult(gm, bool(fused))
