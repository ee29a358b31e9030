"""Helpers that more than one pass needs, in one place so that no pass imports another.

Passes import `amp_fx.core`, `amp_fx.ops` and this module, nothing else of amp_fx; a helper used by
one pass only stays in that pass. What is here:

- a call's argument by position or keyword (`call_argument`), for `normalize_ops`,
  `insert_casts` and `simplify_attention`;
- dtype facts: `dtype_name`, the notes on assumed dtypes (`ASSUMED_DTYPE_NOTE`,
  `DERIVED_ASSUMED_DTYPE_NOTE`, `dtype_is_assumed`) and `is_exact_widening`;
- the policy's decision for one node (`decide_node`, with `is_inplace_call` and
  `calling_module`), read by `classify` for rules and by `planned_parameter_dtypes` for storage;
- the storage dtype of every parameter (`planned_parameter_dtypes`, `module_tensors`), planned
  by `cast_parameters` and read by `propagate_dtypes` and `insert_casts` before it runs;
- cast nodes (`make_cast`, `may_share_cast`, `insert_input_casts`, `CastCache`, `forget_casts`)
  and the nodes that build the return value (`is_output_structure`), for `insert_casts`,
  `simplify_casts` and `cast_outputs`;
- which inputs a node updates in place (`mutated_inputs`, through views: `alias_base`,
  `updates_in_place`) and the write-back of an update that lands on a cast
  (`write_back_updates`, `is_write_back`), for `insert_casts` and `simplify_casts`;
- which cross-entropy calls the fused loss computes (`is_fusable_loss`), for `fuse_losses` and
  `fuse_linear_loss`.

Example::

    >>> is_exact_widening(torch.float16, torch.float32), dtype_name(torch.bfloat16)
    (True, 'bfloat16')
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.operator_schemas import normalize_function

from amp_fx.core.dtypes import dtype_name
from amp_fx.core.module_ops import module_op
from amp_fx.core.node_info import FX_WRAPPED_KEY, META_KEY, PARAMETERS_STORED_KEY, NodeInfo, node_info
from amp_fx.core.op_facts import INPLACE_OPERATORS, RUNNING_STATS_FLAGS, VIEW_OPS
from amp_fx.core.op_lists import OPAQUE_OP
from amp_fx.core.policy import Decision, Policy, Rule
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.ops.batch_norm import FusedBatchNormAct
from amp_fx.ops.casts import cast_if_floating

logger = logging.getLogger(__name__)

__all__ = [
    "call_argument",
    "forget_casts",
    "dtype_name",
    "ASSUMED_DTYPE_NOTE",
    "UNKNOWN_INPUT_DTYPE_NOTE",
    "DERIVED_ASSUMED_DTYPE_NOTE",
    "dtype_is_assumed",
    "is_exact_widening",
    "is_inplace_call",
    "mutated_inputs",
    "is_write_back",
    "alias_base",
    "updates_in_place",
    "write_back_updates",
    "calling_module",
    "decide_node",
    "module_tensors",
    "planned_parameter_dtypes",
    "CastCache",
    "make_cast",
    "may_share_cast",
    "is_output_structure",
    "insert_input_casts",
    "CROSS_ENTROPY_PARAMETERS",
    "CROSS_ENTROPY_DEFAULTS",
    "is_fusable_loss",
    "copy_model",
]


# ---------------------------------------------------------------------------------------------
# dtype facts
# ---------------------------------------------------------------------------------------------
# The note `propagate_dtypes` leaves on a model input whose dtype it assumed (no example_inputs).
ASSUMED_DTYPE_NOTE = "dtype assumed float32 (no example_inputs)"
# ... on an optional model input (a default such as ``targets=None``): its users see it cast at
# entry like any input, but it may as well be integer.
UNKNOWN_INPUT_DTYPE_NOTE = "dtype unknown: optional input, may be integer (no example_inputs)"
# ... and on a value whose dtype follows such an input's through dtype-agnostic ops (a view of
# integer targets is integer too).
DERIVED_ASSUMED_DTYPE_NOTE = "dtype follows a model input whose dtype is assumed"


def dtype_is_assumed(node: torch.fx.Node) -> bool:
    """True for a value whose recorded dtype is an assumption, not a fact (a model input without
    ``example_inputs``, or a view of one): it may be an integer tensor, so its casts must be
    guarded and are never no-ops to remove."""
    notes = node_info(node).notes
    return any(
        note in notes for note in (ASSUMED_DTYPE_NOTE, UNKNOWN_INPUT_DTYPE_NOTE, DERIVED_ASSUMED_DTYPE_NOTE)
    )


_EXACT_WIDENINGS = {
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def is_exact_widening(source: torch.dtype, wide: torch.dtype) -> bool:
    """True when every `source` value is exactly representable in `wide` (the round trip is exact).

    >>> is_exact_widening(torch.float16, torch.float32), is_exact_widening(torch.float32, torch.float16)
    (True, False)
    """
    return wide in _EXACT_WIDENINGS.get(source, ())


# ---------------------------------------------------------------------------------------------
# The policy's decision for one node
# ---------------------------------------------------------------------------------------------
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
        # torch.relu_(x), torch.exp_(x), F.relu_(x), aten.add_.Tensor (torch.export's graphs):
        # torch's in-place functions end in "_" too.
        target = node.target
        name = (
            target._opname if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", "")
        )
        return (
            node.target in INPLACE_OPERATORS
            or node.kwargs.get("inplace") is True
            or (name.endswith("_") and not name.endswith("__") and _is_torch_function(node.target))
        )
    return False


def _is_torch_function(target: Any) -> bool:
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] == "torch" or getattr(torch, getattr(target, "__name__", ""), None) is target


def call_argument(node: torch.fx.Node, position: int, keyword: str, default: Any = None) -> Any:
    """The argument of the call `node` at ``position`` or named ``keyword``, else ``default``."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(keyword, default)


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The call's arguments by parameter name (defaults included), or {} where unknown."""
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin without a Python signature: torch's schema
        pair = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        return dict(pair.kwargs) if pair is not None else {}
    bound.apply_defaults()
    return dict(bound.arguments)


