"""A convert pass (O2): BatchNorm2d, the residual add after it and the ReLU as one call.

A ResNet spends most of a step outside its convolutions: training-mode BatchNorm reads its input
twice and writes it once, the residual add and the ReLU read and write it again, and backward does
it all once more. `amp_fx.ops.batch_norm.FusedBatchNormAct` runs the three as one BatchNorm with
an epilogue (`amp_fx.ops.batch_norm.batch_norm_act`: the same fp32 statistics, one write of the output).
This pass puts it in place of

    relu(bn(x))                  ->  bn_relu(x)
    relu(bn(x) + identity)       ->  bn_add_relu(x, identity)      (either operand order)

where ``bn`` is an ``nn.BatchNorm2d`` whose output nothing else reads, with the rule the policy
gives batch_norm at O2 (PASSTHROUGH: fp32 parameters, low-precision input, no casts), and the
add's other operand has the BatchNorm's dtype, and neither the BatchNorm nor a ReLU module has
hooks (they would no longer fire). It runs only where ``policy.fused_batch_norm`` (default: O2 on
CUDA). The BatchNorm module stays in the model under its name; the new module, registered beside
it as ``<name>_relu`` / ``<name>_add_relu`` (``_1``, ``_2``, ... appended if the model already has
that name), calls it.

Example (O2, fp16; torchvision's Bottleneck)::

    before                                        after
    bn3 = self.layer1.0.bn3(conv3)                downsample_1 = ...
    downsample_1 = ...                            bn3 = self.layer1.0.bn3_add_relu(conv3, downsample_1)
    add = bn3 + downsample_1
    relu_2 = self.layer1.0.relu(add)
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule
from amp_fx.ops.batch_norm import FusedBatchNormAct, is_fusable_batch_norm
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.fused_calls import insert_call, replace_chain

logger = logging.getLogger(__name__)

__all__ = ["fuse_batch_norm"]

_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_relu(node: torch.fx.Node | None, value: torch.fx.Node) -> bool:
    """A ReLU of `value` alone (nn.ReLU, F.relu, torch.relu, Tensor.relu, in place or not)."""
    if (
        node is None
        or node_info(node).op != "relu"
        or node.op not in ("call_module", "call_function", "call_method")
    ):
        return False
    return list(node.args[:1]) == [value] and not node.args[1:] and set(node.kwargs) <= {"inplace"}


def _residual(add: torch.fx.Node | None, value: torch.fx.Node) -> torch.fx.Node | None:
    """The other operand of ``value + other`` (a plain two-tensor add of one dtype), or None."""
    if add is None or add.op != "call_function" or add.target not in _ADD_FUNCTIONS or add.kwargs:
        return None
    if len(add.args) != 2 or value not in add.args or add.args[0] is add.args[1]:
        return None
    other = add.args[1] if add.args[0] is value else add.args[0]
    if not isinstance(other, torch.fx.Node):
        return None
    dtype = node_info(value).out_dtype
    return other if dtype is not None and node_info(other).out_dtype == dtype else None


def _free_name(gm: torch.fx.GraphModule, path: str) -> str:
    """``path``, or ``path_1``, ``path_2``, ... when the model already has a module or attribute
    there (add_submodule would silently replace it)."""
    parent_path, _, name = path.rpartition(".")
    parent = gm.get_submodule(parent_path)
    candidate, index = name, 0
    while hasattr(parent, candidate):
        index += 1
        candidate = f"{name}_{index}"
    return f"{parent_path}.{candidate}" if parent_path else candidate


def _relu_has_hooks(gm: torch.fx.GraphModule, relu: torch.fx.Node) -> bool:
    return relu.op == "call_module" and has_forward_hooks(gm.get_submodule(relu.target))


def _fuse(
    gm: torch.fx.GraphModule, bn: torch.fx.Node, relu: torch.fx.Node, residual: torch.fx.Node | None
) -> None:
    suffix = "_add_relu" if residual is not None else "_relu"
    path = _free_name(gm, f"{bn.target}{suffix}")
    gm.add_submodule(path, FusedBatchNormAct(gm.get_submodule(bn.target), bn.target))
    fused_away = [n for n in relu.args[:1] if n is not bn]  # the add, when there is one
    inputs = (bn.args[0], residual) if residual is not None else (bn.args[0],)
    what = "the residual add and the ReLU" if residual is not None else "the ReLU"
    note = f"fused with {what}: {path} (amp_fx.ops.batch_norm.batch_norm_act)"
    # The BatchNorm's record (its rule and reason) with the new inputs' dtypes.
    info = dataclasses.replace(node_info(bn), in_dtypes=(), notes=[*node_info(bn).notes, note])
    # At the ReLU's place: the residual may be computed after the BatchNorm (a downsample branch).
    fused = insert_call(gm, path, inputs, before=relu, info=info, kind="call_module")
    replace_chain(gm, [relu, *fused_away, bn], {relu: fused})


def fuse_batch_norm(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Replace BatchNorm2d -> [add] -> ReLU chains with `FusedBatchNormAct` calls, in place on `gm`
    (``modified``: whether it fused one).

    Example::

        >>> import torchvision
        >>> from amp_fx import convert
        >>> # calls this pass; device_type="cuda" only picks the policy, converting needs no GPU
        >>> gm = convert(torchvision.models.resnet18(), "O2", device_type="cuda")
        >>> sum(isinstance(m, FusedBatchNormAct) for m in gm.modules())
        17
    """
    policy = context.policy
    if not policy.fused_batch_norm:
        return PassResult(gm, False)
    fused = 0
    for bn in list(gm.graph.nodes):
        if (
            bn.op != "call_module"
            or len(bn.args) != 1
            or bn.kwargs
            or node_info(bn).rule is not Rule.PASSTHROUGH
        ):
            continue
        module = gm.get_submodule(bn.target)
        if not is_fusable_batch_norm(module) or has_forward_hooks(module):
            continue
        user = _only_user(bn)
        if _is_relu(user, bn) and not _relu_has_hooks(gm, user):
            _fuse(gm, bn, user, None)
            fused += 1
            continue
        residual = _residual(user, bn)
        after_add = _only_user(user) if residual is not None else None
        if residual is not None and _is_relu(after_add, user) and not _relu_has_hooks(gm, after_add):
            _fuse(gm, bn, after_add, residual)
            fused += 1
    if fused:
        gm.recompile()
    logger.debug("fuse_batch_norm %s: %d BatchNorm2d calls fused", policy.opt_level, fused)
    return PassResult(gm, bool(fused))
