"""What a call node is: its arguments, whether it updates in place, which module made it.

>>> gm = torch.fx.symbolic_trace(lambda x: x.exp_())
>>> [is_inplace_call(n) for n in gm.graph.nodes]
[False, True, False]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from amp_fx.core.op_facts import INPLACE_OPERATORS

__all__ = ["call_argument", "is_inplace_call", "calling_module"]


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