def mutated_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The input nodes `node` updates in place: the tensor of an in-place call (``x.add_(1)``,
    ``x[i] = y``, ``relu(x, inplace=True)``), an ``out=`` tensor, the running statistics a
    training ``F.batch_norm``/``F.instance_norm`` updates, and an aten op's ``Tensor(a!)``.

    A cast between such an input and `node` would take the update (autocast never casts these);
    `write_back_updates` copies it back.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.add_(1))
    >>> [[a.name for a in mutated_inputs(n)] for n in gm.graph.nodes]
    [[], ['x'], []]
    """
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        # An aten op (torch.export's graphs) says which arguments it writes: Tensor(a!).
        written = [
            node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            for i, argument in enumerate(node.target._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]
        return [value for value in written if isinstance(value, torch.fx.Node)]
    if is_inplace_call(node):
        first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
        return [first] if isinstance(first, torch.fx.Node) else []
    if node.op != "call_function":
        return []
    mutated = [node.kwargs["out"]] if isinstance(node.kwargs.get("out"), torch.fx.Node) else []
    flag = RUNNING_STATS_FLAGS.get(node_info(node).op or "")
    if flag is not None:
        arguments = _arguments(node)
        if arguments.get(flag) is not False:  # True, or only known at run time
            stats = (arguments.get(name) for name in ("running_mean", "running_var"))
            mutated += [s for s in stats if isinstance(s, torch.fx.Node)]
    return mutated


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


# ---------------------------------------------------------------------------------------------
# Parameter storage dtypes
# ---------------------------------------------------------------------------------------------
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


def planned_parameter_dtypes(gm: torch.fx.GraphModule, policy: Policy) -> dict[str, torch.dtype]:
    """Qualified name -> storage dtype for every parameter/buffer `cast_parameters` will cast.

    Empty unless ``policy.cast_parameters`` (O2/O3). A tensor reachable under several names
    (tied weights) gets one dtype under all of them: float32 if any caller wants float32.

    >>> planned_parameter_dtypes(gm, preset("O2", torch.bfloat16, "cpu"))  # doctest: +SKIP
    {'0.weight': torch.bfloat16, '0.bias': torch.bfloat16, '1.weight': torch.float32, ...}
    """
    if not policy.cast_parameters or gm.meta.get(PARAMETERS_STORED_KEY):
        return {}
    by_tensor: dict[int, torch.dtype] = {}
    names: dict[int, list[str]] = {}

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
            for user in _effective_users(node):
                decision = decide_node(user, gm, policy)
                if decision is not None:
                    want(node.target, tensor, decision.param_dtype)
    # Parameters no call reads (unused, or reached only through untraced code): the owner's default.
    for path, module in gm.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for attribute, tensor in own:
            name = f"{path}.{attribute}" if path else attribute
            if id(tensor) not in by_tensor:
                want(name, tensor, policy.decide(_UNCALLED_OP, module_name=path or None).param_dtype)
            elif id(tensor) in names and name not in names[id(tensor)]:
                names[id(tensor)].append(name)
    return {name: by_tensor[key] for key, aliases in names.items() for name in aliases}


def _opaque_parameter_dtypes(
    module: nn.Module, path: str, policy: Policy
) -> Iterator[tuple[str, torch.Tensor, torch.dtype | None]]:
    """Inside an opaque module each module's own tensors (its own too) get the storage dtype the
    policy decides for that module's op: autocast runs a LayerNorm in the island on FP32 weights at O2,
    as outside. Float32 wins over the island's own (low) decision in `planned_parameter_dtypes`."""
    for sub_path, sub in module.named_modules(prefix=path):
        decision = policy.decide(module_op(sub), module_name=sub_path, module_type=type(sub))
        for attribute, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            yield f"{sub_path}.{attribute}", tensor, decision.param_dtype


