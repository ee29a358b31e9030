"""A convert pass: give every call node its `Rule` from the policy, with the reason.

The rule says how a node's floating inputs are cast before it runs: LOWER (to fp16/bf16), FP32,
PROMOTE (to the widest floating input), PASSTHROUGH (no casts) or OPAQUE (untraced code, run in
an autocast island under O1/O2). The graph is not changed; the rule and the reason go to
``node_info(node)``, where the later passes and the report read them.

Example (O1, CPU, bf16)::

    before (rules unset)                      after
    x = placeholder                            x
    fc = call_module fc (op linear)            fc        LOWER        autocast cpu lower_precision_fp list
    relu = call_function relu                  relu      PASSTHROUGH  O1: relu is dtype-agnostic
    pow = call_method pow_ (in-place)          pow_      PASSTHROUGH  in-place pow_: autocast leaves it alone
    output                                     output

The question for each node is `amp_fx.passes.shared.decisions.decide_node` (`cast_parameters` plans
storage dtypes with it too). Besides asking `Policy.decide`, it knows three things the policy
cannot:

- amp_fx's own nodes (cast nodes and `AutocastIsland` calls, present when a converted graph is
  converted again) keep their meaning: casts are PASSTHROUGH, islands OPAQUE.
- in-place variants (``x.exp_()``, ``x += y``) are PASSTHROUGH: autocast registers only the
  out-of-place ops, and casting the input of an in-place op would write into a copy.
- calls inside a traced-through module are decided with that module's name and type (from fx's
  ``nn_module_stack``), so module-name and module-type overrides cover the ops of the modules
  the tracer looked into, not only leaf modules.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.decisions import decide_node

logger = logging.getLogger(__name__)

__all__ = ["classify"]


def classify(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Set ``node_info(node).rule`` and ``.reason`` on every call node from `policy`.

    Placeholders, get_attr and output nodes get no rule. Returns ``PassResult(gm, False)``
    (the graph is unchanged).

    Example::

        >>> from torch import nn
        >>> from amp_fx.core.policy import preset
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> from amp_fx.capture.fx import trace
        >>> gm = normalize_ops(trace(nn.Sequential(nn.Linear(2, 2), nn.Softmax(-1)))).graph_module
        >>> gm = classify(gm, Conversion(preset("O2", dtype=torch.bfloat16, device_type="cpu"))).graph_module
        >>> [(node_info(n).op, node_info(n).rule) for n in gm.graph.nodes if n.op == "call_module"]
        [('linear', <Rule.LOWER: 'lower'>), ('softmax', <Rule.FP32: 'fp32'>)]
    """
    policy = context.policy
    counts: dict[Rule, int] = {}
    for node in gm.graph.nodes:
        decision = decide_node(node, gm, policy)
        if decision is None:
            continue
        info = node_info(node)
        info.rule, info.reason = decision.rule, decision.reason
        counts[decision.rule] = counts.get(decision.rule, 0) + 1
    logger.debug("classify %s: %s", policy.opt_level, {rule.value: n for rule, n in counts.items()})
    return PassResult(gm, False)  # annotations only
