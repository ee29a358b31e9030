"""A convert pass (O2): RMSNorm and LayerNorm chains, with the residual add before them, as one call.

At O2 amp_fx keeps autocast's numerics for a transformer's norms: they run in fp32 on fp32
weights, on a residual stream kept in fp32, and the graph spells each one out as torch ops and
casts (a Hugging Face RMSNorm is about ten elementwise passes, forward and backward, plus the
casts of its output to the low dtype for the next matmuls). This pass finds those chains by what
they compute (`amp_fx.passes.fuse_norms.norm_chains`: match on canonical op names, so the torch.fx
and the torch.export graphs share one description, and exactly or not at all) and replaces each,
from its input to its output, with one call of `amp_fx.ops.norms`: the same fp32 math, the input
read once in its own dtype, each output written once in the dtype the chain (or the casts after
it) wrote, the residual add before the norm in the same pass. It runs where
``policy.fused_norms`` (default: O2, any device; on a CPU an eager call computes the chain's torch
expression).
Each fused call's `NodeInfo` notes the nodes it replaced.

Example (Llama at O2, bf16; torch.export graph, weight names shortened)::

    before                                            after
    add_6 = aten.add.Tensor(to_7, linear_3)           add_rms_norm_fp32 = add_rms_norm_fp32(to_7,
    to_9 = aten.to.dtype(add_6, torch.float32)            linear_3, w, 1e-06, mid_dtype=None,
    pow_2 = aten.pow.Tensor_Scalar(to_9, 2)               out_dtype=torch.bfloat16)
    mean_1 = aten.mean.dim(pow_2, [-1], True)         sum_1 = add_rms_norm_fp32[0]
    add_7 = aten.add.Tensor(mean_1, 1e-06)            mul_10 = add_rms_norm_fp32[1]
    rsqrt_1 = aten.rsqrt.default(add_7)               to_9 = aten.to.dtype(sum_1, torch.float32)
    mul_9 = aten.mul.Tensor(to_9, rsqrt_1)
    to_10 = aten.to.dtype(mul_9, torch.float32)
    mul_10 = aten.mul.Tensor(w, to_10)
    mul_10_to_bfloat16 = mul_10.to(torch.bfloat16)
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx

from amp_fx.core.dtypes import dtype_name
from amp_fx.core.node_info import NodeInfo, node_info
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.norms import add_layer_norm_fp32, add_rms_norm_fp32, layer_norm_fp32, rms_norm_fp32
from amp_fx.passes.fuse_norms.norm_chains import NormChain, match_norm_chain
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.decisions import decide_node
from amp_fx.passes.shared.fused_calls import insert_call, parameter_node, replace_chain

logger = logging.getLogger(__name__)

__all__ = ["fuse_norms", "FUSED_NORM_FUNCTIONS"]

# The functions a fused norm node calls.
FUSED_NORM_FUNCTIONS = (rms_norm_fp32, add_rms_norm_fp32, layer_norm_fp32, add_layer_norm_fp32)


def _hoist(node: torch.fx.Node, anchor: torch.fx.Node, order: dict[torch.fx.Node, int]) -> None:
    """Move a parameter read (a get_attr, or a cast of one) that comes after ``anchor`` before it."""
    position = order.get(node, -1)  # -1: made just now, before the anchor
    if node.op == "get_attr" or position < order[anchor]:
        if position > order[anchor]:
            anchor.prepend(node)
        return
    for source in node.all_input_nodes:
        _hoist(source, anchor, order)
    anchor.prepend(node)


def _call(norm: NormChain, weight, bias) -> tuple:
    """(function, args, kwargs) of the fused call."""
    if norm.subtract_mean:
        shape = list(norm.normalized_shape)
        if norm.residual is not None:
            return add_layer_norm_fp32, (norm.x, norm.residual, shape, weight, bias, norm.eps), {}
        return layer_norm_fp32, (norm.x, shape, weight, bias, norm.eps), {}
    options = {"weight_offset": norm.weight_offset, "mid_dtype": norm.mid_dtype}
    if norm.residual is not None:
        return add_rms_norm_fp32, (norm.x, norm.residual, weight, norm.eps), options
    return rms_norm_fp32, (norm.x, weight, norm.eps), options


def _computed_by(norm: NormChain, weight: torch.fx.Node | None) -> torch.fx.Node:
    """The chain's node whose module the fused call is recorded in: the one that reads the weight,
    that is the norm module itself (FSDP2 gathers the weight for that module's ops alone,
    `shard_regions`), else the output. The output can be a cast the passes added, of no module."""
    readers = [node for node in norm.replaced if weight is not None and weight in node.all_input_nodes]
    return readers[0] if readers else norm.output


def _describe(norm: NormChain) -> str:
    kind = "LayerNorm" if norm.subtract_mean else "RMSNorm"
    reads = " + ".join(dtype_name(node_info(n).out_dtype) for n in (norm.x, norm.residual) if n is not None)
    added = "the residual add and " if norm.residual is not None else ""
    names = ", ".join(n.name for n in norm.replaced)
    return (
        f"fused {added}{kind}: reads {reads}, computes in float32, writes {dtype_name(norm.out_dtype)}"
        f" once (amp_fx.ops.norms); replaced {names}"
    )


def _rewrite(gm: torch.fx.GraphModule, policy: Policy, norm: NormChain) -> None:
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    anchor = min(norm.replaced, key=order.__getitem__)
    with gm.graph.inserting_before(anchor):
        weight, bias = parameter_node(gm, norm.weight), parameter_node(gm, norm.bias)
    for parameter in (weight, bias):
        if parameter is not None:
            _hoist(parameter, anchor, order)
    function, args, kwargs = _call(norm, weight, bias)
    kwargs["out_dtype"] = norm.out_dtype  # always written: the report and static dtypes read it
    inputs = [n for n in (norm.x, norm.residual, weight, bias) if n is not None]
    info = NodeInfo(
        op=function.__name__,
        in_dtypes=tuple(node_info(n).out_dtype for n in inputs),
        out_dtype=None if norm.residual is not None else norm.out_dtype,
        notes=[_describe(norm)],
    )
    # Where the chain's output came from, for the report and for checkpoint_regions' layer cuts.
    # Not fx-wrapped: traced again (converting a converted model), the call records its torch
    # expression, which this pass fuses again into the same call.
    source = _computed_by(norm, weight)
    fused = insert_call(gm, function, args, kwargs, before=anchor, info=info, inherits=source)
    # The op and rule classify gives this call when the graph is converted again.
    decision = decide_node(fused, gm, policy)
    info.rule, info.reason = decision.rule, decision.reason
    values = {}
    out = fused
    if norm.residual is not None:
        sum_dtype = node_info(norm.sum_node).out_dtype
        summed, out = (
            insert_call(
                gm,
                operator.getitem,
                (fused, index),
                before=anchor,
                info=NodeInfo(op="getitem", rule=Rule.PASSTHROUGH, out_dtype=dtype),
                inherits=source,
            )
            for index, dtype in enumerate((sum_dtype, norm.out_dtype))
        )
        values[norm.sum_node] = summed
    values |= {cast: cast.args[0] for cast in norm.output_casts}
    values[norm.output] = out
    for reshape in norm.retyped:
        node_info(reshape).out_dtype = norm.out_dtype
    replace_chain(gm, norm.replaced, values)


def fuse_norms(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Replace RMSNorm and LayerNorm chains (and the residual add before them) with fused calls;
    in place on `gm` (``modified``: whether it fused one).

    Example::

        >>> from torch import nn
        >>> from amp_fx import convert
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
        >>> gm = convert(model, "O2", dtype=torch.bfloat16)  # calls this pass
        >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
        ['cast_if_floating', 'layer_norm_fp32']
    """
    policy = context.policy
    if not policy.fused_norms:
        return PassResult(gm, False)
    fused, erased = 0, set()
    for node in list(gm.graph.nodes):
        if node in erased:
            continue
        norm = match_norm_chain(node, gm)
        if norm is None:
            continue
        _rewrite(gm, policy, norm)
        erased.update(norm.replaced)
        fused += 1
    if fused:
        gm.recompile()
    logger.debug("fuse_norms %s: %d norm chains fused", policy.opt_level, fused)
    return PassResult(gm, bool(fused))
