"""A linear head and the cross-entropy of its logits, as graphs spell them: `match_linear_loss`, the
one description that `fuse_linear_loss` and `fuse_chunked_linear_loss` both fuse.

Nodes are matched by their canonical op (``node_info(node).op``, set by `normalize_ops`), so one
description serves torch.fx graphs and the torch.export front end's ATen graphs::

    logits = linear(h, W[, b])           a plain nn.Linear (no hooks), F.linear, aten.linear
    x      = to(float32) | view | reshape | flatten | contiguous | alias     (a chain, any order)
             | x * c | c * x | x / c         c a power of two <= 1 (1.0 included): a logit scale
             | (x / c | x * (1/c)), tanh, * c   a softcap c (a positive number, the same twice;
                                                casts of any float dtype between): once, after
                                                any logit scale
    loss   = cross_entropy_loss(x, target, ...)        F.cross_entropy, fp32_cross_entropy (after
                                                       fuse_losses), aten.cross_entropy_loss
           | nll_loss(log_softmax(x, classes), target, ...)   the same loss written out: F.nll_loss,
                                                       aten.nll_loss_nd; the log_softmax over the
                                                       last dimension, anywhere in the chain

It matches where the fused ops compute exactly what the graph does:

- The loss reads 2-D logits, rows of the head's V classes. A view makes them: ``view``/``reshape``
  to ``(-1, V)`` (V a number, or ``x.size(-1)`` / ``x.shape[-1]`` of the chain) or
  ``flatten(0, -2)``; or the capture recorded the values' shapes (``meta["val"]``: the torch.export
  front end) and they show it: a reshape keeping V classes last, or none at all. A torch.fx graph
  records no shapes, so there a loss of the head's output without a view is left alone: its rank,
  and so the dimension of its classes, is not known.
- The loss (for ``nll_loss``, its log_softmax) computes in float32: it reads float32 values (a
  widening cast in the chain, or a float32 head), or it is ``fp32_cross_entropy``.
- Its arguments are ones the fused kernels compute (`is_fusable_loss`): no class weights, no label
  smoothing, a mean, sum or no reduction, an int ignore_index.
- A logit scale is a Python number whose product over the chain is a power of two, at most 1
  (`LinearLoss.scale`): the fused call reads ``h * scale`` and ``b * scale``
  (`amp_fx.passes.shared.linear_loss_calls.head_arguments`), whose rounding to fp16/bf16 scales
  exactly as the logits' would (barring subnormals), so its logits are the graph's. Any other
  scale (one that rounds, one above 1, which could overflow fp16 hidden states the graph never
  scales, a tensor, or one of the log-probabilities) is left alone.
- A softcap ("final logit softcapping": ``c * tanh(x / c)``) is recorded as `LinearLoss.softcap`:
  a fused op computes it in float32 (`chunked_linear_cross_entropy`'s ``softcap``), where the graph
  rounds after each of its three steps, so it fuses only where a pass takes that; a tanh without
  those scales, or two different constants, is no softcap and no match.
- The head's logits, their casts and views are read by nothing but the chain, size reads that only
  feed the chain's views, and the graph's output (`LinearLoss.returned`; whether a pass may drop
  returned logits is its own choice); log-probabilities only by the chain and the loss.

>>> import amp_fx
>>> from amp_fx.core.policy import preset
>>> class Head(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.head = nn.Linear(4, 6)
...     def forward(self, h, t):
...         return F.cross_entropy(self.head(h).view(-1, 6), t)
>>> policy = preset("O2", torch.bfloat16, fused_losses=False)  # converted, left unfused
>>> gm = amp_fx.convert(Head(), "O2", policy=policy)
>>> *_, loss, output = gm.graph.nodes
>>> found = match_linear_loss(gm, loss, output)
>>> found.head_name, [n.name for n in found.removed], found.returned
('head', ['head', 'view', 'view_to_float32'], False)
"""

