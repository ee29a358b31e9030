"""What the convert passes record on each fx node, read by `amp_fx.report`, and the keys a
converted or captured graph keeps in ``gm.meta`` (each with who writes and who reads it).

Every pass writes into one `NodeInfo` per node, stored as ``node.meta["amp_fx"]``; no pass
reads another pass's private state. What the passes read besides the graph (the policy, the
example inputs, the front end's facts, the parameter plan) is the conversion's context,
`amp_fx.passes.shared.conversion.Conversion`, not a record here. Example::

    >>> info = NodeInfo(op="linear", rule=Rule.LOWER, reason="autocast cuda lower_precision_fp list")
    >>> info.is_cast
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from amp_fx.core.rules import Rule

# Where amp_fx keeps its records: each node's NodeInfo in node.meta[META_KEY] (written by the passes,
# read by the later passes and `amp_fx.report`).
META_KEY = "amp_fx"
# gm.meta keys of a converted graph, written by `amp_fx.pipeline.rewrite_graph` for after the
# conversion: its policy (read by `amp_fx.report`, and by `amp_fx.convert`, `amp_fx.training.fsdp`
# and the capture to know a converted graph and its policy) and its traced code before any cast
# (read by `amp_fx.report`). What the passes read during the conversion is in its context
# (`amp_fx.passes.shared.conversion.Conversion`), never in gm.meta.
POLICY_KEY = "amp_fx_policy"
ORIGINAL_CODE_KEY = "amp_fx_original_code"
# gm.meta of a torch.export front end graph: the ``module.training`` it was captured in; written
# by `amp_fx.capture.captured_model` and read by the capture (`amp_fx.capture.graph_choice`), to
# pick a graph for a call.
TRAINING_MODE_KEY = "amp_fx_training"
# gm.meta keys of a `TracedGraphModule`, written by `amp_fx.capture.fx.trace`: the traced model's
# ``inspect.signature(model.forward)`` (read by `TracedGraphModule`), and (training, graph) for the
# mode whose graph is not ``gm.graph`` where the two modes' graphs differ (read by the capture,
# `amp_fx.convert`, which rewrites both, and the inspect tools).
FORWARD_SIGNATURE_KEY = "amp_fx_forward_signature"
OTHER_MODE_GRAPH_KEY = "amp_fx_other_mode_graph"
# gm.meta key written by `amp_fx.capture.fx.trace`: qualified name -> opaque_reason of each
# submodule that stopped the tracer (not those the user named in leaf_modules), for
# `amp_fx.convert` to capture another way.
UNTRACEABLE_MODULES_KEY = "amp_fx_untraceable_modules"
# torch.fx's own node.meta key: a call_function recorded as a call (``torch.fx.wrap``), so tracing
# the graph again records it as a call too instead of tracing into it.
FX_WRAPPED_KEY = "is_wrapped"


@dataclass
class NodeInfo:
    # Canonical op name after `normalize_ops` ("linear", "softmax", "add", ...); None for
    # placeholders, outputs and get_attr nodes.
    op: str | None = None
    rule: Rule | None = None
    # Why the policy chose `rule`, e.g. "O1 cpu lower_precision_fp list" or "override: module name 'head'".
    reason: str = ""
    # Dtypes of the tensor inputs as the node sees them after casts (None where not a tensor/unknown).
    in_dtypes: tuple[torch.dtype | None, ...] = ()
    out_dtype: torch.dtype | None = None
    # True for nodes inserted by amp_fx (casts at op inputs, model entry and outputs).
    is_cast: bool = False
    cast_reason: str = ""
    # Why this node is opaque: "leaf_modules", "fx.wrap", or "untraceable: file:line: source".
    opaque_reason: str | None = None
    # Free-form extras a pass wants to show in the report (e.g. which params were kept fp32).
    notes: list[str] = field(default_factory=list)
    # For a linear layer of a policy with ``fp8``: "FP8, recipe ..." or "not FP8: <why>"
    # (`amp_fx.passes.use_fp8_linears`); "" where no FP8 decision was made.
    fp8: str = ""


def node_info(node: torch.fx.Node) -> NodeInfo:
    """Return the node's `NodeInfo`, creating an empty one on first use."""
    info = node.meta.get(META_KEY)
    if info is None:
        info = NodeInfo()
        node.meta[META_KEY] = info
    return info