def _tensor_at(gm: torch.fx.GraphModule, target: str) -> torch.Tensor | None:
    owner_path, _, attribute = target.rpartition(".")
    owner = gm.get_submodule(owner_path)
    tensor = owner._parameters.get(attribute, owner._buffers.get(attribute))
    return tensor if isinstance(tensor, torch.Tensor) else None


# ---------------------------------------------------------------------------------------------
# Cast nodes
# ---------------------------------------------------------------------------------------------
# (value, dtype) -> the cast of value to dtype that every later user may share (`may_share_cast`).
CastCache = dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node]


def make_cast(
    graph: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype, *, guarded: bool, reason: str
) -> torch.fx.Node:
    """Create (at the graph's insertion point) a cast node named ``<value>_to_<dtype>``."""
    name = f"{value.name}_to_{dtype_name(dtype)}"
    if guarded:
        cast = graph.create_node("call_function", cast_if_floating, (value, dtype), name=name)
        # Recorded as a call if the converted graph is ever traced again (fx.wrap semantics);
        # tracing into it would drop the cast (isinstance of a Proxy is False).
        cast.meta[FX_WRAPPED_KEY] = True
    else:
        cast = graph.create_node("call_method", "to", (value, dtype), name=name)
    cast.meta[META_KEY] = NodeInfo(
        op="to",
        rule=Rule.PASSTHROUGH,
        reason=reason,
        in_dtypes=(node_info(value).out_dtype,),
        out_dtype=dtype,
        is_cast=True,
        cast_reason=reason,
    )
    return cast


def _cast_reason(node: torch.fx.Node, dtype: torch.dtype, value: torch.fx.Node) -> str:
    info = node_info(node)
    what = info.op or str(node.target)
    if node.op == "output" or is_output_structure(node):
        return f"model output cast to {dtype_name(dtype)} (cast_model_outputs)"
    if value.op == "placeholder" and info.rule in (Rule.PASSTHROUGH, None):
        return f"model input cast to {dtype_name(dtype)} at entry"
    if info.rule is Rule.PASSTHROUGH:
        return f"{what} runs in its parameters' dtype: input cast to {dtype_name(dtype)}"
    rule = info.rule.value.upper() if info.rule is not None else "input"
    return f"{rule} {what}: input cast to {dtype_name(dtype)}"


_WRITE_BACK_REASON = "write-back: {node} updates a cast of {value} in place; copied into {value}"


