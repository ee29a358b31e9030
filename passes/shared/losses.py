"""Which cross-entropy calls the fused loss kernel computes, for `fuse_losses`, `fuse_linear_loss` and
`fuse_chunked_linear_loss`, and the arguments of a cross-entropy call in either front end's spelling:
``cross_entropy_loss`` itself, or the ``nll_loss`` that reads its input's ``log_softmax``
(`log_softmax_dim`, `log_softmax_over_classes`).

>>> arguments = dict(zip(CROSS_ENTROPY_PARAMETERS, (torch.fx.Graph().placeholder("x"), None)))
>>> is_fusable_loss(CROSS_ENTROPY_DEFAULTS | arguments)
True
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.ops.cross_entropy import fp32_cross_entropy
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.op_patterns import tensor_value

__all__ = [
    "CROSS_ENTROPY_DEFAULTS",
    "CROSS_ENTROPY_PARAMETERS",
    "cross_entropy_call_arguments",
    "is_fusable_loss",
    "is_last_size_of",
    "log_softmax_dim",
    "log_softmax_over_classes",
    "nll_loss_call_arguments",
]


# F.cross_entropy's parameters after (input, target), with their defaults, and all of them in order.
CROSS_ENTROPY_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
    "label_smoothing": 0.0,
}


CROSS_ENTROPY_PARAMETERS = ("input", "target", *CROSS_ENTROPY_DEFAULTS)


def is_fusable_loss(arguments: dict[str, Any]) -> bool:
    """Whether a cross-entropy call with these arguments (every parameter of F.cross_entropy, by
    name) is one the fused kernel computes; anything else keeps the cast and torch's float32 loss."""
    return (
        set(CROSS_ENTROPY_PARAMETERS) <= set(arguments)
        and isinstance(arguments["input"], torch.fx.Node)
        and "target" in arguments
        and arguments["weight"] is None
        and arguments["size_average"] is None
        and arguments["reduce"] is None
        and arguments["label_smoothing"] == 0.0
        and arguments["reduction"] in ("mean", "sum", "none")
        and isinstance(arguments["ignore_index"], int)
        and not isinstance(arguments["ignore_index"], bool)
    )


# ATen's cross_entropy_loss(self, target, weight, reduction, ignore_index, label_smoothing) and
# nll_loss_nd / nll_loss(self, target, weight, reduction, ignore_index): the reduction as an enum
# (torch's _Reduction), the legacy size_average/reduce already folded into it.
_ATEN_CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default
_ATEN_PARAMETERS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_ATEN_NLL_LOSSES = (torch.ops.aten.nll_loss_nd.default, torch.ops.aten.nll_loss.default)
_ATEN_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
# F.nll_loss's parameters, in order: F.cross_entropy's but label_smoothing.
_NLL_PARAMETERS = CROSS_ENTROPY_PARAMETERS[:-1]


def _aten_arguments(node: torch.fx.Node, parameters: tuple[str, ...]) -> dict[str, Any] | None:
    if len(node.args) > len(parameters) or not set(node.kwargs) <= set(parameters):
        return None
    arguments = dict(zip(parameters, node.args, strict=False)) | dict(node.kwargs)
    reduction = _ATEN_REDUCTIONS.get(arguments.pop("reduction", 1))
    if reduction is None:
        return None
    return CROSS_ENTROPY_DEFAULTS | arguments | {"reduction": reduction}


def _torch_arguments(node: torch.fx.Node, parameters: tuple[str, ...]) -> dict[str, Any] | None:
    kwargs = {k: v for k, v in node.kwargs.items() if k != "grad_into_input"}
    if len(node.args) > len(parameters) or not set(kwargs) <= set(parameters):
        return None
    return CROSS_ENTROPY_DEFAULTS | dict(zip(parameters, node.args, strict=False)) | kwargs


def cross_entropy_call_arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """Every parameter of ``F.cross_entropy`` by name (defaults filled in) for a call of ATen's
    ``cross_entropy_loss`` (torch.export graphs), ``F.cross_entropy`` or amp_fx's
    ``fp32_cross_entropy`` (torch.fx graphs); None for any other node or arguments it cannot read.

    >>> graph = torch.fx.Graph()
    >>> x, t = graph.placeholder("x"), graph.placeholder("t")
    >>> call = graph.call_function(torch.ops.aten.cross_entropy_loss.default, (x, t, None, 2))
    >>> cross_entropy_call_arguments(call)["reduction"]
    'sum'
    """
    if node.op != "call_function":
        return None
    if node.target is _ATEN_CROSS_ENTROPY:
        return _aten_arguments(node, _ATEN_PARAMETERS)
    if node.target in (F.cross_entropy, fp32_cross_entropy):
        return _torch_arguments(node, CROSS_ENTROPY_PARAMETERS)
    return None