from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.core.op_facts import METADATA_ATTRIBUTES, RESHAPE_OPS, SHAPE_METHODS
from amp_fx.ops.cross_entropy import fp32_cross_entropy
from amp_fx.ops.module_hooks import has_forward_hooks
from amp_fx.passes.shared.call_nodes import call_argument
from amp_fx.passes.shared.cast_walk import attribute_under_casts, is_dtype_cast
from amp_fx.passes.shared.dtypes import is_exact_widening
from amp_fx.passes.shared.losses import (
    cross_entropy_call_arguments,
    is_fusable_loss,
    is_last_size_of,
    log_softmax_dim,
    nll_loss_call_arguments,
)
from amp_fx.passes.shared.module_regions import module_paths
from amp_fx.passes.shared.op_patterns import AnyOf, Match, Num, Op, Pattern, Var, match, tensor_value

__all__ = ["LinearLoss", "linear_call_arguments", "match_linear_loss"]

# Ops that pass the logits on unchanged in value and row order (a widening cast included).
_CHAIN_OPS = RESHAPE_OPS | {"alias", "to"}
# Ops that change neither values nor shape: a recorded shape is read through them (amp_fx's casts
# have none of their own).
_SAME_SHAPE_OPS = frozenset({"to", "contiguous", "alias"})
_METADATA_READS = SHAPE_METHODS | METADATA_ATTRIBUTES


@dataclass
class LinearLoss:
    """A matched head and loss: what a fused call takes and what it replaces."""

    loss: torch.fx.Node
    arguments: dict[str, Any]  # F.cross_entropy's parameters by name
    head: torch.fx.Node  # the linear call
    input: torch.fx.Node  # the head's input, (*, d)
    # Nodes, or the qualified names of a plain nn.Linear's parameters (read by the fused call's
    # `amp_fx.passes.shared.linear_loss_calls.head_arguments`).
    weight: torch.fx.Node | str
    bias: torch.fx.Node | str | None
    # The head, every cast, view and log_softmax of its logits and the size reads only they use,
    # in graph order: with the loss, what a fused call replaces.
    removed: list[torch.fx.Node]
    returned: bool  # the graph's output returns some of them
    scale: float = 1.0  # the logit scale of the chain: a power of two
    softcap: float | None = None  # the chain's c * tanh(x / c), applied after the scale

    @property
    def replaced_names(self) -> str:
        """The names of the nodes a fused call replaces, for its report note."""
        return ", ".join(node.name for node in [*self.removed, self.loss])

    @property
    def head_name(self) -> str:
        """The head as the user knows it: the module's qualified name, else the call's node name."""
        if self.head.op == "call_module":
            return str(self.head.target)
        paths = [path for path in module_paths(self.head) if path]
        return paths[-1] if paths else self.head.name


def linear_call_arguments(gm: torch.fx.GraphModule, linear: Any) -> tuple[Any, Any, Any, int | None] | None:
    """(input, weight, bias, number of classes or None) of a linear call (a head's, or any other's:
    `use_fp8_linears` reads it too); the weight and bias are nodes, or the qualified names of a
    plain nn.Linear's parameters; None for a call these passes cannot replace (a hooked module)."""
    if not isinstance(linear, torch.fx.Node) or node_info(linear).op != "linear":
        return None
    if linear.op == "call_module":
        module = gm.get_submodule(linear.target)
        if (
            not isinstance(module, nn.Linear)
            or type(module).forward is not nn.Linear.forward
            or has_forward_hooks(module)
            or len(linear.args) != 1
            or linear.kwargs
        ):
            return None
        bias = f"{linear.target}.bias" if module.bias is not None else None
        return linear.args[0], f"{linear.target}.weight", bias, module.out_features
    if linear.op != "call_function" or linear.target not in (F.linear, torch.ops.aten.linear.default):
        return None
    if len(linear.args) > 3 or not set(linear.kwargs) <= {"input", "weight", "bias"}:
        return None
    input, weight = call_argument(linear, 0, "input"), call_argument(linear, 1, "weight")
    bias = call_argument(linear, 2, "bias")
    if not all(isinstance(n, torch.fx.Node) for n in (input, weight)):
        return None
    if bias is not None and not isinstance(bias, torch.fx.Node):
        return None
    return input, weight, bias, _classes_of(gm, weight)


def _classes_of(gm: torch.fx.GraphModule, weight: torch.fx.Node) -> int | None:
    """The first dimension of the head's weight: from the captured value, else from the parameter
    that the weight node reads, through casts; None when unknown."""
    value = tensor_value(weight)
    if value is None or value.dim() != 2:
        value = attribute_under_casts(weight, gm)
    return int(value.shape[0]) if value is not None and value.dim() == 2 else None


