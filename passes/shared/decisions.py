"""The policy's decisions for the graph: the rule of one node (`decide_node`, read by `classify`),
of a module as the op it computes (`decide_module`, also where no graph exists yet) and the
storage dtype of every parameter (`planned_parameter_dtypes`): the pipeline makes that plan once,
after `classify`, into the conversion's context (`plan_parameters`), where `propagate_dtypes`,
`insert_casts` and `cast_parameters` read it.

    >>> [name for name, _ in module_tensors(nn.BatchNorm1d(2), "bn")][:3]
    ['bn.weight', 'bn.bias', 'bn.running_mean']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.fx
from torch import nn

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.module_ops import module_op
from amp_fx.core.node_info import node_info
from amp_fx.core.op_facts import NORM_OPS, VALUE_MOVING_OPS
from amp_fx.core.op_lists import OPAQUE_OP, ROUTER_OP
from amp_fx.core.policy import Decision, Policy, Rule
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.ops.batch_norm import FusedBatchNormAct
from amp_fx.passes.shared.call_nodes import calling_module, is_inplace_call
from amp_fx.passes.shared.conversion import Conversion

__all__ = [
    "UNLOWERED_PARAMETER_REASON",
    "decide_module",
    "decide_node",
    "module_tensors",
    "plan_parameters",
    "planned_parameter_dtypes",
]


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
    if op in _ROUTER_MATMUL_OPS and _decides_routers(policy) and computes_router_logits(node):
        decision = policy.decide(ROUTER_OP, module_name=module_name, module_type=module_type)
        return Decision(decision.rule, f"{decision.reason} [{op}]", decision.param_dtype)
    decision = policy.decide(op, module_name=module_name, module_type=module_type)
    if op == OPAQUE_OP and info.opaque_reason:
        return Decision(decision.rule, f"{decision.reason} ({info.opaque_reason})", decision.param_dtype)
    return decision


# The matrix products a router computes its logits with, and the ops that may stand between its
# logits and the top-k picking experts (scores, a bias, a temperature) besides those that only move
# or cast values. A norm, an activation or another matrix product on the way means the product is
# not a router's (a residual stream reaches a router through a norm and the router's own product).
_ROUTER_MATMUL_OPS = frozenset({"linear", "matmul", "mm", "addmm", "einsum"})
_ROUTER_SCORE_OPS = frozenset({"softmax", "log_softmax", "sigmoid", "add", "sub", "mul", "div", "neg"})


def _decides_routers(policy: Policy) -> bool:
    # Levels without the rule (O1 follows autocast's lists; O3 has no FP32 islands) decide a
    # router's product as the product it is.
    return ROUTER_OP in policy.op_rules or ROUTER_OP in policy.op_overrides


def computes_router_logits(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value reaches a ``topk`` through score ops only (softmax, sigmoid,
    arithmetic, views, casts): a mixture-of-experts router's logits, which the policy decides as
    ``ROUTER_OP`` (O2 keeps them FP32; `amp_fx.core.preset_rules.ROUTER_REASON`).

    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> from amp_fx.capture.fx import trace
    >>> class Router(nn.Linear):
    ...     def forward(self, x):
    ...         return torch.topk(torch.softmax(super().forward(x).float(), -1), 2).indices
    >>> gm = normalize_ops(trace(nn.Sequential(nn.Linear(4, 4), Router(4, 3)))).graph_module
    >>> [computes_router_logits(n) for n in gm.graph.nodes if node_info(n).op == "linear"]
    [False, True]
    """
    pending, seen = [node], {node}
    while pending:
        for user in pending.pop().users:
            info = node_info(user)
            if info.op == "topk" and user.args and user.args[0] in seen:
                return True
            if user not in seen and (
                info.is_cast or info.op in VALUE_MOVING_OPS or info.op in _ROUTER_SCORE_OPS
            ):
                seen.add(user)
                pending.append(user)
    return False


# The op a parameter that no call decides about is asked under (the policy's global rule applies,
# and module-name overrides of its owner).
_UNCALLED_OP = "parameter"


def _castable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64