def nll_loss_call_arguments(node: torch.fx.Node) -> dict[str, Any] | None:
    """For a call of ``F.nll_loss`` (torch.fx graphs) or ATen's ``nll_loss_nd`` / ``nll_loss``
    (torch.export graphs), every parameter of ``F.cross_entropy`` by name: the cross-entropy it
    computes when its input is a ``log_softmax`` over the classes (no label smoothing). None for
    any other node or arguments it cannot read.

    >>> graph = torch.fx.Graph()
    >>> x, t = graph.placeholder("x"), graph.placeholder("t")
    >>> call = graph.call_function(F.nll_loss, (x, t), {"ignore_index": -1})
    >>> arguments = nll_loss_call_arguments(call)
    >>> arguments["ignore_index"], arguments["reduction"], arguments["label_smoothing"]
    (-1, 'mean', 0.0)
    """
    if node.op != "call_function":
        return None
    if node.target in _ATEN_NLL_LOSSES:
        return _aten_arguments(node, _ATEN_PARAMETERS[:-1])
    if node.target is F.nll_loss:
        return _torch_arguments(node, _NLL_PARAMETERS)
    return None


def log_softmax_dim(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    """The dim of a log_softmax call (``F.log_softmax``, ``x.log_softmax``, ATen's, or a plain
    ``nn.LogSoftmax``) in its input's dtype (no ``dtype`` argument); None otherwise.

    >>> gm = torch.fx.symbolic_trace(lambda x: F.log_softmax(x, dim=1))
    >>> log_softmax_dim(gm, list(gm.graph.nodes)[1])
    1
    """
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        plain = type(module).forward is nn.LogSoftmax.forward and not has_forward_hooks(module)
        return module.dim if plain and len(node.args) == 1 and not node.kwargs else None
    names = (
        ("input", "dim", "_stacklevel", "dtype")
        if node.target is F.log_softmax
        else ("input", "dim", "dtype")
    )
    if len(node.args) > len(names) or not set(node.kwargs) <= set(names[1:]):
        return None
    arguments = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    return arguments.get("dim") if arguments.get("dtype") is None else None


# Ops that keep their input's rank: a rank is read through them (amp_fx's casts record no value).
_SAME_RANK_OPS = frozenset({"to", "contiguous", "alias"})
_VIEW_OPS = frozenset({"view", "reshape"})


def _rank(node: Any) -> int | None:
    """The rank of ``node``'s value: recorded (torch.export graphs), else that of a 2-entry
    ``view``/``reshape`` it is (through casts); None when unknown."""
    while isinstance(node, torch.fx.Node):
        value = tensor_value(node)
        if value is not None:
            return value.dim()
        op = node_info(node).op
        if op in _VIEW_OPS:
            shape = list(node.args[1:]) or list(node.kwargs.get("shape", node.kwargs.get("size", ())))
            if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
                shape = list(shape[0])
            return len(shape) or None
        if op not in _SAME_RANK_OPS or not node.args:
            return None
        node = node.args[0]
    return None


def log_softmax_over_classes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` is a log_softmax (`log_softmax_dim`) over the dimension cross-entropy
    takes as the classes: dim 1 of an input of rank 2 or more (-1 or 1 where the rank is 2).
    An ``nll_loss`` of it is then a cross-entropy of its input.

    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> gm = torch.fx.symbolic_trace(lambda x: F.log_softmax(x.view(-1, 7), dim=-1))
    >>> gm = normalize_ops(gm).graph_module
    >>> log_softmax_over_classes(gm, list(gm.graph.nodes)[2])
    True
    """
    dim = log_softmax_dim(gm, node)
    if not isinstance(dim, int) or isinstance(dim, bool) or not node.args:
        return False
    rank = _rank(node.args[0])
    if dim == 1:
        return rank is not None and rank >= 2
    return rank == 2 and dim == -1


def is_last_size_of(value: object, chain: set[torch.fx.Node]) -> bool:
    """``x.size(-1)``, ``x.shape[-1]`` or ``x.size()[-1]`` of a node of ``chain`` (torch.fx spellings of
    the last size, as a loss's ``view(-1, V)`` writes V)."""
    if not isinstance(value, torch.fx.Node):
        return False
    if value.op == "call_method" and value.target == "size":
        return value.args[0] in chain and (list(value.args[1:]) == [-1] or value.kwargs == {"dim": -1})
    if value.op == "call_function" and value.target is operator.getitem and list(value.args[1:]) == [-1]:
        shape = value.args[0]
        return (
            isinstance(shape, torch.fx.Node)
            and shape.args[:1]
            and shape.args[0] in chain
            and (
                (
                    shape.op == "call_function"
                    and shape.target is getattr
                    and list(shape.args[1:]) == ["shape"]
                )
                or (
                    shape.op == "call_method"
                    and shape.target == "size"
                    and len(shape.args) == 1
                    and not shape.kwargs
                )
            )
        )
    return False