def _recorded_shape(node: torch.fx.Node) -> tuple[Any, ...] | None:
    """The shape the capture recorded for ``node``'s value, read through the casts the passes
    inserted (which have none); None in graphs without shapes."""
    while (value := tensor_value(node)) is None:
        if node_info(node).op not in _SAME_SHAPE_OPS or not node.args:
            return None
        if not isinstance(node.args[0], torch.fx.Node):
            return None
        node = node.args[0]
    return tuple(value.shape)


def _is_rows(shape: tuple[Any, ...] | None, num_classes: int | None) -> bool:
    """``shape`` is (rows, V): 2-D with the head's classes last."""
    return (
        shape is not None
        and num_classes is not None
        and len(shape) == 2
        and isinstance(shape[1], int)
        and shape[1] == num_classes
    )


def _classes_last(shape: tuple[Any, ...] | None, num_classes: int | None) -> bool:
    return bool(shape) and num_classes is not None and isinstance(shape[-1], int) and shape[-1] == num_classes


def _is_row_view(node: torch.fx.Node, chain: set[torch.fx.Node], num_classes: int | None) -> bool:
    """A view or reshape to ``(-1, V)``, or ``flatten(0, -2)``: rows of V classes, whatever the
    input's rank."""
    if node_info(node).op == "flatten":
        start, end = call_argument(node, 1, "start_dim", 0), call_argument(node, 2, "end_dim", -1)
        return start == 0 and end == -2
    shape = list(node.args[1:]) or list(node.kwargs.get("shape", node.kwargs.get("size", ())))
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = list(shape[0])
    if len(shape) != 2 or shape[0] != -1:
        return False
    return (num_classes is not None and shape[1] == num_classes) or is_last_size_of(shape[1], chain)


def _over_classes(gm: torch.fx.GraphModule, node: torch.fx.Node, rows: bool, num_classes: int | None) -> bool:
    """A log_softmax over the last dimension (the classes) of its input."""
    dim = log_softmax_dim(gm, node)
    if not isinstance(dim, int) or isinstance(dim, bool):
        return False
    shape = _recorded_shape(node.args[0])
    return (
        dim == -1
        or (rows and dim == 1)
        or (_classes_last(shape, num_classes) and shape is not None and dim == len(shape) - 1)
    )


def _hands_on_rows(
    gm: torch.fx.GraphModule,
    head: torch.fx.Node,
    path: list[torch.fx.Node],
    num_classes: int | None,
    softcap_steps: frozenset[torch.fx.Node] = frozenset(),
) -> bool:
    """Whether every step from the head keeps its rows of classes, and the last hands the loss
    2-D rows of V classes. ``softcap_steps`` (elementwise, `_softcap_ending_at` checked them) are
    taken as they are."""
    rows = _is_rows(_recorded_shape(head), num_classes)
    seen = {head}
    for step in path:
        op = node_info(step).op
        if (op in ("mul", "div") or step in softcap_steps) and any(
            node_info(s).op == "log_softmax" for s in seen
        ):
            return False  # a scale or cap of log-probabilities, not of the logits
        if step in softcap_steps:
            pass
        elif op == "to":
            if not _keeps_values_in_float32(step):
                return False
        elif op in ("contiguous", "alias"):
            if len(step.args) != 1 or step.kwargs:
                return False
        elif op in ("mul", "div"):  # a logit scale (`_chain_to_head` took no other): shape kept
            if node_info(step).out_dtype != node_info(_logits_read(step)).out_dtype:
                return False
        elif op == "log_softmax":
            if not _over_classes(gm, step, rows, num_classes):
                return False
        elif _is_row_view(step, seen, num_classes):
            rows = True
        else:
            # Any other reshape keeps the rows where V stays last (the flat order is kept).
            before, after = _recorded_shape(step.args[0]), _recorded_shape(step)
            if not (_classes_last(before, num_classes) and _classes_last(after, num_classes)):
                return False
            rows = _is_rows(after, num_classes)
        seen.add(step)
    return rows