def module_tensors(module: nn.Module, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(qualified name, tensor) of every parameter and buffer of `module`, which sits at `path`.

    >>> [name for name, _ in module_tensors(nn.BatchNorm1d(2), "bn")][:3]
    ['bn.weight', 'bn.bias', 'bn.running_mean']
    """
    prefix = f"{path}." if path else ""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        yield prefix + name, tensor


def _effective_users(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    # Look through amp_fx's casts: a weight cast for a LOWER op is read by that op.
    for user in node.users:
        if node_info(user).is_cast:
            yield from _effective_users(user)
        else:
            yield user


def plan_parameters(gm: torch.fx.GraphModule, context: Conversion) -> Conversion:
    """``context`` with its parameter plan (`planned_parameter_dtypes` of ``gm``): made once, by the
    pipeline after `classify`, and read by the passes after it.

    >>> from amp_fx.core.policy import preset
    >>> from amp_fx.capture.fx import trace
    >>> context = plan_parameters(trace(nn.Linear(2, 2)), Conversion(preset("O2", torch.bfloat16, "cpu")))
    >>> context.parameter_plan
    {'weight': torch.bfloat16, 'bias': torch.bfloat16}
    """
    return dataclasses.replace(context, planned=planned_parameter_dtypes(gm, context))


def planned_parameter_dtypes(gm: torch.fx.GraphModule, context: Conversion) -> dict[str, torch.dtype]:
    """Qualified name -> storage dtype for every parameter/buffer `cast_parameters` will cast.

    Empty unless ``policy.stores_weights_low`` (O2/O3). A tensor reachable under several names
    (tied weights) gets one dtype under all of them: float32 if any caller wants float32. At a
    level that keeps norms FP32 (O2) a tensor the graph reads directly is float32 unless a
    lowered op reads it (`_read_by_lowered_op`; the report notes why, `UNLOWERED_PARAMETER_REASON`).
    A graph of the torch.export front end plans only the parameters its model has not stored yet
    (``context.unstored_parameters``) that it reads; the others keep their stored dtype.

    >>> from amp_fx.core.policy import preset
    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> from amp_fx.capture.fx import trace
    >>> gm = normalize_ops(trace(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)))).graph_module
    >>> planned_parameter_dtypes(gm, Conversion(preset("O2", torch.bfloat16, "cpu")))
    {'0.weight': torch.bfloat16, '0.bias': torch.bfloat16, '1.weight': torch.float32, '1.bias': torch.float32}
    """
    policy = context.policy
    if not policy.stores_weights_low or context.parameters_stored:
        return {}
    unstored = context.unstored_parameters  # None: every parameter is planned (fx)
    unlowered_reads: list[torch.fx.Node] = []
    by_tensor: dict[int, torch.dtype] = {}
    names: dict[int, list[str]] = {}
    stored_low: set[int] = set()  # export front end: stored low at convert, kept so unless...
    router_read: set[int] = set()  # ... a router's FP32 product reads it

    def want(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> None:
        if dtype is None or not _castable(tensor):
            return
        key = id(tensor)
        names.setdefault(key, [])
        if name not in names[key]:
            names[key].append(name)
        current = by_tensor.get(key)
        by_tensor[key] = dtype if current is None or dtype == torch.float32 else current

    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            path = node.target
            if isinstance(module, AutocastIsland):
                if not isinstance(module.wrapped, nn.Module):
                    continue
                module, path = module.wrapped, module.name
            elif isinstance(module, FusedBatchNormAct):
                module, path = module.batch_norm, module.batch_norm_name
            decision = decide_node(node, gm, policy)
            for name, tensor in module_tensors(module, path):
                want(name, tensor, decision.param_dtype if decision is not None else None)
            if decision is not None and decision.rule is Rule.OPAQUE:
                for name, tensor, dtype in _opaque_parameter_dtypes(module, path, policy):
                    want(name, tensor, dtype)
        elif node.op == "get_attr":
            tensor = _tensor_at(gm, node.target)
            if tensor is None:
                continue
            if unstored is not None and tensor.dtype in LOW_PRECISION_DTYPES:
                stored_low.add(id(tensor))
            for user in _effective_users(node):
                decision = decide_node(user, gm, policy)
                if decision is not None:
                    want(node.target, tensor, decision.param_dtype)
                if node_info(user).op in _ROUTER_MATMUL_OPS and computes_router_logits(user):
                    router_read.add(id(tensor))
            unlowered = policy.level.keeps_norms_fp32 and not _read_by_lowered_op(node, gm, policy)
            if unlowered and _castable(tensor):
                want(node.target, tensor, torch.float32)
                unlowered_reads.append(node)
    # Parameters no call reads (unused, or reached only through untraced code): the owner's default.
    for path, module in gm.named_modules() if unstored is None else ():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for attribute, tensor in own:
            name = f"{path}.{attribute}" if path else attribute
            if id(tensor) not in by_tensor:
                want(name, tensor, policy.decide(_UNCALLED_OP, module_name=path or None).param_dtype)
            elif id(tensor) in names and name not in names[id(tensor)]:
                names[id(tensor)].append(name)
    # A tensor stored low at convert (by its module's op) stays low unless a router reads it: the
    # static rules of a graph can miss a product its module's op names (Falcon's `x @ weight.T`).
    kept = stored_low - router_read
    plan = {
        name: by_tensor[key]
        for key, aliases in names.items()
        for name in aliases
        if unstored is None or (name in unstored and key not in kept)
    }
    _note_unlowered(gm, unlowered_reads, plan)
    return plan


def _note_unlowered(
    gm: torch.fx.GraphModule, reads: list[torch.fx.Node], plan: dict[str, torch.dtype]
) -> None:
    """The report's reason for each read of a parameter no lowered op reads, stored float32."""
    for node in reads:
        if plan.get(node.target, _tensor_at(gm, node.target).dtype) == torch.float32:
            node_info(node).reason = UNLOWERED_PARAMETER_REASON


