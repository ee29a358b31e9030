"""A convert pass (O2): FP32 losses that read low-precision logits without a float32 copy.

At O2 ``cross_entropy`` is an FP32 island, so `insert_casts` gives it ``logits.to(float32)``. For a
language model that cast is the most expensive op of the step: GPT-2 at 16 x 1024 tokens writes
3.3 GB of float32 logits, runs log_softmax over them in float32, and does the same again backward.
`amp_fx.ops.cross_entropy.fp32_cross_entropy` computes the same float32 math straight from the low-precision
logits (one read forward; the gradient rounded once to their dtype backward, as the cast's
backward rounds it), so this pass points the loss at the cast's source and drops the cast when
nothing else reads it. It runs only where ``policy.fused_losses`` (default: O2), and only on calls
whose arguments the fused kernel computes (no class weights, no label smoothing, no legacy
``size_average``/``reduce``); `fp32_cross_entropy` itself falls back to the cast for input ranks
and target kinds that are only known at run time.

One description matches both front ends (`_loss_call`; the arguments read by
`amp_fx.passes.shared.losses`): ``F.cross_entropy``, ``nn.CrossEntropyLoss`` and ATen's
``cross_entropy_loss``, or an ``nll_loss`` (``F.nll_loss``, ATen's ``nll_loss`` / ``nll_loss_nd``)
of a ``log_softmax`` over the classes that only it reads, which the fused call then replaces too.
A log_softmax over another dim stays as it is.

Where the graph shows that nothing reads the logits after the loss (they come, through views
only, from a linear layer or matmul whose backward does not need its output, and have no other
user), the call also gets ``grad_into_input=True``: its backward writes the gradient over the
logits instead of allocating another logits-sized tensor at the step's memory peak.

Example (O2, fp16)::

    before                                          after
    logits = linear(h, weight)        (float16)     logits = linear(h, weight)
    logits_to_float32 = logits.to(torch.float32)
    loss = F.cross_entropy(logits_to_float32, t)    loss = fp32_cross_entropy(logits, t,
                                                        ..., grad_into_input=True)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES, dtype_name
from amp_fx.core.node_info import node_info
from amp_fx.core.op_facts import METADATA_ATTRIBUTES, OUTPUT_NOT_SAVED_OPS, RESHAPE_OPS, SHAPE_METHODS
from amp_fx.core.policy import Rule
from amp_fx.ops.cross_entropy import fp32_cross_entropy
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.dtypes import dtype_is_assumed
from amp_fx.passes.shared.fused_calls import retarget_call
from amp_fx.passes.shared.losses import (
    CROSS_ENTROPY_PARAMETERS,
    cross_entropy_call_arguments,
    is_fusable_loss,
    log_softmax_over_classes,
    nll_loss_call_arguments,
)

logger = logging.getLogger(__name__)

__all__ = ["fuse_losses"]


def _module_arguments(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict[str, Any] | None:
    """A plain nn.CrossEntropyLoss call's arguments by name (torch.fx graphs), or None: a subclass
    with its own forward, hooks, or arguments the signature lacks."""
    module = gm.get_submodule(node.target)
    if type(module).forward is not nn.CrossEntropyLoss.forward or len(node.args) + len(node.kwargs) != 2:
        return None
    if has_forward_hooks(module):
        return None  # replaced by a function call, the module would not run, nor its hooks
    inputs = dict(zip(("input", "target"), node.args, strict=False)) | dict(node.kwargs)
    return inputs | {
        "weight": module.weight,
        "size_average": None,
        "ignore_index": module.ignore_index,
        "reduce": None,
        "reduction": module.reduction,
        "label_smoothing": module.label_smoothing,
    }


def _loss_call(
    gm: torch.fx.GraphModule, node: torch.fx.Node
) -> tuple[dict[str, Any], list[torch.fx.Node]] | None:
    """F.cross_entropy's arguments (``input``: the float32 logits) of an FP32 cross-entropy in
    either front end's spelling, and the nodes between those logits and the loss that the fused
    call replaces; None for anything else. The spellings: ``cross_entropy_loss`` (F.cross_entropy,
    nn.CrossEntropyLoss, ATen's), or ``nll_loss`` (F.nll_loss, ATen's nll_loss / nll_loss_nd) of a
    ``log_softmax`` over the classes that nothing else reads."""
    info = node_info(node)
    if info.rule is not Rule.FP32:
        return None
    if info.op == "cross_entropy_loss":
        if node.op == "call_module":
            return (arguments, []) if (arguments := _module_arguments(gm, node)) is not None else None
        return (arguments, []) if (arguments := cross_entropy_call_arguments(node)) is not None else None
    if info.op != "nll_loss" or (arguments := nll_loss_call_arguments(node)) is None:
        return None
    log_softmax = arguments["input"]
    if (
        not isinstance(log_softmax, torch.fx.Node)
        or node_info(log_softmax).op != "log_softmax"
        or node_info(log_softmax).rule is not Rule.FP32
        or len(log_softmax.users) != 1
        or not log_softmax_over_classes(gm, log_softmax)
    ):
        return None
    return arguments | {"input": log_softmax.args[0]}, [log_softmax]


# Users that read a tensor's metadata, never its values (``logits.view(-1, logits.size(-1))``).
_METADATA_READS = SHAPE_METHODS | METADATA_ATTRIBUTES


def _value_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [user for user in node.users if node_info(user).op not in _METADATA_READS]


def _only_the_loss_reads(logits: torch.fx.Node) -> bool:
    """True when `logits` and everything it is a view of have one user each, back to a producer
    whose backward does not read its output: the loss may then overwrite them."""
    node = logits
    while len(_value_users(node)) == 1 and node.op in ("call_function", "call_method", "call_module"):
        op = node_info(node).op
        if op in OUTPUT_NOT_SAVED_OPS:
            return True
        if op not in RESHAPE_OPS or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        node = node.args[0]
    return False


def _low_precision_source(cast: torch.fx.Node) -> torch.fx.Node | None:
    """The low-precision value `cast` widens to float32 (an exact cast), or None."""
    info = node_info(cast)
    if not info.is_cast or info.out_dtype != torch.float32 or not cast.args:
        return None
    source = cast.args[0]
    if not isinstance(source, torch.fx.Node):
        return None
    # Only a known low dtype: a value of unknown or assumed dtype (a model input without
    # example_inputs) may hold float64, which autocast and the guarded cast leave as it is.
    if dtype_is_assumed(source) or node_info(source).out_dtype not in LOW_PRECISION_DTYPES:
        return None
    return source


def fuse_losses(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Point FP32 cross-entropy losses at their low-precision logits, in place on `gm`
    (``modified``: whether it fused one).

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> from amp_fx import convert
        >>> class LmWithLoss(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        ...     def forward(self, idx, targets):
        ...         logits = self.head(self.emb(idx))
        ...         return F.cross_entropy(logits.view(-1, 16), targets.view(-1))
        >>> gm = convert(LmWithLoss(), "O2")  # calls this pass
        >>> [n.target.__name__ for n in gm.graph.nodes if "cross_entropy" in n.name]
        ['fp32_cross_entropy']
    """
    policy = context.policy
    if not policy.fused_losses:
        return PassResult(gm, False)
    fused = 0
    for node in list(gm.graph.nodes):
        info = node_info(node)
        found = _loss_call(gm, node)
        if found is None or not is_fusable_loss(found[0]):
            continue
        arguments, replaced = found
        cast = arguments["input"]
        source = _low_precision_source(cast)
        if source is None:
            continue
        seen = dict(zip(node.all_input_nodes, info.in_dtypes, strict=False))
        rest = {name: arguments[name] for name in CROSS_ENTROPY_PARAMETERS[1:]}
        low = dtype_name(node_info(source).out_dtype)
        note = f"fused: reads the {low} logits, computes in float32 (no float32 copy)"
        retarget_call(node, fp32_cross_entropy, (source,), rest, note=note)
        info.op = "cross_entropy_loss"  # an nll_loss of its log_softmax is one now
        seen[source] = node_info(source).out_dtype
        info.in_dtypes = tuple(seen.get(n) for n in node.all_input_nodes)
        for step in (*reversed(replaced), cast):
            if not step.users:
                gm.graph.erase_node(step)
        if _only_the_loss_reads(source):
            node.kwargs = {**node.kwargs, "grad_into_input": True}
        fused += 1
    if fused:
        gm.recompile()
    logger.debug("fuse_losses %s: %d cross-entropy losses read low-precision logits", policy.opt_level, fused)
    return PassResult(gm, bool(fused))
