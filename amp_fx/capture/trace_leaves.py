"""What the torch.fx front end (`amp_fx.capture.fx`) keeps whole: primitive torch.nn modules as
leaves, and the opaque nodes (modules by design or by ``leaf_modules``, untraceable submodules,
autograd Functions, ``torch.fx.wrap``-ed functions) with the reason each is opaque. Apart from
the tracer for its size.

Example:
    >>> from amp_fx.capture.fx import trace
    >>> gm = trace(nn.Sequential(nn.Linear(2, 2), nn.GRU(2, 2)))
    >>> [node_info(n).opaque_reason for n in gm.graph.nodes if n.op == "call_module"]
    [None, 'torch.nn.GRU has no traceable forward (fused kernel with data-dependent fast paths)']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.capture.autograd_functions import apply_autograd_function
from amp_fx.core.node_info import FX_WRAPPED_KEY, node_info
from amp_fx.core.op_facts import NON_TENSOR_MODULES
from amp_fx.core.policy import Rule

__all__ = ["OPAQUE_TORCH_MODULES", "is_primitive_module", "mark_opaque", "validate_leaf_modules"]

# torch.nn modules that are leaves but whose forward is not one op the policy can reason about:
# fused attention/recurrent kernels with data-dependent fast paths. They run as opaque nodes.
OPAQUE_TORCH_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention, nn.RNNBase, nn.RNNCellBase)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_TORCH_NN_PREFIXES = ("torch.nn.", "torch.ao.nn.")


def is_primitive_module(module: nn.Module) -> bool:
    """True for a ``torch.nn`` module that computes one op and stays a leaf of the trace.

    A torch.nn (or torch.ao.nn) module with no child modules is primitive (Linear, Conv2d,
    BatchNorm2d, ReLU, Dropout, Embedding, MaxPool2d, Flatten, losses, ...); containers and
    composites with children (Sequential, TransformerEncoderLayer, ...) are traced through.

        >>> is_primitive_module(nn.Linear(2, 2)), is_primitive_module(nn.Sequential(nn.ReLU()))
        (True, False)
    """
    if isinstance(module, _CONTAINERS):
        return False
    module_path = type(module).__module__ + "."
    return module_path.startswith(_TORCH_NN_PREFIXES) and not module._modules


def validate_leaf_modules(
    model: nn.Module, leaf_modules: Sequence[type | str]
) -> tuple[tuple[type, ...], set[str]]:
    """``trace``'s ``leaf_modules`` as (module types, qualified names of ``model``'s submodules).

    Raises TypeError for an entry that is neither, ValueError for a name ``model`` does not have.

        >>> validate_leaf_modules(nn.Sequential(nn.ReLU()), [nn.ReLU, "0"])
        ((<class 'torch.nn.modules.activation.ReLU'>,), {'0'})
    """
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = (leaf_modules,)
    types_, names = [], set()
    module_names = None
    for entry in leaf_modules:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            types_.append(entry)
        elif isinstance(entry, str):
            if module_names is None:
                module_names = {name for name, _ in model.named_modules()}
            if entry == "" or entry not in module_names:
                candidates = sorted(n for n in module_names if n)[:10]
                raise ValueError(
                    f"leaf_modules names {entry!r}, which is not a submodule of {type(model).__name__}; "
                    f"use a qualified name from model.named_modules(), e.g. {candidates}"
                )
            names.add(entry)
        else:
            raise TypeError(
                f"leaf_modules entries must be nn.Module subclasses or qualified module names (str), "
                f"got {entry!r} of type {type(entry).__name__}"
            )
    return tuple(types_), names


def _is_opaque_function(node: torch.fx.Node) -> bool:
    """A call_function recorded as a whole by torch.fx.wrap, unless it is torch's own or a plain
    Python helper on sizes (math.sqrt, len)."""
    if node.op != "call_function" or not node.meta.get(FX_WRAPPED_KEY):
        return False
    module = getattr(node.target, "__module__", None) or ""
    return module not in NON_TENSOR_MODULES and not (module == "torch" or module.startswith("torch."))


def _function_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def mark_opaque(
    gm: torch.fx.GraphModule,
    graph: torch.fx.Graph,
    opaque_types: tuple[type, ...],
    leaf_names: set[str],
    untraceable: dict[str, tuple[str, str]],
) -> None:
    """Mark ``graph``'s opaque nodes (``graph`` is ``gm``'s, or its other training mode's):
    ``node_info(node).rule`` becomes ``Rule.OPAQUE``, with its ``op`` and ``opaque_reason``.
    ``opaque_types``/``leaf_names`` are `validate_leaf_modules`'s, ``untraceable`` the submodules
    that stopped the tracer: qualified name -> (opaque_reason, the error)."""
    modules = dict(gm.named_modules())
    for node in graph.nodes:
        if node.op == "call_module":
            module = modules[node.target]
            reason, detail = None, None
            if node.target in untraceable:
                reason, detail = untraceable[node.target]
            elif node.target in leaf_names or isinstance(module, opaque_types):
                reason = f"leaf_modules: {type(module).__qualname__}"
            elif isinstance(module, OPAQUE_TORCH_MODULES):
                reason = (
                    f"torch.nn.{type(module).__name__} has no traceable forward "
                    "(fused kernel with data-dependent fast paths)"
                )
            if reason is not None:
                info = node_info(node)
                info.rule, info.opaque_reason, info.op = Rule.OPAQUE, reason, type(module).__name__
                if detail is not None:
                    info.notes.append(detail)
        elif node.op == "call_function" and node.target is apply_autograd_function:
            info = node_info(node)
            function = getattr(gm, node.args[0].target)
            info.rule, info.op = Rule.OPAQUE, function.__qualname__
            info.opaque_reason = f"torch.autograd.Function {function.__qualname__}: its own backward runs"
        elif _is_opaque_function(node):
            info = node_info(node)
            name = _function_name(node.target)
            info.rule, info.op = Rule.OPAQUE, name
            info.opaque_reason = f"fx.wrap: {getattr(node.target, '__module__', '?')}.{name}"
