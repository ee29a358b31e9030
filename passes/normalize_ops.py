"""A convert pass: give every call one canonical op name, whatever its spelling.

``torch.softmax(x, -1)``, ``F.softmax(x, -1)``, ``x.softmax(-1)`` and ``nn.Softmax(-1)`` are one op,
``"softmax"``; ``x + y``, ``x += y``, ``torch.add``, ``x.add`` and ``x.add_`` are ``"add"``. The
canonical name is the aten op the call lowers to, without overload and without the in-place
underscore, so the policy can be written against torch.autocast's op lists. The graph is not
rewritten (it keeps reading as the user wrote it): the name goes to ``node_info(node).op`` and the
original spelling to ``node_info(node).notes``.

Example::

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc, self.act = nn.Linear(4, 4), nn.Softmax(-1)
    ...     def forward(self, x):
    ...         x = self.fc(x)
    ...         x += 1
    ...         return F.softmax(x, -1) @ self.act(x).mT
    >>> from amp_fx.capture.fx import trace
    >>> gm = normalize_ops(trace(Net())).graph_module
    >>> for n in gm.graph.nodes:                          # before: op None everywhere
    ...     if n.op.startswith("call"):
    ...         print(n.name, node_info(n).op, node_info(n).notes)
    fc linear ['nn.Linear']
    add add ['operator.add (+)']
    softmax softmax ['F.softmax']
    act softmax ['nn.Softmax']
    getattr_1 getattr ['builtins.getattr']
    matmul matmul ['operator.matmul (@)']

Nodes made opaque by `trace` keep rule OPAQUE and get op ``"opaque"`` (`amp_fx.core.op_lists.OPAQUE_OP`),
with the module class or function in the notes. Python-level composites keep their functional
name (``einsum`` stays ``"einsum"``, ``F.normalize`` is ``"normalize"``, an ``F.interpolate`` whose
rank is unknown is ``"interpolate"``); `amp_fx.core.op_lists` lists them as composites.
"""

from __future__ import annotations

import builtins
import logging
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.core.module_ops import MODULE_OPS, module_op, upsample_op
from amp_fx.core.node_info import node_info
from amp_fx.core.op_lists import OPAQUE_OP, canonical_op_name, is_known_op
from amp_fx.core.policy import Rule
from amp_fx.passes.shared.call_nodes import call_argument
from amp_fx.passes.shared.conversion import Conversion, PassResult

logger = logging.getLogger(__name__)

__all__ = ["normalize_ops", "canonical_op", "module_op", "original_spelling", "MODULE_OPS", "OPERATOR_OPS"]

# Python operators -> (canonical op, symbol shown in the report).
OPERATOR_OPS: dict[Callable[..., Any], tuple[str, str]] = {
    operator.add: ("add", "+"),
    operator.iadd: ("add", "+="),
    operator.sub: ("sub", "-"),
    operator.isub: ("sub", "-="),
    operator.mul: ("mul", "*"),
    operator.imul: ("mul", "*="),
    operator.truediv: ("div", "/"),
    operator.itruediv: ("div", "/="),
    operator.floordiv: ("floor_divide", "//"),
    operator.ifloordiv: ("floor_divide", "//="),
    operator.mod: ("remainder", "%"),
    operator.imod: ("remainder", "%="),
    operator.pow: ("pow", "**"),
    operator.ipow: ("pow", "**="),
    operator.matmul: ("matmul", "@"),
    operator.imatmul: ("matmul", "@="),
    operator.neg: ("neg", "unary -"),
    operator.pos: ("positive", "unary +"),
    operator.abs: ("abs", "abs()"),
    operator.invert: ("bitwise_not", "~"),
    operator.and_: ("bitwise_and", "&"),
    operator.iand: ("bitwise_and", "&="),
    operator.or_: ("bitwise_or", "|"),
    operator.ior: ("bitwise_or", "|="),
    operator.xor: ("bitwise_xor", "^"),
    operator.ixor: ("bitwise_xor", "^="),
    operator.lshift: ("bitwise_left_shift", "<<"),
    operator.rshift: ("bitwise_right_shift", ">>"),
    operator.eq: ("eq", "=="),
    operator.ne: ("ne", "!="),
    operator.lt: ("lt", "<"),
    operator.le: ("le", "<="),
    operator.gt: ("gt", ">"),
    operator.ge: ("ge", ">="),
    operator.getitem: ("getitem", "[]"),
    operator.setitem: ("setitem", "[]="),
    builtins.getattr: ("getattr", "getattr"),
}

