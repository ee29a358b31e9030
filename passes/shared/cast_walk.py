"""Walking dtype casts, the one way every matcher does it: the dtype a cast converts to
(`cast_target`), the value under a chain of casts (`under_casts`) and where a value goes after
it, through reshapes to the casts that read it (`output_readers`).

A cast here is a node of canonical op ``to`` (``x.to(dtype)``, ``x.float()``, ``x.type_as(y)``,
aten's ``to``, amp_fx's own casts; see `normalize_ops`) whose first argument is a node; which
casts a walk goes through is the caller's predicate (amp_fx's only, `is_amp_fx_cast`; widenings
to float32; any to a floating dtype).

    >>> gm = torch.fx.symbolic_trace(lambda x: x.half().float().exp())
    >>> x, half, single, exp, _ = gm.graph.nodes
    >>> value, casts = under_casts(single, lambda cast: cast_target(cast) is not None)
    >>> value.name, [cast.name for cast in casts]
    ('x', ['float_1', 'half'])
"""

from __future__ import annotations

import builtins
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.core.op_facts import CONVERSION_METHOD_DTYPES, METADATA_ATTRIBUTES, RESHAPE_OPS, SHAPE_METHODS
from amp_fx.ops.casts import cast_if_floating
from amp_fx.passes.shared.call_nodes import is_inplace_call
from amp_fx.passes.shared.dtypes import ASSUMED_DTYPE_NOTE, UNKNOWN_INPUT_DTYPE_NOTE

__all__ = [
    "OutputReaders",
    "attribute_under_casts",
    "cast_target",
    "is_amp_fx_cast",
    "is_dtype_cast",
    "known_dtype",
    "output_readers",
    "under_casts",
]

# Arguments of aten's to.dtype / to.dtype_layout that leave a cast a plain dtype conversion.
_PLAIN_CAST_KEYWORDS = {"non_blocking": False, "copy": False, "memory_format": None, "pin_memory": None}
# Readers of a value's metadata (its shape, dtype, device), never of its values.
_METADATA_READS = SHAPE_METHODS | METADATA_ATTRIBUTES


def is_dtype_cast(node: Any) -> bool:
    """A node of canonical op ``to`` (a dtype or device conversion) of a node.

    >>> x, cast, _ = torch.fx.symbolic_trace(lambda x: x.float()).graph.nodes
    >>> is_dtype_cast(cast), is_dtype_cast(x)  # ops not named yet: see `normalize_ops`
    (False, False)
    """
    return (
        isinstance(node, torch.fx.Node)
        and node_info(node).op == "to"
        and bool(node.args)
        and isinstance(node.args[0], torch.fx.Node)
    )


def is_amp_fx_cast(node: Any) -> bool:
    """A cast amp_fx inserted (``node_info(node).is_cast``) of a node; a model's own casts are not.

    >>> x, cast, _ = torch.fx.symbolic_trace(lambda x: x.float()).graph.nodes
    >>> is_amp_fx_cast(cast)
    False
    """
    return (
        isinstance(node, torch.fx.Node)
        and node_info(node).is_cast
        and bool(node.args)
        and isinstance(node.args[0], torch.fx.Node)
    )


def under_casts(
    value: Any, through: Callable[[torch.fx.Node], bool] = is_dtype_cast
) -> tuple[Any, list[torch.fx.Node]]:
    """The value under the casts of it that pass ``through`` (each a call on a node first), and
    those casts, from ``value`` down.

    >>> gm = torch.fx.symbolic_trace(lambda x: x.float())
    >>> x, cast, _ = gm.graph.nodes
    >>> under_casts(cast, through=lambda node: node.target == "float")[0] is x
    True
    """
    casts = []
    while (
        isinstance(value, torch.fx.Node)
        and value.args
        and isinstance(value.args[0], torch.fx.Node)
        and through(value)
    ):
        casts.append(value)
        value = value.args[0]
    return value, casts


def known_dtype(node: Any) -> torch.dtype | None:
    """The dtype recorded for ``node`` (for a cast with none recorded, its target), or None where
    unknown or only assumed: a model input's without ``example_inputs``, or an optional input's. A
    value computed from such an input is taken as recorded.

    >>> from amp_fx.core.node_info import NodeInfo
    >>> x, cast, _ = torch.fx.symbolic_trace(lambda x: x.half()).graph.nodes
    >>> cast.meta["amp_fx"] = NodeInfo(op="to")  # as normalize_ops names it
    >>> known_dtype(x), known_dtype(cast)
    (None, torch.float16)
    """
    if not isinstance(node, torch.fx.Node):
        return None
    info = node_info(node)
    if {ASSUMED_DTYPE_NOTE, UNKNOWN_INPUT_DTYPE_NOTE} & set(info.notes):
        return None
    if info.out_dtype is None and info.op == "to":
        return cast_target(node)
    return info.out_dtype


