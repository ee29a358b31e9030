"""RMSNorm and LayerNorm as graphs spell them, found by what they compute: `match_norm_chain`.

One description serves both front ends: nodes are matched by their canonical op
(``node_info(node).op``, set by `normalize_ops`), so ``x.pow(2)``, ``torch.pow(x, 2)``, ``x ** 2``
and ``aten.pow.Tensor_Scalar`` are all ``pow``. An RMSNorm is (from the squares to ``x * that``
a pattern of `amp_fx.passes.shared.op_patterns`; around it, casts and parameters walked to)::

    x -> [cast up to fp32] -> pow(2) | x * x | square -> mean(-1, keepdim=True) -> + eps
      -> rsqrt | 1 / sqrt | pow(-0.5) -> x * that (or x / sqrt)
      -> [cast to the input's dtype] -> [w * y | y * w | (w + c) * y] -> [cast]

where the two reads of x are x itself or its cast up to fp32 (T5 multiplies the uncast x). A
LayerNorm is one call (``nn.LayerNorm``, ``F.layer_norm``, ``aten.layer_norm``,
``aten.native_layer_norm``) on fp32 input with fp32 parameters, and so is an RMSNorm over the last
dimension (``nn.RMSNorm``, ``F.rms_norm``, ``aten.rms_norm``, which torch.export keeps; without an
eps, float32's epsilon, as aten takes for fp32 input; decomposed, it is the chain above). A
LayerNorm written out is the chain above on ``x - mean(x, -1, keepdim=True)`` (both reads; one
subtraction or two), in fp32, then ``* w`` and ``+ b`` (each optional; fp32 parameters of the
normalized width, which must be known) and a cast. Before any of them, a residual add ``a + b``
whose sum is the normalized value is fused in when it is a plain two-tensor add; after it, casts
of the output to one low dtype (amp_fx's, before the next matmuls), also through reshapes, are
taken in so the output is written low once.

A chain matches exactly or not at all: every node it replaces must have no reader outside it
(the values it hands on, the sum and the output, excepted), every dtype must be known, and the
dtypes must say the chain computes in fp32 (so the fused kernel computes the same values).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.node_info import node_info
from amp_fx.kernels.arguments import KERNEL_DTYPES
from amp_fx.passes.shared.call_nodes import call_argument, is_inplace_call
from amp_fx.passes.shared.cast_walk import (
    attribute_under_casts,
    cast_target,
    is_dtype_cast,
    known_dtype,
    output_readers,
    under_casts,
)
from amp_fx.passes.shared.dtypes import ASSUMED_DTYPE_NOTE, UNKNOWN_INPUT_DTYPE_NOTE
from amp_fx.passes.shared.op_patterns import (
    AnyOf,
    Const,
    Num,
    Op,
    Var,
    is_last_dim,
    is_number,
    match,
    only_user,
    read_only_inside,
    tensor_value,
    updates_only_its_own,
)

__all__ = ["NormChain", "match_norm_chain"]


@dataclass
class NormChain:
    """What one fused call replaces and computes (the arguments of `amp_fx.ops.norms`' functions)."""

    subtract_mean: bool  # LayerNorm
    x: torch.fx.Node  # the value normalized (or the add's first operand)
    eps: float
    residual: torch.fx.Node | None = None  # the add's second operand
    # Nodes, or the qualified names of a norm module's parameters (read with get_attr on rewrite).
    weight: torch.fx.Node | str | None = None
    bias: torch.fx.Node | str | None = None
    normalized_shape: tuple[int, ...] | None = None  # LayerNorm
    weight_offset: float = 0.0
    mid_dtype: torch.dtype | None = None  # the cast between normalization and weight
    out_dtype: torch.dtype | None = None  # what the fused call writes
    sum_node: torch.fx.Node | None = None  # readers of this get the fused sum
    output: torch.fx.Node | None = None  # readers of this get the fused output
    # Casts of the output to out_dtype (each replaced by what it reads) and the reshapes between
    # (kept, now reshaping a tensor of out_dtype).
    output_casts: list[torch.fx.Node] = field(default_factory=list)
    retyped: list[torch.fx.Node] = field(default_factory=list)
    replaced: list[torch.fx.Node] = field(default_factory=list)  # erased once rewired


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The node's dtype where known (`known_dtype`) and one the fused kernels take, else None. A value
    computed from a model input of assumed dtype is as recorded: it reaches a mean (which takes
    floating tensors only), and at O2 floating inputs are cast to the low dtype at the entry."""
    dtype = known_dtype(node)
    return dtype if dtype in KERNEL_DTYPES else None


def _operand_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """An operand's dtype for the fused norm and residual add: `_dtype`, or a floating model input's
    assumed one. The fused call reads its operands as they are (FP32 math) and sums them in their
    promoted dtype at run time, as the add did, so a raw input on the residual stream (no longer
    cast at the entry) need not have the dtype assumed for it; an optional input's (maybe None)
    is still unknown."""
    notes = set(node_info(node).notes)
    assumed = ASSUMED_DTYPE_NOTE in notes and UNKNOWN_INPUT_DTYPE_NOTE not in notes
    dtype = node_info(node).out_dtype if assumed else known_dtype(node)
    return dtype if dtype in KERNEL_DTYPES else None


def _up_to_fp32(cast: torch.fx.Node) -> bool:
    """A cast up to fp32, or to the dtype it reads (an identity cast), of a value of known dtype."""
    source = _dtype(cast.args[0]) if is_dtype_cast(cast) else None
    return source is not None and cast_target(cast) in (source, torch.float32)


def _is_parameter(node: object) -> bool:
    """A get_attr (a parameter), or a plain cast of one (``self.weight.float()``)."""
    value, _ = under_casts(node, lambda cast: is_dtype_cast(cast) and cast_target(cast) is not None)
    return isinstance(value, torch.fx.Node) and value.op == "get_attr"


def _kernel_cast(node: torch.fx.Node | None) -> torch.dtype | None:
    """The dtype a plain cast ``node`` converts to, where the fused kernels write it; else None."""
    target = cast_target(node) if node is not None and node_info(node).op == "to" else None
    return target if target in KERNEL_DTYPES else None


def _other(node: torch.fx.Node, one: object) -> object:
    """The operand of a binary ``node`` that is not ``one`` (None when both or neither are)."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if (a is one) == (b is one):
        return None
    return b if a is one else a


class _Chain:
    """The nodes of one candidate chain, and the checks that they belong to it alone."""

    def __init__(self, nodes: list[torch.fx.Node] | None = None) -> None:
        self.nodes = list(nodes or [])

    def take(self, node: torch.fx.Node) -> torch.fx.Node:
        self.nodes.append(node)
        return node

    def closed(self, handed_on: tuple[torch.fx.Node | None, ...]) -> bool:
        """True when no node of the chain but those handed on has a reader outside it, and none
        updates in place a value something else reads (``x.pow_(2)`` changes what x's readers see;
        ``variance.add_(eps)`` on a variance read once does not)."""
        updates = [node for node in self.nodes if is_inplace_call(node)]
        return read_only_inside(self.nodes, handed_on) and all(map(updates_only_its_own, updates))


def _exponent(value: float) -> Callable[[torch.fx.Node], bool]:
    return lambda node: call_argument(node, 1, "exponent") == value


def _over_last_dim(mean: torch.fx.Node) -> bool:
    """A mean over the last dimension, keeping it, in the input's dtype."""
    dim, keepdim = call_argument(mean, 1, "dim"), call_argument(mean, 2, "keepdim", False)
    return call_argument(mean, 3, "dtype") is None and keepdim is True and is_last_dim(mean, dim)


_SQUARED = Var("squared")
_SQUARES = AnyOf(
    (Op("pow", (_SQUARED,), where=_exponent(2)), Op("mul", (_SQUARED, _SQUARED)), Op("square", (_SQUARED,)))
)
_VARIANCE = Op("add", (Op("mean", (_SQUARES,), where=_over_last_dim), Num("eps")), commutative=True)
_ROOT = Op("sqrt", (_VARIANCE,))
_INVERSE_ROOT = AnyOf(
    (
        Op("rsqrt", (_VARIANCE,)),
        Op("pow", (_VARIANCE,), where=_exponent(-0.5)),
        Op("mul", (Op("reciprocal", (_ROOT,)), Const(1.0)), commutative=True),  # ATen's 1 / t
        Op("reciprocal", (_ROOT,)),
        Op("div", (Const(1.0), _ROOT)),
    )
)
# ``x * rsqrt(mean(x**2, -1, keepdim=True) + eps)`` as models write it (module docstring).
_NORMALIZATION = AnyOf(
    (Op("mul", (Var("scaled"), _INVERSE_ROOT), commutative=True), Op("div", (Var("scaled"), _ROOT)))
)


def _match_rms(normalize: torch.fx.Node, gm: torch.fx.GraphModule) -> NormChain | None:
    # In place, ``variance.add_(eps)`` computes what ``variance + eps`` does where nothing else
    # reads the variance; the chain's other readers are checked once it is whole (`_finish`).
    found = match(_NORMALIZATION, normalize, gm, casts=None, in_place=True, closed=False)
    if found is None:
        return None
    position = {node: index for index, node in enumerate(gm.graph.nodes)}
    chain = _Chain(sorted(found.nodes, key=position.__getitem__))  # a path: the squares to normalize
    squared, scaled, eps = found.inputs["squared"], found.inputs["scaled"], float(found.numbers["eps"])
    mean = next(node for node in chain.nodes if node_info(node).op == "mean")
    if not all(_dtype(node) == torch.float32 for node in (mean, squared, normalize)):
        return None
    centered = _centered(squared, scaled)
    if centered is not None:  # both reads are x - mean(x): a LayerNorm written out
        norm = _match_written_layer_norm(centered, normalize, eps, _Chain(chain.nodes), gm)
        if norm is not None:
            return norm
    value, casts = under_casts(squared, _up_to_fp32)
    scaled_value, scaled_casts = under_casts(scaled, _up_to_fp32)
    if value is not scaled_value:
        return None
    norm = NormChain(subtract_mean=False, x=value, eps=eps)
    node = _rms_tail(normalize, norm, chain)
    if node is None:
        return None
    return _finish(norm, node, chain, [*casts, *scaled_casts])


def _centered(
    squared: torch.fx.Node, scaled: torch.fx.Node
) -> tuple[torch.fx.Node, list[torch.fx.Node], list[torch.fx.Node]] | None:
    """(x, the mean and subtractions, the casts up to fp32 they read) when the squared value and
    the scaled one are both ``x - mean(x, -1, keepdim=True)`` of the same x (one subtraction read
    twice, or one for each); else None."""
    subtractions = list(dict.fromkeys((squared, scaled)))
    centers, reads = set(), []
    for sub in subtractions:
        if node_info(sub).op != "sub" or is_inplace_call(sub):
            return None
        if len(sub.args) != 2 or sub.kwargs or not all(isinstance(a, torch.fx.Node) for a in sub.args):
            return None
        reads.append(sub.args[0])
        centers.add(sub.args[1])
    if len(centers) != 1:
        return None
    (center,) = centers
    if node_info(center).op != "mean" or not center.args or not _over_last_dim(center):
        return None
    if _dtype(center) != torch.float32:
        return None
    reads.append(center.args[0])
    if not all(isinstance(r, torch.fx.Node) and _dtype(r) == torch.float32 for r in reads):
        return None
    stripped = [under_casts(r, _up_to_fp32) for r in reads]
    if len({value for value, _ in stripped}) != 1:
        return None
    casts = [cast for _, found in stripped for cast in found]
    return stripped[0][0], [center, *subtractions], casts


def _shape(node: object, gm: torch.fx.GraphModule) -> tuple[int, ...] | None:
    """The shape of a node's value: recorded (``meta["val"]``), or that of the parameter a
    get_attr (through casts) reads; None when unknown."""
    value = tensor_value(node)
    if value is None:
        value = attribute_under_casts(node, gm)
    return tuple(value.shape) if value is not None else None


def _affine_parameter(node: torch.fx.Node | None, op: str, previous: torch.fx.Node) -> torch.fx.Node | None:
    """The fp32 parameter that ``node`` (a ``mul`` or ``add`` reading ``previous``) applies, in
    float32, or None."""
    if node is None or node_info(node).op != op or node.op not in ("call_function", "call_method"):
        return None
    parameter = _other(node, previous)
    if not _is_parameter(parameter) or _dtype(parameter) != torch.float32 or _dtype(node) != torch.float32:
        return None
    return parameter


def _match_written_layer_norm(
    centered: tuple[torch.fx.Node, list[torch.fx.Node], list[torch.fx.Node]],
    normalize: torch.fx.Node,
    eps: float,
    chain: _Chain,
    gm: torch.fx.GraphModule,
) -> NormChain | None:
    """A LayerNorm written out in fp32 (``(x - mu) * rsqrt(mean((x - mu)**2) + eps)``, then
    ``* w`` and ``+ b``, each optional, and a cast): the call `layer_norm_fp32` makes. Matched only
    where weight and bias are fp32 parameters of the normalized width, which is known."""
    x, centering, casts = centered
    for node in centering:
        chain.take(node)
    norm = NormChain(subtract_mean=True, x=x, eps=eps)
    node, user = normalize, only_user(normalize)
    if _kernel_cast(user) == torch.float32:
        node, user = chain.take(user), only_user(user)  # an identity cast (``.to(input_dtype)``)
    weight = _affine_parameter(user, "mul", node)
    if weight is not None:
        norm.weight, node = weight, chain.take(user)
        user = only_user(node)
    bias = _affine_parameter(user, "add", node)
    if bias is not None:
        norm.bias, node = bias, chain.take(user)
        user = only_user(node)
    norm.out_dtype = torch.float32
    if _kernel_cast(user) is not None:
        node, norm.out_dtype = chain.take(user), _kernel_cast(user)
    # The width: x's last dimension where recorded, else the parameters'; a parameter of any
    # other shape (per-head weights over a head dimension) broadcasts otherwise than the kernel's.
    x_shape = _shape(x, gm)
    widths = {x_shape[-1:]} if x_shape else set()
    widths |= {_shape(p, gm) for p in (norm.weight, norm.bias) if p is not None}
    if len(widths) != 1 or None in widths:
        return None
    (width,) = widths
    if len(width) != 1:
        return None
    norm.normalized_shape = width
    return _finish(norm, node, chain, casts)


def _rms_tail(node: torch.fx.Node, norm: NormChain, chain: _Chain) -> torch.fx.Node | None:
    """The cast, weight and cast after the normalization; returns the chain's last node."""
    product = torch.float32
    user = only_user(node)
    if _kernel_cast(user) is not None:
        product = _kernel_cast(user)
        norm.mid_dtype = None if product == torch.float32 else product
        node = chain.take(user)
        for argument in (*user.args[1:], *user.kwargs.values()):  # ``x.to(other.dtype)``
            if isinstance(argument, torch.fx.Node) and only_user(argument) is user:
                chain.take(argument)
        user = only_user(node)
    if user is not None and node_info(user).op == "mul":
        weight = _other(user, node)
        offset = None
        if isinstance(weight, torch.fx.Node) and node_info(weight).op == "add" and only_user(weight) is user:
            for candidate in weight.args:
                constant = _other(weight, candidate)
                if _is_parameter(candidate) and is_number(constant):
                    offset = (candidate, float(constant))
        if offset is not None:
            chain.take(weight)
            weight, norm.weight_offset = offset
        if _is_parameter(weight) and _dtype(weight) is not None:
            norm.weight = weight
            product = torch.promote_types(_dtype(weight), product)
            if _dtype(user) not in (None, product):
                return None
            node = chain.take(user)
            user = only_user(node)
        elif offset is not None:
            return None
    if _kernel_cast(user) is not None:
        node, product = chain.take(user), _kernel_cast(user)
    norm.out_dtype = product
    return node


class _CallForm(NamedTuple):
    """A norm computed by one call: its torch module, the module's parameters, and the function's
    eps (its position, and its value when the call gives none)."""

    subtract_mean: bool
    module: type[torch.nn.Module] | None
    parameters: tuple[str, ...]
    eps_position: int
    default_eps: float


# aten's rms_norm without an eps takes the epsilon of its math type: float32's for fp16, bf16 and
# fp32 input, not the input dtype's (nn.RMSNorm's docstring says ``torch.finfo(x.dtype).eps``; the
# code, torch 2.4 to 2.14, uses the opmath type's). The call is matched on fp32 input only.
_RMS_NORM_DEFAULT_EPS = torch.finfo(torch.float32).eps
_LAYER_NORM = _CallForm(True, torch.nn.LayerNorm, ("weight", "bias"), 4, 1e-5)
_CALL_FORMS = {
    "layer_norm": _LAYER_NORM,
    "native_layer_norm": _LAYER_NORM,
    "rms_norm": _CallForm(False, getattr(torch.nn, "RMSNorm", None), ("weight",), 3, _RMS_NORM_DEFAULT_EPS),
}


def _norm_call(node: torch.fx.Node, gm: torch.fx.GraphModule, form: _CallForm) -> NormChain | None:
    """The arguments of a LayerNorm or RMSNorm call with fp32 parameters (or none), or None. An
    RMSNorm must normalize over the last dimension only (what the kernels compute)."""
    from amp_fx.ops.module_hooks import has_forward_hooks

    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if form.module is None or type(module).forward is not form.module.forward:
            return None
        if has_forward_hooks(module) or len(node.args) != 1 or node.kwargs:
            return None
        x, shape, eps = node.args[0], tuple(module.normalized_shape), module.eps
        found = {name: getattr(module, name) for name in form.parameters}
        fp32 = all(p is None or p.dtype == torch.float32 for p in found.values())
        parameters = {name: None if p is None else f"{node.target}.{name}" for name, p in found.items()}
    elif node.op == "call_function":
        x, shape = call_argument(node, 0, "input"), call_argument(node, 1, "normalized_shape")
        parameters = {name: call_argument(node, 2 + i, name) for i, name in enumerate(form.parameters)}
        eps = call_argument(node, form.eps_position, "eps")
        fp32 = all(
            p is None or (_is_parameter(p) and _dtype(p) == torch.float32) for p in parameters.values()
        ) and all(d in (torch.float32, None) for d in node_info(node).in_dtypes)
    else:
        return None
    eps = form.default_eps if eps is None else eps
    if not fp32 or not is_number(eps) or not isinstance(shape, (list, tuple)):
        return None
    if not all(is_number(s) for s in shape) or (not form.subtract_mean and len(shape) != 1):
        return None
    norm = NormChain(form.subtract_mean, x, float(eps), **parameters)
    if form.subtract_mean:
        norm.normalized_shape = tuple(shape)
    return norm


def _match_norm_call(node: torch.fx.Node, gm: torch.fx.GraphModule, form: _CallForm) -> NormChain | None:
    norm = _norm_call(node, gm, form)
    if norm is None or not isinstance(norm.x, torch.fx.Node) or _operand_dtype(norm.x) != torch.float32:
        return None
    chain, last = _Chain([node]), node
    if node_info(node).op == "native_layer_norm":  # (out, mean, rstd): only out may be read
        last = only_user(node)
        if last is None or last.target is not operator.getitem or last.args[1] != 0:
            return None
        chain.take(last)
    if _dtype(last) != torch.float32:
        return None
    norm.out_dtype = torch.float32
    user = only_user(last)
    if _kernel_cast(user) is not None:
        last, norm.out_dtype = chain.take(user), _kernel_cast(user)
    norm.x, casts = under_casts(norm.x, _up_to_fp32)
    return _finish(norm, last, chain, casts)


def _take_output_casts(norm: NormChain, last: torch.fx.Node, chain: _Chain) -> None:
    """Write the output low when every reader (through reshapes, which then reshape the low
    output) casts it to one low dtype."""
    readers = output_readers(last)
    casts = readers.ends
    targets = {cast_target(cast) if node_info(cast).op == "to" else None for cast in casts}
    if len(targets) != 1:
        return
    (low,) = targets
    if low not in LOW_PRECISION_DTYPES or norm.out_dtype not in (torch.float32, low):
        return
    norm.out_dtype, norm.output_casts, norm.retyped = low, list(casts), list(readers.reshapes)
    for cast in casts:
        chain.take(cast)


def _residual_add(norm: NormChain, chain: _Chain) -> None:
    """Fuse the add whose sum is the normalized value into the chain. A cast of the sum that
    stays (something else reads it) then reads the fused sum."""
    add = norm.x
    if node_info(add).op != "add" or add.op != "call_function" or is_inplace_call(add):
        return
    if len(add.args) != 2 or add.kwargs or add.args[0] is add.args[1]:
        return
    a, b = add.args
    if not all(isinstance(v, torch.fx.Node) and _operand_dtype(v) is not None for v in (a, b)):
        return
    if _dtype(add) != torch.promote_types(_operand_dtype(a), _operand_dtype(b)):
        return
    norm.x, norm.residual, norm.sum_node = a, b, chain.take(add)


def _finish(
    norm: NormChain, last: torch.fx.Node, chain: _Chain, input_casts: list[torch.fx.Node]
) -> NormChain | None:
    # The casts up to fp32 of the input are replaced when nothing else reads them.
    for cast in dict.fromkeys(input_casts):
        if set(cast.users) <= set(chain.nodes) | set(input_casts):
            chain.take(cast)
    norm.output = last
    _take_output_casts(norm, last, chain)
    if _operand_dtype(norm.x) is None:
        return None
    _residual_add(norm, chain)
    if not chain.closed((norm.sum_node, last, *norm.retyped, *norm.output_casts)):
        return None
    norm.replaced = chain.nodes
    return norm


def match_norm_chain(node: torch.fx.Node, gm: torch.fx.GraphModule) -> NormChain | None:
    """The norm chain whose normalization ``node`` is (an RMSNorm's ``x * rsqrt(...)``, a
    LayerNorm call), or None when the graph around it is not exactly one (module docstring).

    >>> from amp_fx.core.node_info import NodeInfo
    >>> from amp_fx.capture.fx import trace
    >>> gm = trace(torch.nn.Sequential(torch.nn.LayerNorm(4)))  # x -> LayerNorm module
    >>> x, norm = list(gm.graph.nodes)[:2]
    >>> x.meta["amp_fx"] = NodeInfo(out_dtype=torch.float32)  # as the passes before record it
    >>> norm.meta["amp_fx"] = NodeInfo(op="layer_norm", in_dtypes=(torch.float32,), out_dtype=torch.float32)
    >>> chain = match_norm_chain(norm, gm)
    >>> chain.normalized_shape, chain.weight, chain.out_dtype
    ((4,), '0.weight', torch.float32)
    """
    op = node_info(node).op
    if op in ("mul", "div"):
        return _match_rms(node, gm)
    if op in _CALL_FORMS:
        return _match_norm_call(node, gm, _CALL_FORMS[op])
    return None
