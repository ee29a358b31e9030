"""A convert pass (O2): 2-D max pooling through `amp_fx.ops.max_pool.max_pool2d`.

torch's max-pool saves an int64 index per output element for its backward and, on channels_last fp16
activations, runs that backward at a fraction of the memory bandwidth (ResNet-50's stem max-pool:
0.84 ms forward, 1.94 ms backward per step on an H200). `amp_fx.ops.max_pool.max_pool2d` computes the
same values and gradients with 1-byte argmax offsets and a one-pass gather backward (Triton), and is
plain ``F.max_pool2d`` for any call its kernels do not cover or would not speed up (decided at run
time from the input's layout, dtype and size) and under torch.compile. This pass points every 2-D
max-pool call at it: ``nn.MaxPool2d`` modules (their attributes read now), ``F.max_pool2d`` and
``torch.max_pool2d``, except calls that return indices (their indices are torch's int64 flat
indices), MaxPool2d modules with hooks (they would no longer fire) and opaque nodes. MaxPool1d/3d
are left alone. It runs only where ``policy.fused_max_pool`` (default: O2 on CUDA). The node keeps
its NodeInfo (op ``max_pool2d``, rule, dtypes): the values are the same, only the implementation
changes.

Example (O2, fp16; torchvision's ResNet stem)::

    before                                  after
    maxpool = self.maxpool(relu)            maxpool = amp_fx_pooling_max_pool2d(relu, 3, stride=2,
                                                padding=1, dilation=1, ceil_mode=False)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule
from amp_fx.ops.max_pool import max_pool2d
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.fused_calls import retarget_call

logger = logging.getLogger(__name__)

__all__ = ["replace_max_pool"]

_PARAMETERS = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
_F_PARAMETERS = (*_PARAMETERS, "return_indices")
_NOTE = "runs amp_fx.ops.max_pool.max_pool2d (1-byte argmax offsets, one-pass gather backward)"


def _module_arguments(module: nn.Module, node: torch.fx.Node) -> dict[str, Any] | None:
    """An nn.MaxPool2d call's arguments by name, read from the module, or None."""
    if type(module).forward is not nn.MaxPool2d.forward or module.return_indices:
        return None
    if has_forward_hooks(module):
        return None  # replaced by a function call, the module would not run, nor its hooks
    if len(node.args) + len(node.kwargs) != 1:
        return None
    inputs = node.args[0] if node.args else node.kwargs.get("input")
    return {
        "input": inputs,
        "kernel_size": module.kernel_size,
        "stride": module.stride,
        "padding": module.padding,
        "dilation": module.dilation,
        "ceil_mode": module.ceil_mode,
    }


def _function_arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """An F.max_pool2d / torch.max_pool2d call's arguments by name, or None where it returns indices
    or passes arguments the signature lacks."""
    parameters = _F_PARAMETERS if node.target is F.max_pool2d else _PARAMETERS
    if len(node.args) > len(parameters) or not set(node.kwargs) <= set(parameters):
        return None
    arguments = dict(zip(parameters, node.args, strict=False)) | dict(node.kwargs)
    if arguments.pop("return_indices", False) is not False or "kernel_size" not in arguments:
        return None
    if node.target is torch.max_pool2d and arguments.get("stride") == []:
        arguments["stride"] = None  # torch.max_pool2d's default: the kernel size
    return arguments


def _arguments(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict[str, Any] | None:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        return _module_arguments(module, node) if isinstance(module, nn.MaxPool2d) else None
    if node.op == "call_function" and node.target in (F.max_pool2d, torch.max_pool2d):
        return _function_arguments(node)
    return None


def replace_max_pool(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Point 2-D max-pool calls at `amp_fx.ops.max_pool.max_pool2d`, in place on `gm`
    (``modified``: whether it replaced one).

    Example::

        >>> import torchvision
        >>> from amp_fx import convert
        >>> # calls this pass; device_type="cuda" only picks the policy, converting needs no GPU
        >>> gm = convert(torchvision.models.resnet18(), "O2", device_type="cuda")
        >>> [n.target.__module__ for n in gm.graph.nodes if n.name == "maxpool"]
        ['amp_fx.ops.max_pool']
    """
    policy = context.policy
    if not policy.fused_max_pool:
        return PassResult(gm, False)
    replaced = 0
    for node in list(gm.graph.nodes):
        info = node_info(node)
        if info.op != "max_pool2d" or info.rule is Rule.OPAQUE:
            continue
        arguments = _arguments(gm, node)
        if arguments is None or not isinstance(arguments.get("input"), torch.fx.Node):
            continue
        # An nn.MaxPool2d module stays in the model (no state; its name may still be referred to).
        args = (arguments.pop("input"), arguments.pop("kernel_size"))
        retarget_call(node, max_pool2d, args, arguments, note=_NOTE)
        replaced += 1
    if replaced:
        gm.recompile()
    logger.debug("replace_max_pool %s: %d max-pool calls", policy.opt_level, replaced)
    return PassResult(gm, bool(replaced))
