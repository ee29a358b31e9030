"""A convert pass (O2/O3): store parameters and floating buffers in the policy's dtype.

Each module's parameters and floating buffers get the ``param_dtype`` the policy decides for the
call of that module (`Policy.decide`): the low dtype, or float32 where the policy keeps them
(BatchNorm under ``keep_batchnorm_fp32``, LayerNorm/GroupNorm affine parameters at O2, modules
whose rule is FP32). A parameter read directly by the graph (``get_attr``) takes the decision of
the ops that read it, float32 winning if any of them wants it. Integer buffers
(``num_batches_tracked``, index tables) and float64 tensors are never cast.

Casting assigns ``param.data``, so each parameter keeps its identity (weight tying survives, an
optimizer built afterwards sees the low-precision tensors) and gradients flow to it in its new
dtype. O0/O1 leave parameters as they are.

Example (O2, bf16; ``Sequential(Linear, BatchNorm1d)``)::

    before                                   after
    0.weight float32, 0.bias float32         0.weight bfloat16, 0.bias bfloat16
    1.weight float32, 1.running_mean float32 1.weight float32, 1.running_mean float32   (keep_batchnorm_fp32)
    1.num_batches_tracked int64              1.num_batches_tracked int64
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.decisions import module_tensors

logger = logging.getLogger(__name__)

__all__ = ["cast_parameters"]


def cast_parameters(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Cast parameters and floating buffers to their planned dtype (``context.parameter_plan``), in
    place on `gm` (``modified``: whether it cast one).

    Example::

        >>> from torch import nn
        >>> from amp_fx.core.policy import preset
        >>> from amp_fx.passes.classify import classify
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> from amp_fx.passes.shared.decisions import plan_parameters
        >>> from amp_fx.capture.fx import trace
        >>> context = Conversion(preset("O2", torch.float16, "cpu"))
        >>> gm = normalize_ops(trace(nn.Sequential(nn.Linear(2, 2)))).graph_module
        >>> gm = classify(gm, context).graph_module
        >>> cast_parameters(gm, plan_parameters(gm, context)).graph_module.get_parameter("0.weight").dtype
        torch.float16
    """
    policy = context.policy
    plan = context.parameter_plan
    if not plan:
        return PassResult(gm, False)
    done: dict[int, torch.Tensor] = {}  # id(original buffer) -> its cast, so tied buffers stay tied
    counts: dict[torch.dtype, int] = {}
    for name, dtype in plan.items():
        owner_path, _, attribute = name.rpartition(".")
        owner = gm.get_submodule(owner_path)
        if attribute in owner._parameters:
            param = owner._parameters[attribute]
            if param is None or param.dtype == dtype:
                continue
            grad = param.grad
            param.data = param.data.to(dtype)
            if grad is not None:
                param.grad = grad.to(dtype)
            counts[dtype] = counts.get(dtype, 0) + 1
        else:
            buffer = owner._buffers[attribute]
            if buffer is None or buffer.dtype == dtype:
                continue
            key = id(buffer)
            if key not in done:
                done[key] = buffer.to(dtype)
                counts[dtype] = counts.get(dtype, 0) + 1
            owner._buffers[attribute] = done[key]
    _note_storage(gm, plan)
    logger.debug("cast_parameters %s: %s", policy.opt_level, {str(d): n for d, n in counts.items()})
    return PassResult(gm, bool(counts))


def _note_storage(gm: torch.fx.GraphModule, plan: dict[str, torch.dtype]) -> None:
    """Tell the report where parameters are kept in float32 (the exceptions to the low dtype)."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        kept = [
            name.removeprefix(node.target + ".")
            for name, _ in module_tensors(module, node.target)
            if plan.get(name) == torch.float32
        ]
        if kept:
            note = f"parameters kept float32: {', '.join(sorted(kept))}"
            info = node_info(node)
            if note not in info.notes:
                info.notes.append(note)
