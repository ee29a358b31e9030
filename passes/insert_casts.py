"""A convert pass: insert the casts `propagate_dtypes` decided, as named nodes.

For every input of every node, ``node_info(node).in_dtypes`` says the dtype the node must see;
where the producer's ``out_dtype`` differs, a cast node is inserted before the node: one cast per
parameter (or model input, or exact widening) and dtype, shared by every later user, as autocast
caches its weight casts; one per user for activations narrowed to the low dtype (`may_share_cast`). Two node
rewrites make casts possible where a module call would hide them:

- a LOWER/FP32/PROMOTE leaf module whose parameters are stored in another dtype than its rule
  wants (at O1 the weights stay float32) becomes its functional form with the parameters as
  ``get_attr`` nodes, so their casts are explicit: ``fc1(x)`` -> ``F.linear(x, fc1.weight, fc1.bias)``
  (Linear, Bilinear, Conv1d/2d/3d with every padding mode, ConvTranspose1d/2d/3d, PReLU; any
  other such module runs in an `AutocastIsland`).
- an OPAQUE node under O1/O2 becomes a call of an `AutocastIsland` that runs the module or
  function inside ``torch.autocast(device_type, dtype)``.

An in-place update of a cast (``x.add_(1)`` on the O2 entry cast of ``x``, directly or through a
view) is copied back into the value cast after it (`write_back_updates`), as eager updates ``x``.

Example (O1, CPU, bf16)::

    before                                    after
    x = placeholder                           x = placeholder
    fc1 = self.fc1(x)                         x_to_bfloat16 = x.to(torch.bfloat16)
                                              fc1_weight = self.fc1.weight
                                              fc1_weight_to_bfloat16 = fc1_weight.to(torch.bfloat16)
                                              fc1_bias = self.fc1.bias
                                              fc1_bias_to_bfloat16 = fc1_bias.to(torch.bfloat16)
                                              fc1 = torch.nn.functional.linear(
                                                  x_to_bfloat16, fc1_weight_to_bfloat16, fc1_bias_to_bfloat16)
    attn = self.attn(fc1, fc1, fc1)           attn = self.attn_autocast(fc1, fc1, fc1)

A cast of a value whose dtype is known is ``x.to(dtype)``, never a no-op. A cast of a value whose
dtype is not known statically (a model input without ``example_inputs``, the output of untraced
code) is `cast_if_floating`, which like autocast leaves integer, bool and float64 tensors alone
(and is a no-op where the value already has the dtype).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.core.node_info import META_KEY, NodeInfo, node_info
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.passes.shared.call_nodes import call_argument
from amp_fx.passes.shared.casts import CastCache, insert_input_casts, is_output_structure
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.in_place_updates import write_back_updates

logger = logging.getLogger(__name__)

__all__ = ["insert_casts"]


# ---------------------------------------------------------------------------------------------
# Functional forms of leaf modules with parameters
# ---------------------------------------------------------------------------------------------
_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_CONV_TRANSPOSE = {
    nn.ConvTranspose1d: F.conv_transpose1d,
    nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d,
}


class _Param(str):
    """A parameter of the module in a functional form's argument template (not a str argument
    such as ``padding="same"``)."""


@dataclass(frozen=True)
class _Pad:
    """The explicit ``F.pad`` a convolution with a non-zero padding_mode applies to its input."""

    padding: tuple[int, ...]
    mode: str
    input: Any


_WEIGHT, _BIAS = _Param("weight"), _Param("bias")


def _functional_form(module: nn.Module, node: torch.fx.Node) -> tuple[Callable[..., Any], list[Any]] | None:
    """(function, argument template) equivalent to ``module(...)`` as its forward computes it,
    parameters as `_Param`; None where no exact functional form is known (a subclass with its own
    forward, extra arguments such as ConvTranspose's output_size)."""
    cls = type(module)
    arguments = len(node.args) + len(node.kwargs)
    if isinstance(module, nn.Linear) and cls.forward is nn.Linear.forward and arguments == 1:
        return F.linear, [call_argument(node, 0, "input"), _WEIGHT, _BIAS]
    if isinstance(module, nn.Bilinear) and cls.forward is nn.Bilinear.forward and arguments == 2:
        return F.bilinear, [
            call_argument(node, 0, "input1"),
            call_argument(node, 1, "input2"),
            _WEIGHT,
            _BIAS,
        ]
    if isinstance(module, nn.PReLU) and cls.forward is nn.PReLU.forward and arguments == 1:
        return F.prelu, [call_argument(node, 0, "input"), _WEIGHT]
    for base, function in _CONV.items():
        if isinstance(module, base) and cls.forward is base.forward and arguments == 1:
            x = call_argument(node, 0, "input")
            if module.padding_mode == "zeros":
                return function, [
                    x,
                    _WEIGHT,
                    _BIAS,
                    module.stride,
                    module.padding,
                    module.dilation,
                    module.groups,
                ]
            # As _ConvNd._conv_forward: explicit pad, then a convolution without padding.
            pad = _Pad(module._reversed_padding_repeated_twice, module.padding_mode, x)
            zero = (0,) * len(module.kernel_size)
            return function, [pad, _WEIGHT, _BIAS, module.stride, zero, module.dilation, module.groups]
    for base, function in _CONV_TRANSPOSE.items():
        if isinstance(module, base) and cls.forward is base.forward and arguments == 1:
            # ConvTranspose raises for padding modes other than zeros; without output_size its
            # output_padding is the module's.
            x = call_argument(node, 0, "input")
            template = [x, _WEIGHT, _BIAS, module.stride, module.padding, module.output_padding]
            return function, [*template, module.groups, module.dilation]
    return None


def _get_attr(
    gm: torch.fx.GraphModule, target: str, dtype: torch.dtype, attributes: dict[str, torch.fx.Node]
) -> torch.fx.Node:
    # One get_attr per parameter, shared by every functional form that reads it (a module called
    # twice), so that its cast is shared too. The first is created before the first reader.
    if target not in attributes:
        node = gm.graph.get_attr(target)
        node.meta[META_KEY] = NodeInfo(out_dtype=dtype)
        attributes[target] = node
    return attributes[target]


def _pad_op(mode: str, spatial_dims: int) -> str:
    # The aten op F.pad dispatches to: CPU autocast runs reflection/replication pads in float32.
    if mode == "reflect":
        return f"reflection_pad{spatial_dims}d"
    if mode == "replicate":
        return f"replication_pad{spatial_dims}d"
    return "pad"


def _explicit_pad(
    gm: torch.fx.GraphModule, pad: _Pad, node: torch.fx.Node, module: nn.Module, policy: Policy
) -> torch.fx.Node:
    """The F.pad node of a padded convolution's functional form, with its own rule and casts."""
    op = _pad_op(pad.mode, len(pad.padding) // 2)
    decision = policy.decide(op, module_name=node.target, module_type=type(module))
    have = node_info(pad.input).out_dtype
    want = {Rule.FP32: torch.float32, Rule.LOWER: policy.dtype}.get(decision.rule)
    eligible = have is None or (have.is_floating_point and have != torch.float64)
    seen = want if want is not None and eligible else have
    pad_node = gm.graph.call_function(F.pad, (pad.input, pad.padding), {"mode": pad.mode})
    pad_node.meta[META_KEY] = NodeInfo(
        op=op,
        rule=decision.rule,
        reason=f"{decision.reason} (padding_mode={pad.mode!r} of {node.target})",
        in_dtypes=(seen,),
        out_dtype=seen,
    )
    return pad_node


def _functionalize(
    gm: torch.fx.GraphModule,
    node: torch.fx.Node,
    module: nn.Module,
    target: torch.dtype,
    plan: dict[str, torch.dtype],
    attributes: dict[str, torch.fx.Node],
    policy: Policy,
) -> bool:
    """Rewrite ``call_module`` `node` in place into its functional form; False if none is known."""
    form = _functional_form(module, node)
    if form is None:
        return False
    function, template = form
    info = node_info(node)
    activation_dtypes = dict(zip(node.all_input_nodes, info.in_dtypes, strict=False))
    args: list[Any] = []
    with gm.graph.inserting_before(node):
        for item in template:
            if isinstance(item, _Param):
                tensor = getattr(module, item)
                if tensor is None:
                    args.append(None)
                    continue
                qualified = f"{node.target}.{item}"
                args.append(_get_attr(gm, qualified, plan.get(qualified, tensor.dtype), attributes))
            elif isinstance(item, _Pad):
                pad = _explicit_pad(gm, item, node, module, policy)
                activation_dtypes[pad] = activation_dtypes.get(item.input)
                args.append(pad)
            else:
                args.append(item)
    spelling = f"{type(module).__name__} {node.target}"
    node.op, node.target, node.args, node.kwargs = "call_function", function, tuple(args), {}
    # The node now also reads the parameters: they are seen in the rule's dtype, like every input.
    info.in_dtypes = tuple(activation_dtypes.get(a, target) for a in node.all_input_nodes)
    info.notes.append(f"functional form of {spelling}: its parameters are cast in the graph")
    return True


# ---------------------------------------------------------------------------------------------
# Autocast islands
# ---------------------------------------------------------------------------------------------
def _unique_attribute(gm: torch.fx.GraphModule, base: str) -> str:
    name, index = base, 1
    while hasattr(gm, name):
        index += 1
        name = f"{base}_{index}"
    return name


def _make_island(
    gm: torch.fx.GraphModule, node: torch.fx.Node, policy: Policy, wrapped: Any, name: str
) -> None:
    """Turn `node` in place into a call of an `AutocastIsland` running `wrapped`."""
    island = AutocastIsland(wrapped, policy.device_type, policy.dtype, name=name)
    path = _unique_attribute(gm, f"{name.replace('.', '_')}_autocast")
    gm.add_submodule(path, island)
    # A call_method x.m(*rest) keeps its arguments: the island calls Tensor.m(x, *rest).
    node.op, node.target = "call_module", path
    info = node_info(node)
    info.rule = Rule.OPAQUE
    info.notes.append(f"runs in {path}: {island.extra_repr()}")


def _island_for(gm: torch.fx.GraphModule, node: torch.fx.Node, policy: Policy) -> None:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, AutocastIsland):
            return
        _make_island(gm, node, policy, module, node.target)
    elif node.op == "call_function":
        _make_island(gm, node, policy, node.target, getattr(node.target, "__name__", node.name))
    elif node.op == "call_method":
        _make_island(gm, node, policy, getattr(torch.Tensor, node.target), f"Tensor.{node.target}")


# ---------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------
def _rule_target(info: NodeInfo, policy: Policy) -> torch.dtype | None:
    # The dtype the rule casts a module's parameters to: fixed for LOWER/FP32; for PROMOTE, the
    # dtype propagate_dtypes chose for the floating inputs (the parameters took part).
    if info.rule is Rule.LOWER:
        return policy.dtype
    if info.rule is Rule.FP32:
        return torch.float32
    if info.rule is Rule.PROMOTE:
        return next((d for d in info.in_dtypes if d is not None and d.is_floating_point), None)
    return None


def _needs_parameter_casts(
    module: nn.Module, path: str, target: torch.dtype, plan: dict[str, torch.dtype]
) -> bool:
    for name, tensor in module.named_parameters(prefix=path):
        dtype = plan.get(name, tensor.dtype)
        if dtype.is_floating_point and dtype != torch.float64 and dtype != target:
            return True
    return False


def insert_casts(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Insert the casts `propagate_dtypes` decided (run it first); see the module docstring.

    Example::

        >>> from amp_fx.core.policy import preset
        >>> from amp_fx.passes.classify import classify
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> from amp_fx.passes.propagate_dtypes import propagate_dtypes
        >>> from amp_fx.passes.shared.decisions import plan_parameters
        >>> from amp_fx.capture.fx import trace
        >>> context = Conversion(preset("O1", torch.bfloat16, "cpu"))
        >>> gm = classify(normalize_ops(trace(nn.Linear(4, 2))).graph_module, context).graph_module
        >>> context = plan_parameters(gm, context)
        >>> gm = propagate_dtypes(gm, context).graph_module
        >>> [n.name for n in insert_casts(gm, context).graph_module.graph.nodes if node_info(n).is_cast]
        ['input_1_to_bfloat16', 'weight_to_bfloat16', 'bias_to_bfloat16']
    """
    policy = context.policy
    plan = context.parameter_plan
    cache: CastCache = {}
    attributes: dict[str, torch.fx.Node] = {}
    created = functional = islands = 0
    nodes = list(gm.graph.nodes)
    seen_nodes = set(nodes)
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        info = node_info(node)
        if info.is_cast or is_output_structure(node):
            continue  # output structures get their casts from cast_outputs
        if info.rule is Rule.OPAQUE and policy.autocast_opaque:
            was_island = node.op == "call_module" and isinstance(
                gm.get_submodule(node.target), AutocastIsland
            )
            if not was_island:
                _island_for(gm, node, policy)
                islands += 1
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            target = _rule_target(info, policy)
            if target is not None and _needs_parameter_casts(module, node.target, target, plan):
                if _functionalize(gm, node, module, target, plan, attributes, policy):
                    functional += 1
                    for pad in node.all_input_nodes:
                        if pad.target is F.pad and pad not in seen_nodes:
                            created += insert_input_casts(gm, pad, cache)
                else:
                    # No exact functional form: autocast itself applies the rule to the weights.
                    _make_island(gm, node, policy, module, node.target)
                    islands += 1
        created += insert_input_casts(gm, node, cache)
    write_backs = write_back_updates(gm)
    logger.debug(
        "insert_casts %s: %d casts, %d functional forms, %d autocast islands, %d write-backs",
        policy.opt_level,
        created,
        functional,
        islands,
        write_backs,
    )
    return PassResult(gm, any((created, functional, islands, write_backs)))