def _dtype_argument(value: object) -> torch.dtype | None:
    """A dtype given as a constant, or as ``other.dtype`` (a getattr node) of a known dtype."""
    if isinstance(value, torch.dtype):
        return value
    if (
        isinstance(value, torch.fx.Node)
        and value.op == "call_function"
        and value.target is builtins.getattr
        and value.args[1:] == ("dtype",)
    ):
        return known_dtype(value.args[0])
    return None


def cast_target(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype a plain dtype cast converts to (``x.to(dtype)``, ``x.float()`` and the other
    conversion methods, ``x.type_as(y)``, ``x.to(y.dtype)``, amp_fx's casts, aten's ``to``), or None
    for anything else (a device move, a copy, a cast to a dtype not known).

    >>> gm = torch.fx.symbolic_trace(lambda x: x.to(torch.float16).float())
    >>> [cast_target(n) for n in gm.graph.nodes if n.op == "call_method"]
    [torch.float16, torch.float32]
    """
    if node_info(node).op not in (None, "to") or not node.args:
        return None
    target, rest, kwargs = node.target, node.args[1:], dict(node.kwargs)
    if node.op == "call_function" and target is cast_if_floating:
        return rest[0] if rest and isinstance(rest[0], torch.dtype) else None
    if node.op == "call_method":
        if target in CONVERSION_METHOD_DTYPES and not rest and not kwargs:
            return CONVERSION_METHOD_DTYPES[target]
        if target == "type_as" and len(rest) == 1 and not kwargs:
            return known_dtype(rest[0])
        if target == "to" and len(rest) + len(kwargs) == 1:
            return _dtype_argument(rest[0] if rest else kwargs.get("dtype"))
        return None
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._opname == "to":
        dtype = rest[0] if rest else kwargs.pop("dtype", None)
        if not isinstance(dtype, torch.dtype) or len(rest) > 1:
            return None
        if kwargs.pop("layout", torch.strided) != torch.strided:
            return None
        device = kwargs.pop("device", None)
        value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        value = value if isinstance(value, torch.Tensor) else None
        if device is not None and getattr(value, "device", None) != device:
            return None
        plain = all(_PLAIN_CAST_KEYWORDS.get(k, "other") in (v, None) or v is None for k, v in kwargs.items())
        return dtype if plain else None
    return None


def attribute_under_casts(node: Any, gm: torch.fx.GraphModule) -> torch.Tensor | None:
    """The tensor (a parameter, a buffer) that the get_attr under ``node``'s casts reads, or None.

    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    >>> weight = [n for n in gm.graph.nodes if n.op == "get_attr"][0]
    >>> attribute_under_casts(weight, gm).shape
    torch.Size([2, 3])
    """
    node, _ = under_casts(node)
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    try:
        attribute = operator.attrgetter(node.target)(gm)
    except AttributeError:
        return None
    return attribute if isinstance(attribute, torch.Tensor) else None


@dataclasses.dataclass(frozen=True)
class OutputReaders:
    """Where a value goes: through ``reshapes`` (views that read it first, and views of those;
    in the order the walk meets them) to ``ends``, every other reader of it or of them, beside
    ``metadata_reads`` (shape, dtype and device reads, of no value). ``one_path``: each reshape is
    the only reader of what it reads."""

    reshapes: tuple[torch.fx.Node, ...]
    ends: tuple[torch.fx.Node, ...]
    metadata_reads: tuple[torch.fx.Node, ...]
    one_path: bool


def output_readers(node: torch.fx.Node) -> OutputReaders:
    """How ``node``'s value leaves it: the casts a norm's or an activation's output goes through
    are the ``ends`` of this walk.

    >>> from amp_fx.passes.normalize_ops import normalize_ops
    >>> gm = normalize_ops(torch.fx.symbolic_trace(lambda x: x.exp().view(-1).half())).graph_module
    >>> readers = output_readers(list(gm.graph.nodes)[1])
    >>> [n.name for n in readers.reshapes], [n.name for n in readers.ends], readers.one_path
    (['view'], ['half'], True)
    """
    reshapes: list[torch.fx.Node] = []
    ends: list[torch.fx.Node] = []
    metadata: list[torch.fx.Node] = []
    one_path = True

    def walk(value: torch.fx.Node) -> None:
        nonlocal one_path
        for user in value.users:
            op = node_info(user).op
            if op in _METADATA_READS:
                metadata.append(user)
            elif op in RESHAPE_OPS and user.args and user.args[0] is value and not is_inplace_call(user):
                one_path = one_path and len(value.users) == 1
                reshapes.append(user)
                walk(user)
            else:
                ends.append(user)

    walk(node)
    return OutputReaders(tuple(reshapes), tuple(ends), tuple(metadata), one_path)