# Spellings torch accepts for the same aten op (aliases), and functional names whose op has
# another name in `amp_fx.core.op_lists`. Applied after stripping the in-place underscore and before
# `op_lists.canonical_op_name` (which holds the aliases the policy accepts from users too).
_ALIASES = {
    "true_divide": "div",
    "clip": "clamp",
    "arccos": "acos",
    "arcsin": "asin",
    "arctan": "atan",
    "arctan2": "atan2",
    "arccosh": "acosh",
    "arcsinh": "asinh",
    "arctanh": "atanh",
    "greater": "gt",
    "greater_equal": "ge",
    "less": "lt",
    "less_equal": "le",
    "not_equal": "ne",
    "swapaxes": "transpose",
    "swapdims": "transpose",
    "moveaxis": "movedim",
    "fix": "trunc",
    "ger": "outer",
    "expit": "sigmoid",
    "special_expit": "sigmoid",
    "log_sigmoid": "logsigmoid",  # F.logsigmoid is torch._C._nn.log_sigmoid
    "max_pool1d_with_indices": "max_pool1d",
    "max_pool2d_with_indices": "max_pool2d",
    "max_pool3d_with_indices": "max_pool3d",
    "adaptive_max_pool1d_with_indices": "adaptive_max_pool1d",
    "adaptive_max_pool2d_with_indices": "adaptive_max_pool2d",
    "adaptive_max_pool3d_with_indices": "adaptive_max_pool3d",
    "fold": "col2im",
    "unfold_input": "im2col",
}
# Tensor methods that convert dtype or device: one op, "to".
_CONVERSION_METHODS = {
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "bool",
    "byte", "char", "cfloat", "cdouble", "cuda", "cpu",
}  # fmt: skip
# F.fold/F.unfold are the functional spellings of the im2col/col2im modules; Tensor.unfold is
# a different op (sliding windows), so only the functional unfold is renamed.
_FUNCTIONAL_RENAMES = {F.unfold: "im2col", F.fold: "col2im"}
_INTERPOLATE_FUNCTIONS = {F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear}
_spelling_index: dict[int, str] | None = None


def _public_spellings() -> dict[int, str]:
    """id(callable) -> its public spelling ("F.softmax", "torch.add", "math.sqrt"), built once."""
    global _spelling_index
    if _spelling_index is None:
        index: dict[int, str] = {}
        for prefix, namespace in (("math", math), ("torch", torch), ("F", F)):  # later wins: F over torch
            for name, value in vars(namespace).items():
                if callable(value) and not name.startswith("__"):
                    index[id(value)] = f"{prefix}.{name}"
        _spelling_index = index
    return _spelling_index


def _strip_inplace(name: str) -> str:
    if name.endswith("_") and not name.endswith("__") and len(name) > 1:
        return name[:-1]
    return name