# Why a parameter that no lowered op reads stays float32 at O2 (shown by `amp_fx.report`).
UNLOWERED_PARAMETER_REASON = (
    "kept float32: no op that this level lowers reads it (only FP32 math does, e.g. a logit scale "
    "or a position-bias table), so it stays float32 as under autocast and as Apex keeps BatchNorm"
)


def _read_by_lowered_op(node: torch.fx.Node, gm: torch.fx.GraphModule, policy: Policy) -> bool:
    """Whether an op the policy LOWERs reads ``node``'s value, directly or through ops that only
    move or cast it (`VALUE_MOVING_OPS`: views, concatenation, copies, casts). This is the
    parameter autocast would compute with in low precision (a weight, a bias concatenated into
    one); a parameter whose every path first meets FP32 or passthrough math (``exp``, ``mul``,
    ``add``: a logit scale, a position-bias table, a class token added to activations) is not.
    An opaque reader counts as lowering (what it does with the value is unknown), and a norm
    decides its affine parameters itself, as a norm module does (O2 keeps them FP32 by its rule; a
    policy that makes the norm passthrough keeps them in the activations' dtype).

    >>> from amp_fx.core.policy import preset
    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> from amp_fx.capture.fx import trace
    >>> class Scaled(nn.Linear):
    ...     def __init__(self):
    ...         super().__init__(2, 2)
    ...         self.scale = nn.Parameter(torch.ones(1))
    ...     def forward(self, x):
    ...         return nn.functional.linear(x, self.weight.t().t(), self.bias) * self.scale.exp()
    >>> gm, policy = normalize_ops(trace(Scaled())).graph_module, preset("O2", torch.bfloat16, "cpu")
    >>> {n.target: _read_by_lowered_op(n, gm, policy) for n in gm.graph.nodes if n.op == "get_attr"}
    {'weight': True, 'bias': True, 'scale': False}
    """
    pending, seen = [node], {node}
    while pending:
        for user in pending.pop().users:
            if user in seen:
                continue
            seen.add(user)
            info = node_info(user)
            if info.is_cast or info.op in VALUE_MOVING_OPS:
                pending.append(user)
                continue
            decision = decide_node(user, gm, policy)
            if info.op in NORM_OPS or (decision is not None and decision.rule in (Rule.LOWER, Rule.OPAQUE)):
                return True
    return False


def decide_module(module: nn.Module, name: str | None, policy: Policy) -> Decision:
    """The policy's decision for `module`, named `name`, as the op it computes (`module_op`): for
    the modules inside an opaque one, and for storing parameters before any graph exists.

    >>> from amp_fx.core.policy import preset
    >>> decide_module(nn.LayerNorm(4), "ln", preset("O2", torch.float16, "cpu")).param_dtype
    torch.float32
    """
    return policy.decide(module_op(module), module_name=name, module_type=type(module))


def _opaque_parameter_dtypes(
    module: nn.Module, path: str, policy: Policy
) -> Iterator[tuple[str, torch.Tensor, torch.dtype | None]]:
    """Inside an opaque module each module's own tensors (its own too) get the storage dtype the
    policy decides for that module's op: autocast runs a LayerNorm in the island on FP32 weights at O2,
    as outside. Float32 wins over the island's own (low) decision in `planned_parameter_dtypes`."""
    for sub_path, sub in module.named_modules(prefix=path):
        decision = decide_module(sub, sub_path, policy)
        for attribute, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            yield f"{sub_path}.{attribute}", tensor, decision.param_dtype


def _tensor_at(gm: torch.fx.GraphModule, target: str) -> torch.Tensor | None:
    owner_path, _, attribute = target.rpartition(".")
    owner = gm.get_submodule(owner_path)
    tensor = owner._parameters.get(attribute, owner._buffers.get(attribute))
    return tensor if isinstance(tensor, torch.Tensor) else None
