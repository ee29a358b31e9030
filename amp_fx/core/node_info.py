"""What the convert passes record on each fx node, read by `amp_fx.report`.

Every pass writes into one `NodeInfo` per node, stored as ``node.meta["amp_fx"]``; no pass
reads another pass's private state. Example::

    >>> info = NodeInfo(op="linear", rule=Rule.LOWER, reason="autocast cuda lower_precision_fp list")
    >>> info.is_cast
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from amp_fx.core.rules import Rule

# Where amp_fx keeps its records: each node's NodeInfo in node.meta[META_KEY]; a converted
# GraphModule's policy and its traced code before any cast in gm.meta (read by amp_fx.report).
META_KEY = "amp_fx"
POLICY_KEY = "amp_fx_policy"
ORIGINAL_CODE_KEY = "amp_fx_original_code"
# Set on a graph whose parameters are already stored in their dtypes (a converted graph converted
# again): the passes leave them as they are.
PARAMETERS_STORED_KEY = "amp_fx_parameters_stored"
# gm.meta of a torch.export front end graph: qualified names of the parameters not stored yet (left
# FP32 at convert, see `amp_fx.capture.captured_model`); the passes store those the graph reads, as on the
# fx front end, and leave every other parameter as it is.
UNSTORED_PARAMETERS_KEY = "amp_fx_unstored_parameters"
# gm.meta: indices of the graph's flat outputs that keep the dtype they are computed in (a KV
# cache's tensors, a container's state after the call), not cast per ``cast_model_outputs``.
KEEP_OUTPUT_DTYPE_KEY = "amp_fx_keep_output_dtype"
# gm.meta: indices of the graph's placeholders that its users see in their own dtype (a KV cache's
# tensors passed back in), not cast at the model entry (O2/O3): state the model itself left there.
KEEP_INPUT_DTYPE_KEY = "amp_fx_keep_input_dtype"
# gm.meta of a torch.export front end graph: the ``module.training`` it was captured in.
TRAINING_MODE_KEY = "amp_fx_training"
# gm.meta: (policy, qualified name -> storage dtype) of the parameters `cast_parameters` will cast,
# planned once by the first pass that needs it (`amp_fx.passes.shared.decisions.parameter_plan`).
PARAMETER_PLAN_KEY = "amp_fx_parameter_plan"
# gm.meta keys of a `TracedGraphModule`: the traced model's ``inspect.signature(model.forward)``, and
# (training, graph) for the mode whose graph is not ``gm.graph`` where the two modes' graphs differ.
FORWARD_SIGNATURE_KEY = "amp_fx_forward_signature"
OTHER_MODE_GRAPH_KEY = "amp_fx_other_mode_graph"
# gm.meta key: qualified name -> opaque_reason of each submodule that stopped the tracer (not those
# the user named in leaf_modules), for a later step to capture another way.
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