def _write_back(
    gm: torch.fx.GraphModule, node: torch.fx.Node, value: torch.fx.Node, cast: torch.fx.Node
) -> None:
    """After `node`, copy its in-place update of `cast` into `value` (the caller's tensor, a
    buffer), as eager would have updated `value` itself: ``value.copy_(cast)``."""
    reason = _WRITE_BACK_REASON.format(node=node.name, value=value.name)
    with gm.graph.inserting_after(node):
        copy = gm.graph.create_node("call_method", "copy_", (value, cast), name=f"{value.name}_write_back")
    copy.meta[META_KEY] = NodeInfo(
        op="copy_",
        rule=Rule.PASSTHROUGH,
        reason=reason,
        in_dtypes=(node_info(value).out_dtype, node_info(cast).out_dtype),
        out_dtype=node_info(value).out_dtype,
        is_cast=True,  # amp_fx's own node: not cast again, skipped by disable_casts
        cast_reason=reason,
    )


def _is_alias_of_first_argument(node: torch.fx.Node) -> bool:
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in VIEW_OPS or (node_info(node).op or "") in VIEW_OPS or is_inplace_call(node)


def alias_base(node: torch.fx.Node) -> torch.fx.Node:
    """The value whose storage `node` shares, through views and in-place results; an amp_fx cast
    is a copy, so it is a base itself.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.view(-1).add_(1))
    >>> [alias_base(n).name for n in gm.graph.nodes][:3]
    ['x', 'x', 'x']
    """
    while _is_alias_of_first_argument(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _aliases(base: torch.fx.Node) -> set[torch.fx.Node]:
    found, todo = {base}, [base]
    while todo:
        for user in todo.pop().users:
            if user not in found and _is_alias_of_first_argument(user) and user.args[0] in found:
                found.add(user)
                todo.append(user)
    return found


def updates_in_place(cast: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that update `cast` in place, directly or through a view of it, in graph order."""
    aliases = _aliases(cast)
    users = {user for alias in aliases for user in alias.users}
    updating = [user for user in users if not is_write_back(user) and set(mutated_inputs(user)) & aliases]
    if len(updating) < 2:
        return updating  # nothing to order: the usual case, and ordering walks the whole graph
    order = {node: index for index, node in enumerate(cast.graph.nodes)}
    return sorted(updating, key=order.__getitem__)


def write_back_updates(gm: torch.fx.GraphModule) -> int:
    """After every in-place update of an amp_fx cast (the entry cast of a model input, the cast of
    a buffer), copy the update into the value cast: ``value.copy_(cast)``, as eager would have
    updated ``value`` itself. Returns the number of write-backs added.

    Example (O2, bf16; ``x.add_(1); return x``)::

        x_to_bfloat16 = amp_fx_ops_casts_cast_if_floating(x, torch.bfloat16)
        add_ = x_to_bfloat16.add_(1)
        x_write_back = x.copy_(x_to_bfloat16)
        return x
    """
    added = 0
    for cast in list(gm.graph.nodes):
        if not node_info(cast).is_cast or is_write_back(cast) or not cast.args:
            continue
        value = cast.args[0]
        if not isinstance(value, torch.fx.Node):
            continue
        for node in updates_in_place(cast):
            following = node.next
            if is_write_back(following) and following.args == (value, cast):
                continue  # converted before
            _write_back(gm, node, value, cast)
            added += 1
    return added


def is_write_back(node: torch.fx.Node) -> bool:
    """True for the ``value.copy_(cast)`` that `insert_input_casts` adds after an in-place update
    of a cast (see `mutated_inputs`)."""
    info = node_info(node)
    return info.is_cast and node.op == "call_method" and node.target == "copy_"


def is_output_structure(node: torch.fx.Node) -> bool:
    """True for a node that only builds the model's return value: a tuple, list, dict or
    namedtuple constructed from the results and read by nothing but the output (or by another
    such node). Its inputs are model outputs, cast by `cast_outputs`.

    >>> import collections
    >>> gm = torch.fx.symbolic_trace(lambda x: collections.namedtuple("Out", "y")(x * 2))
    >>> [is_output_structure(n) for n in gm.graph.nodes]
    [False, False, True, False]
    """
    target = node.target
    if (
        node.op != "call_function"
        or not isinstance(target, type)
        or not issubclass(target, (tuple, list, dict))
    ):
        return False
    return all(user.op == "output" or is_output_structure(user) for user in node.users)


def may_share_cast(source: torch.fx.Node, dtype: torch.dtype) -> bool:
    """True when one cast of `source` to `dtype` may serve every user without changing gradients.

    A shared cast sums its users' gradients in `dtype` before casting them back. That is what
    autocast does for parameters (it caches their casts) and harmless for model inputs and exact
    widenings; for an activation narrowed to fp16 it is not: autocast casts once per consumer and
    sums the gradients in fp32, where an fp16 sum can overflow. So those casts stay one per user.

    Example: ``h`` (float32) feeding two LOWER matmuls gets ``h_to_float16`` and
    ``h_to_float16_1``, one each, as under autocast; ``fc.weight`` read twice gets one cast.
    """
    if source.op in ("get_attr", "placeholder"):
        return True
    source_dtype = node_info(source).out_dtype
    return source_dtype is not None and is_exact_widening(source_dtype, dtype)


def insert_input_casts(gm: torch.fx.GraphModule, node: torch.fx.Node, cache: CastCache) -> int:
    """Make `node` see the dtypes of its ``in_dtypes``: cast each input whose producer's
    ``out_dtype`` differs. Returns the number of new cast nodes."""
    info = node_info(node)
    inputs = node.all_input_nodes
    mutated = mutated_inputs(node)
    if len(info.in_dtypes) != len(inputs):
        logger.debug("%s has no dtypes for its inputs; left as is", node.name)
        _forget_casts(cache, mutated)
        return 0
    created = 0
    for value, want in zip(inputs, info.in_dtypes, strict=True):
        have = node_info(value).out_dtype
        if want is None or want == have:
            continue
        shared = may_share_cast(value, want)
        cast = cache.get((value, want)) if shared else None
        if cast is None:
            with gm.graph.inserting_before(node):
                guarded = have is None or dtype_is_assumed(value)
                cast = make_cast(
                    gm.graph, value, want, guarded=guarded, reason=_cast_reason(node, want, value)
                )
            if shared:
                cache[(value, want)] = cast
            created += 1
        node.replace_input_with(value, cast)
    _forget_casts(cache, mutated)
    return created


def forget_casts(cache: dict[Any, torch.fx.Node], updated: set[torch.fx.Node]) -> None:
    """Drop the cached casts (keyed by value first) of the values ``updated`` in place: users after
    an update must see it, and casts made before it are stale."""
    if updated:
        for key in [key for key in cache if key[0] in updated]:
            del cache[key]


def _forget_casts(cache: CastCache, mutated: list[torch.fx.Node]) -> None:
    # The value a mutated view views is the one whose casts are stale.
    forget_casts(cache, {alias_base(value) for value in mutated})


# ---------------------------------------------------------------------------------------------
# Losses the fused kernel computes
# ---------------------------------------------------------------------------------------------
# F.cross_entropy's parameters after (input, target), with their defaults, and all of them in order.
CROSS_ENTROPY_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
    "label_smoothing": 0.0,
}
CROSS_ENTROPY_PARAMETERS = ("input", "target", *CROSS_ENTROPY_DEFAULTS)


def is_fusable_loss(arguments: dict[str, Any]) -> bool:
    """Whether a cross-entropy call with these arguments (every parameter of F.cross_entropy, by
    name) is one the fused kernel computes; anything else keeps the cast and torch's float32 loss."""
    return (
        set(CROSS_ENTROPY_PARAMETERS) <= set(arguments)
        and isinstance(arguments["input"], torch.fx.Node)
        and "target" in arguments
        and arguments["weight"] is None
        and arguments["size_average"] is None
        and arguments["reduce"] is None
        and arguments["label_smoothing"] == 0.0
        and arguments["reduction"] in ("mean", "sum", "none")
        and isinstance(arguments["ignore_index"], int)
    )


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also for a model that caches computed tensors in plain attributes.

    torch refuses to deep-copy a tensor that is not a graph leaf; eval-mode caches hold such
    tensors (timm's LeViT keeps its attention biases in a dict after a forward). Each is copied
    as a detached clone, which is what a cache of computed values is.

    >>> class Cached(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = nn.Parameter(torch.ones(2))
    ...         self.cache = {"w2": self.w * 2}
    >>> copy_model(Cached()).cache["w2"]
    tensor([2., 2.])
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in module.__dict__.values():
            for leaf in _tensors_in(value):
                if leaf.grad_fn is not None and id(leaf) not in memo:
                    memo[id(leaf)] = leaf.detach().clone()
    return copy.deepcopy(model, memo)


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
