"""Pass 6 of convert (O2/O3): store parameters and floating buffers in the policy's dtype.

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
from collections.abc import Iterator

import torch
import torch.fx
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Policy
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.ops.fused_batch_norm import FusedBatchNormAct
from amp_fx.passes.classify import decide_node

logger = logging.getLogger(__name__)

__all__ = ["cast_parameters", "planned_parameter_dtypes"]

# The op a parameter that no call decides about is asked under (the policy's global rule applies,
# and module-name overrides of its owner).
_UNCALLED_OP = "parameter"


def _castable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64


def _module_tensors(module: nn.Module, path: str) -> Iterator[tuple[str, torch.Tensor]]:
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
    if not policy.cast_parameters:
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
            for name, tensor in _module_tensors(module, path):
                want(name, tensor, decision.param_dtype if decision is not None else None)
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


def _tensor_at(gm: torch.fx.GraphModule, target: str) -> torch.Tensor | None:
    owner_path, _, attribute = target.rpartition(".")
    owner = gm.get_submodule(owner_path)
    tensor = owner._parameters.get(attribute, owner._buffers.get(attribute))
    return tensor if isinstance(tensor, torch.Tensor) else None


def cast_parameters(gm: torch.fx.GraphModule, policy: Policy) -> torch.fx.GraphModule:
    """Cast parameters and floating buffers to their planned dtype, in place on `gm`.

    Example::

        >>> policy = preset("O2", torch.float16, "cpu")
        >>> gm = classify(normalize_ops(trace(nn.Sequential(nn.Linear(2, 2)))), policy)
        >>> cast_parameters(gm, policy).get_parameter("0.weight").dtype
        torch.float16
    """
    plan = planned_parameter_dtypes(gm, policy)
    if not plan:
        return gm
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
    return gm


def _note_storage(gm: torch.fx.GraphModule, plan: dict[str, torch.dtype]) -> None:
    """Tell the report where parameters are kept in float32 (the exceptions to the low dtype)."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        kept = [
            name.removeprefix(node.target + ".")
            for name, _ in _module_tensors(module, node.target)
            if plan.get(name) == torch.float32
        ]
        if kept:
            note = f"parameters kept float32: {', '.join(sorted(kept))}"
            info = node_info(node)
            if note not in info.notes:
                info.notes.append(note)