def _keeps_values_in_float32(cast: torch.fx.Node) -> bool:
    """Whether a cast makes float32 of what it reads and changes no value: it reads float32, or a
    dtype float32 holds exactly (fp16, bf16)."""
    if node_info(cast).out_dtype != torch.float32:
        return False
    source = node_info(cast.args[0]).out_dtype
    return source == torch.float32 or (source is not None and is_exact_widening(source, torch.float32))


def _scaled(x: Pattern) -> Pattern:
    """``x * c``, ``c * x`` or ``x / c``, c a Python number (see `_factor`)."""
    return AnyOf((Op("mul", (x, Num("factor")), commutative=True), Op("div", (x, Num("divisor")))))


_LOGIT_SCALE = _scaled(Var("logits"))
# ``c * tanh(x / c)``, casts to float dtypes between its steps.
_SOFTCAP = Op("mul", (Op("tanh", (_scaled(Var("x")),)), Num("cap")), commutative=True)


def _factor(found: Match) -> float | None:
    """The factor a matched scale multiplies by (None for a division by 0)."""
    divisor = found.numbers.get("divisor")
    if divisor is None:
        return float(found.numbers["factor"])
    return 1.0 / divisor if divisor != 0 else None


def _scale_factor(gm: torch.fx.GraphModule, node: torch.fx.Node) -> float | None:
    """The factor of a logit-scale step when it is a power of two; else None."""
    found = match(_LOGIT_SCALE, node, gm, casts=None)
    factor = _factor(found) if found is not None else None
    return factor if factor is not None and _is_power_of_two(factor) else None


@dataclass
class _Softcap:
    """``c * tanh(x / c)`` in a graph: its constant, its steps (graph order) and its input x."""

    cap: float
    steps: list[torch.fx.Node]
    input: torch.fx.Node


def _is_float_cast(node: torch.fx.Node) -> bool:
    return is_dtype_cast(node) and _is_float(node_info(node).out_dtype)


def _is_float(dtype: Any) -> bool:
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _softcap_ending_at(gm: torch.fx.GraphModule, node: torch.fx.Node) -> _Softcap | None:
    """The softcap whose ``* c`` is ``node``, with the same positive c (up to the rounding of a
    ``1/c``), every step of a float dtype and read by the next alone; else None."""
    found = match(_SOFTCAP, node, gm, casts=_is_float_cast)
    if found is None or not 0 < found.numbers["cap"] < math.inf:
        return None
    cap, factor = float(found.numbers["cap"]), _factor(found)
    # x * (1/c) holds 1/c rounded to a float: equal to c's reciprocal up to that rounding.
    if factor is None or not math.isclose(factor * cap, 1.0, rel_tol=4 * sys.float_info.epsilon, abs_tol=0.0):
        return None
    position = {step: index for index, step in enumerate(node.graph.nodes)}
    steps = sorted(found.nodes, key=position.__getitem__)
    if not all(_is_float(node_info(step).out_dtype) for step in steps):
        return None
    return _Softcap(cap, steps, _logits_read(steps[0]))


def _is_power_of_two(factor: float) -> bool:
    """2**k for an integer k (positive, finite): multiplying by it rounds nothing."""
    return math.isfinite(factor) and factor > 0 and math.frexp(factor)[0] == 0.5


def _logits_read(node: torch.fx.Node) -> torch.fx.Node:
    """The operand of a chain step that carries the logits (a scale may read them second)."""
    if node_info(node).op == "mul" and not isinstance(node.args[0], torch.fx.Node):
        return node.args[1]
    return node.args[0]


def _chain_to_head(
    gm: torch.fx.GraphModule, value: Any
) -> tuple[torch.fx.Node, list[torch.fx.Node], tuple[Any, Any, Any, int | None], _Softcap | None] | None:
    """(the head, the nodes from it to ``value`` in order, the head's arguments, the softcap or
    None) when ``value`` is a chain of casts, views, scales, a softcap and log_softmax of a head's
    logits."""
    path: list[torch.fx.Node] = []
    node = value
    softcap = None
    while (arguments := linear_call_arguments(gm, node)) is None:
        if not isinstance(node, torch.fx.Node):
            return None
        if (found := _softcap_ending_at(gm, node)) is not None:
            if softcap is not None:
                return None  # two caps: not the one the fused op computes
            softcap = found
            path.extend(reversed(found.steps))
            node = found.input
            continue
        if _scale_factor(gm, node) is None and (
            node_info(node).op not in _CHAIN_OPS | {"log_softmax"}
            or not node.args
            or not isinstance(node.args[0], torch.fx.Node)
        ):
            return None
        path.append(node)
        node = _logits_read(node)
    path.reverse()
    return node, path, arguments, softcap


