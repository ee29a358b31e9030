"""Pass 3 of convert: give every call node its `Rule` from the policy, with the reason.

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

Besides asking `Policy.decide`, classify knows three things the policy cannot:

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
import operator

import torch
import torch.fx
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.core.op_lists import OPAQUE_OP
from amp_fx.core.policy import Decision, Policy, Rule
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.ops.fused_batch_norm import FusedBatchNormAct

logger = logging.getLogger(__name__)

__all__ = ["classify", "decide_node", "is_inplace_call", "calling_module"]

_INPLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.imatmul,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.setitem,
    }
)


def is_inplace_call(node: torch.fx.Node) -> bool:
    """True for ``x.add_(y)``, ``x += y``, ``x[i] = y`` and functions called with ``inplace=True``.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.exp_())
    >>> [is_inplace_call(n) for n in gm.graph.nodes]
    [False, True, False]
    """
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        return node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True
    return False


def calling_module(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[str | None, type | None]:
    """(qualified name, type) of the module whose forward made this call, or (None, None) at top level.

    For a ``call_module`` node that is the module itself; for a function or method called inside a
    traced-through module it is the innermost module of fx's ``nn_module_stack``.
    """
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return node.target, type(module)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None, None
    path, entry = next(reversed(stack.items()))
    module_type = entry[1] if isinstance(entry, tuple) and len(entry) > 1 else None
    name = entry[0] if isinstance(entry, tuple) and isinstance(entry[0], str) else path
    return name, module_type if isinstance(module_type, type) else None


def decide_node(node: torch.fx.Node, gm: torch.fx.GraphModule, policy: Policy) -> Decision | None:
    """The policy's decision for one call node (None for placeholders, get_attr, output).

    This is the one place a node is turned into a ``policy.decide`` question; `classify` keeps its
    rule and reason, `cast_parameters` its ``param_dtype``.
    """
    if node.op not in ("call_module", "call_function", "call_method"):
        return None
    info = node_info(node)
    if info.is_cast:
        return Decision(Rule.PASSTHROUGH, info.cast_reason or "amp_fx cast", None)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, FusedBatchNormAct):  # asked about the BatchNorm it calls
            batch_norm = module.batch_norm
            return policy.decide("batch_norm", module.batch_norm_name, type(batch_norm))
        if isinstance(module, AutocastIsland):
            wrapped = module.wrapped
            decision = policy.decide(
                OPAQUE_OP,
                module_name=module.name if isinstance(wrapped, nn.Module) else None,
                module_type=type(wrapped) if isinstance(wrapped, nn.Module) else None,
            )
            reason = f"runs {module.name} under torch.autocast({module.device_type!r}, {module.dtype})"
            return Decision(Rule.OPAQUE, reason, decision.param_dtype)
    if is_inplace_call(node) and info.op != OPAQUE_OP:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        reason = f"in-place {name}: autocast leaves in-place ops alone (a cast would write into a copy)"
        return Decision(Rule.PASSTHROUGH, reason, None)
    module_name, module_type = calling_module(node, gm)
    # `normalize_ops` names untraced code OPAQUE_OP; a call it did not name is asked by its
    # target's name (the policy's global rule then applies).
    op = info.op or getattr(node.target, "__name__", str(node.target))
    decision = policy.decide(op, module_name=module_name, module_type=module_type)
    if op == OPAQUE_OP and info.opaque_reason:
        return Decision(decision.rule, f"{decision.reason} ({info.opaque_reason})", decision.param_dtype)
    return decision


def classify(gm: torch.fx.GraphModule, policy: Policy) -> torch.fx.GraphModule:
    """Set ``node_info(node).rule`` and ``.reason`` on every call node from `policy`.

    Placeholders, get_attr and output nodes get no rule. Returns `gm` (graph unchanged).

    Example::

        >>> gm = classify(normalize_ops(trace(nn.Sequential(nn.Linear(2, 2), nn.Softmax(-1)))),
        ...               preset("O2", dtype=torch.bfloat16, device_type="cpu"))
        >>> [(node_info(n).op, node_info(n).rule) for n in gm.graph.nodes if n.op == "call_module"]
        [('linear', <Rule.LOWER: 'lower'>), ('softmax', <Rule.FP32: 'fp32'>)]
    """
    counts: dict[Rule, int] = {}
    for node in gm.graph.nodes:
        decision = decide_node(node, gm, policy)
        if decision is None:
            continue
        info = node_info(node)
        info.rule, info.reason = decision.rule, decision.reason
        counts[decision.rule] = counts.get(decision.rule, 0) + 1
    logger.debug("classify %s: %s", policy.opt_level, {rule.value: n for rule, n in counts.items()})
    return gm
