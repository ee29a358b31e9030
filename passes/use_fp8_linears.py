"""A convert pass (O2, ``policy.fp8``): linear layers' three products in FP8.

With ``preset("O2", dtype=torch.bfloat16, fp8="rowwise")`` (or ``"tensorwise"``,
``"rowwise_hp_wgrad"``: `amp_fx.kernels.fp8.recipes`), each linear layer the policy puts in FP8
runs through `amp_fx.ops.fp8_linear.fp8_linear_or_linear`: its output, input-gradient and
weight-gradient products in FP8 as the recipe says. The weight stays what O2 stores (low, with
an FP32 master in the optimizer); the call quantises it on the fly. It runs after the casts are
decided, so it sees each linear's rule and input dtypes, and before the fusions that replace a
head with its loss: a head put in FP8 is then no longer theirs.

A linear layer (nn.Linear without hooks, ``F.linear``, ``aten.linear``) runs in FP8 unless, in
this order (the reason shown by `amp_fx.report`, per layer):

- the policy does not run it in the low dtype (a FP32 rule: an override, a router), or its
  operands are not all in the low dtype;
- its module's qualified name matches a pattern of ``policy.fp8_skip_modules`` (``re.fullmatch``);
- it is one of the model's output layers and ``policy.fp8_head`` is False: a linear layer whose
  output no other matrix product reads, directly or through other ops (the LM head making the
  logits, a classifier's last layer). torchao keeps these in bf16 by default; the rule reads the
  graph only, never a module's name, so it holds for any model;
- CUDA's FP8 product refuses its sizes (`amp_fx.ops.fp8_linear.fp8_linear_refusals`: in and out
  features multiples of 16).

The token count (the sum of the weight-gradient product) is not known when converting (torch.fx
graphs record no shapes; batches vary): each call checks it, and a call whose tokens are not a
multiple of 16 runs all three products in the high dtype (`fp8_linear_or_linear`), so a ragged
batch never stops a training step.

Example (O2, bf16, ``fp8="rowwise"``)::

    before                                    after
    h = self.up(x)                            h = fp8_linear_or_linear(x, up_weight, up_bias,
                                                  recipe='rowwise')
    logits = self.head(h)                     logits = self.head(h)       (an output layer)
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
import torch.fx

from amp_fx.core.node_info import FX_WRAPPED_KEY, META_KEY, node_info
from amp_fx.core.op_lists import AUTOCAST_OP_LISTS, UNLISTED_MATMUL_OPS
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.fp8_linear import fp8_linear_or_linear, fp8_linear_refusals
from amp_fx.passes.shared.call_nodes import calling_module
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.linear_loss_chains import linear_call_arguments
from amp_fx.passes.shared.op_patterns import tensor_value

logger = logging.getLogger(__name__)

__all__ = ["FP8_OP", "use_fp8_linears"]

# The op name a linear layer in FP8 has in the report.
FP8_OP = "fp8_linear"
# Ops that multiply matrices: a linear layer one of them reads from is not an output layer.
_MATRIX_PRODUCT_OPS = AUTOCAST_OP_LISTS["cuda"].lower_precision_fp | UNLISTED_MATMUL_OPS | {FP8_OP}
# A token count that CUDA's rules accept: sizes are checked at conversion, tokens per call.
_ANY_TOKENS = 16


def _read_by_a_product(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose value a matrix product reads, directly or through other ops."""
    read: set[torch.fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if any(node_info(user).op in _MATRIX_PRODUCT_OPS or user in read for user in node.users):
            read.add(node)
    return read


def _tensor(gm: torch.fx.GraphModule, operand: Any) -> torch.Tensor | None:
    """The tensor a linear operand is: a parameter's qualified name, a get_attr node, or a node
    whose captured value is recorded."""
    if isinstance(operand, torch.fx.Node):
        if operand.op != "get_attr":
            return tensor_value(operand)
        operand = operand.target
    if not isinstance(operand, str):
        return None
    value: Any = gm
    for name in operand.split("."):
        value = getattr(value, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _refusal(
    node: torch.fx.Node, gm: torch.fx.GraphModule, policy: Policy, arguments: Any, output_layer: bool
) -> str | None:
    """Why ``node`` stays out of FP8, or None."""
    info = node_info(node)
    if arguments is None:
        return "a module with hooks or a subclass's forward: the call is left as it is"
    low = policy.dtype
    if info.rule is not Rule.LOWER or any(dtype != low for dtype in info.in_dtypes if dtype is not None):
        return f"runs in {info.out_dtype} by the policy ({info.reason})"
    module_name, _ = calling_module(node, gm)
    for pattern in policy.fp8_skip_modules:
        if module_name is not None and re.fullmatch(pattern, module_name):
            return f"module {module_name!r} matches fp8_skip_modules pattern {pattern!r}"
    if output_layer and not policy.fp8_head:
        return (
            "an output layer of the model (no matrix product reads its output), kept in the low dtype "
            "as torchao does; fp8_head=True puts it in FP8"
        )
    _, weight, bias, _ = arguments
    weight_tensor = _tensor(gm, weight)
    if weight_tensor is None or weight_tensor.dim() != 2:
        return "its weight's shape is not known when converting (a weight computed in the graph)"
    bias_tensor = None if bias is None else _tensor(gm, bias)
    refusals = fp8_linear_refusals(
        _ANY_TOKENS,
        weight_tensor.shape[1],
        weight_tensor.shape[0],
        low,
        None if bias is None else (low if bias_tensor is None else bias_tensor.dtype),
        policy.fp8,
    )
    refused = [refusal for refusal in refusals.values() if refusal is not None]
    return refused[0] if refused else None


def _operand_node(graph: torch.fx.Graph, operand: Any) -> Any:
    return graph.get_attr(operand) if isinstance(operand, str) else operand


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, arguments: Any, recipe: str) -> torch.fx.Node:
    input, weight, bias, _ = arguments
    graph = gm.graph
    with graph.inserting_before(node):
        weight, bias = _operand_node(graph, weight), _operand_node(graph, bias)
        for parameter in (weight, bias):
            if isinstance(parameter, torch.fx.Node) and META_KEY not in parameter.meta:
                node_info(parameter).out_dtype = node_info(node).out_dtype
        arguments = (input, weight, bias)
        name = f"{node.name}_fp8"
        fp8 = graph.create_node("call_function", fp8_linear_or_linear, arguments, {"recipe": recipe}, name)
    fp8.meta.update(node.meta)
    # Recorded as one call if the graph is traced again.
    fp8.meta[FX_WRAPPED_KEY] = True
    if node.op == "call_module":
        # The module's region (FSDP2 gathers its weight around the call, `shard_regions`).
        module = gm.get_submodule(node.target)
        fp8.meta["nn_module_stack"] = {
            **node.meta.get("nn_module_stack", {}),
            node.target: (node.target, type(module)),
        }
    node.replace_all_uses_with(fp8)
    graph.erase_node(node)
    return fp8


def use_fp8_linears(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Run the linear layers ``policy.fp8`` puts in FP8 through `fp8_linear_or_linear`, in graphs
    of either front end, and record for each linear layer whether it runs in FP8, and why not;
    in place on `gm` (``modified``: whether a layer went to FP8). Runs after the casts are decided
    and before the head and loss fusions.

    Example::

        >>> from torch import nn
        >>> from amp_fx import convert, report
        >>> from amp_fx.core.policy import preset
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        >>> gm = convert(model, policy=preset("O2", torch.bfloat16, "cpu", fp8="rowwise"))
        >>> [(row.name, row.fp8[:20]) for row in report(gm).fp8_products]
        [('_0_fp8', 'FP8, recipe rowwise'), ('_2', 'not FP8: an output l')]
    """
    policy = context.policy
    if policy.fp8 is None:
        return PassResult(gm, False)
    read = _read_by_a_product(gm)
    converted = 0
    for node in list(gm.graph.nodes):
        info = node_info(node)
        if info.op != "linear" or info.is_cast:
            continue
        arguments = linear_call_arguments(gm, node)
        refusal = _refusal(node, gm, policy, arguments, output_layer=node not in read)
        if refusal is not None:
            info.fp8 = f"not FP8: {refusal}"
            continue
        info.op, info.fp8 = FP8_OP, f"FP8, recipe {policy.fp8}"
        _replace(gm, node, arguments, policy.fp8)
        converted += 1
    logger.debug("use_fp8_linears: %d linear layers in FP8 (recipe %s)", converted, policy.fp8)
    return PassResult(gm, converted > 0)