def _removed_nodes(
    head: torch.fx.Node, path: list[torch.fx.Node], loss: torch.fx.Node, output: torch.fx.Node
) -> tuple[list[torch.fx.Node], bool] | None:
    """The head, every cast or view of its logits and the size reads only they use (graph order),
    and whether the output returns any of them. None when anything else reads them."""
    log_softmax = [i for i, step in enumerate(path) if node_info(step).op == "log_softmax"]
    log_probs = set(path[log_softmax[0] :]) if log_softmax else set()
    values, reads, returned = [head], [], False
    pending = [head]
    while pending:
        node = pending.pop()
        for user in node.users:
            if user is loss or user in values or user in reads:
                continue
            if node_info(user).op in _METADATA_READS:
                reads.append(user)
            elif node in log_probs and user not in path:
                return None  # log-probabilities feed the loss alone
            elif user is output:
                returned = True
            elif user in path or (node_info(user).op in _CHAIN_OPS and user.args and user.args[0] is node):
                values.append(user)
                pending.append(user)
            else:
                return None
    removed = set(values) | set(reads) | {loss}
    # A size read may feed a view of the chain, or an item of itself ([-1]) that does; nothing else.
    for read in list(reads):
        for user in read.users:
            if user in removed:
                continue
            if user.op == "call_function" and user.target is operator.getitem and set(user.users) <= removed:
                reads.append(user)
                removed.add(user)
            else:
                return None
    order = {node: index for index, node in enumerate(head.graph.nodes)}
    return sorted([*values, *reads], key=order.__getitem__), returned


def _loss_arguments(loss: torch.fx.Node) -> tuple[dict[str, Any] | None, bool]:
    """F.cross_entropy's arguments of a cross-entropy or nll_loss call, and whether it is the
    nll_loss (which needs a log_softmax in the chain)."""
    op = node_info(loss).op
    if op == "cross_entropy_loss":
        return cross_entropy_call_arguments(loss), False
    if op == "nll_loss":
        return nll_loss_call_arguments(loss), True
    return None, False


def _computes_in_fp32(node: torch.fx.Node) -> bool:
    return node.target is fp32_cross_entropy or node_info(node).in_dtypes[:1] == (torch.float32,)


def match_linear_loss(
    gm: torch.fx.GraphModule, loss: torch.fx.Node, output: torch.fx.Node
) -> LinearLoss | None:
    """The head and its chain to ``loss`` when they are the pattern of the module docstring, else
    None. ``output`` is the graph's output node."""
    arguments, needs_log_softmax = _loss_arguments(loss)
    if arguments is None or not is_fusable_loss(arguments):
        return None
    found = _chain_to_head(gm, arguments["input"])
    if found is None or not isinstance(arguments["target"], torch.fx.Node):
        return None
    head, path, (input, weight, bias, num_classes), softcap = found
    softcap_steps = frozenset(softcap.steps if softcap is not None else ())
    log_softmaxes = [step for step in path if node_info(step).op == "log_softmax"]
    if len(log_softmaxes) != int(needs_log_softmax):
        return None
    if not _computes_in_fp32(log_softmaxes[0] if log_softmaxes else loss):
        return None
    if not _hands_on_rows(gm, head, path, num_classes, softcap_steps):
        return None
    removed = _removed_nodes(head, path, loss, output)
    if removed is None:
        return None
    nodes, returned = removed
    scales = [step for step in path if step not in softcap_steps and _scale_factor(gm, step) is not None]
    # The fused op scales the logits before the cap (it reads h * scale): none may follow it.
    if softcap is not None and any(path.index(step) > path.index(softcap.steps[-1]) for step in scales):
        return None
    scale = math.prod(_scale_factor(gm, step) for step in scales)
    # Scaling up could overflow the fp16 hidden states where the graph scales fp32 logits.
    if not _is_power_of_two(scale) or scale > 1.0:
        return None
    cap = None if softcap is None else softcap.cap
    return LinearLoss(loss, arguments, head, input, weight, bias, nodes, returned, scale, cap)