def _name_of_callable(fn: Any) -> str:
    """Canonical name of a function target: aten OpOverload/Packet by schema, else its __name__."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = fn._schema.name if isinstance(fn, torch._ops.OpOverload) else fn._qualified_op_name
        return name.split("::")[-1]
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name


def _canonical_name(name: str) -> str:
    name = _strip_inplace(name)
    return canonical_op_name(_ALIASES.get(name, name))


def _function_op(node: torch.fx.Node) -> str:
    target = node.target
    if target is builtins.getattr:
        # x.shape is recorded as getattr(x, "shape"): named by the attribute where that is an op.
        attribute = call_argument(node, 1, "name")
        if isinstance(attribute, str) and is_known_op(attribute):
            return attribute
    if target in OPERATOR_OPS:
        return OPERATOR_OPS[target][0]
    if target in _FUNCTIONAL_RENAMES:
        return _FUNCTIONAL_RENAMES[target]
    if target in _INTERPOLATE_FUNCTIONS:
        if target is F.upsample_bilinear:
            return "upsample_bilinear2d"
        if target is F.upsample_nearest:
            return upsample_op(
                "nearest", call_argument(node, 1, "size"), call_argument(node, 2, "scale_factor")
            )
        return upsample_op(
            call_argument(node, 3, "mode", "nearest"),
            call_argument(node, 1, "size"),
            call_argument(node, 2, "scale_factor"),
        )
    return _canonical_name(_name_of_callable(target))


def _method_op(name: str) -> str:
    if name in _CONVERSION_METHODS:
        return "to"
    return _canonical_name(name)


def canonical_op(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """The canonical op name of a call node, or None for placeholders, get_attr and output.

    Example::

        >>> gm = torch.fx.symbolic_trace(lambda x: x.softmax(-1).add_(1))
        >>> [canonical_op(n, gm) for n in gm.graph.nodes]
        [None, 'softmax', 'add', None]
    """
    if node.op == "call_module":
        return module_op(gm.get_submodule(node.target))
    if node.op == "call_function":
        return _function_op(node)
    if node.op == "call_method":
        return _method_op(node.target)
    return None


def original_spelling(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """How the user wrote the call: "F.softmax", "Tensor.softmax", "nn.Softmax", "operator.iadd (+=)"."""
    if node.op == "call_module":
        cls = type(gm.get_submodule(node.target))
        if cls.__module__.startswith("torch.nn.") and getattr(nn, cls.__name__, None) is cls:
            return f"nn.{cls.__name__}"
        return f"{cls.__module__}.{cls.__qualname__}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op != "call_function":
        return None
    target = node.target
    if target in OPERATOR_OPS:
        symbol = OPERATOR_OPS[target][1]
        module = "builtins" if target is builtins.getattr else "operator"
        name = f"{module}.{target.__name__}"
        return name if symbol == target.__name__ else f"{name} ({symbol})"
    public = _public_spellings().get(id(target))
    if public is not None:
        return public
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{target}"
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"


def normalize_ops(gm: torch.fx.GraphModule, context: Conversion | None = None) -> PassResult:
    """Record the canonical op name and original spelling of every call node; returns
    ``PassResult(gm, False)`` (the graph is unchanged). It does not read the context.

    Opaque nodes (rule OPAQUE, set by `trace`) get the op name policies use for untraced code,
    ``"opaque"`` (`amp_fx.core.op_lists.OPAQUE_OP`); their class or function goes to the notes.

    Example::

        >>> from amp_fx.capture.fx import trace
        >>> gm = normalize_ops(trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))).graph_module
        >>> [node_info(n).op for n in gm.graph.nodes]
        [None, 'linear', 'relu', None]
    """
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        info = node_info(node)
        spelling = original_spelling(node, gm)
        if spelling is not None and spelling not in info.notes:
            info.notes.insert(0, spelling)
        # Untraced code is one op for the policy, "opaque"; what it is stays in the notes. So is a
        # library's own custom op: torch.autocast does not cast at it, but at the ops its kernel
        # calls (transformers' grouped_mm_fallback runs matmuls), which only an island reproduces.
        opaque = info.rule is Rule.OPAQUE or _is_library_op(node)
        info.op = OPAQUE_OP if opaque else canonical_op(node, gm)
    return PassResult(gm, False)  # annotations only


# Namespaces whose ops the policy knows by name (amp_fx's own custom ops are its passes' output).
_KNOWN_NAMESPACES = frozenset({"aten", "prims", "amp_fx"})


def _is_library_op(node: torch.fx.Node) -> bool:
    """A call of a custom op another library registered (``torch.ops.<library>.<op>``)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace not in _KNOWN_NAMESPACES
    )
