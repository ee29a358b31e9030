"""Which calls a graph of `amp_fx.capture.export.export_graph` computes: `CallSignature` (plain
Python, traceable by torch.compile) where the call's arguments are tensors and constants, and
`accepts` (reads the graph, checks sizes with sympy) for any call.

>>> sig = CallSignature(1, (), (TensorSpec(torch.float32, "cpu", ("s0", 4)),), (("s0", 2, None),))
>>> sig.matches((torch.randn(3, 4),), {}), sig.matches((torch.randn(3, 5),), {})
(True, False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = [
    "KEYWORDS_ATTR",
    "RANGES_ATTR",
    "SIGNATURE_ATTR",
    "CallSignature",
    "Constant",
    "SymbolicInt",
    "TensorSpec",
    "accepts",
    "call_signature",
    "in_capture_order",
    "signature_of",
]

# Attributes `export_graph` sets on its graphs: the size ranges torch.export found, the call's
# keyword names in capture order, and the graph's `CallSignature`.
RANGES_ATTR = "_amp_fx_range_constraints"
KEYWORDS_ATTR = "_amp_fx_keyword_names"
SIGNATURE_ATTR = "_amp_fx_call_signature"


def in_capture_order(gm: torch.fx.GraphModule, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` in the order the graph's placeholders take them."""
    return {key: kwargs[key] for key in getattr(gm, KEYWORDS_ATTR)}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor argument: dtype, device type, and each size as an int or a size symbol's name."""

    dtype: torch.dtype
    device_type: str
    sizes: tuple[int | str, ...]


@dataclasses.dataclass(frozen=True)
class Constant:
    """A non-tensor argument, captured as this value."""

    value: Any


@dataclasses.dataclass(frozen=True)
class SymbolicInt:
    """An int argument captured as a size symbol (a count a container holds): any int in its range."""

    name: str


@dataclasses.dataclass(frozen=True)
class CallSignature:
    """The calls a graph of `export_graph` computes, for arguments that are tensors and constants.

    `matches` is `accepts` in plain Python: under torch.compile, Dynamo traces it and guards on
    the sizes, dtypes and values it compares.
    """

    positional: int
    keywords: tuple[str, ...]
    arguments: tuple[TensorSpec | Constant | SymbolicInt, ...]  # positional, then keywords in capture order
    ranges: tuple[tuple[str, int | None, int | None], ...]  # size symbol, lowest, highest (None: no bound)

    def matches(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if len(args) != self.positional or len(kwargs) != len(self.keywords):
            return False
        values = list(args)
        for key in self.keywords:
            if key not in kwargs:
                return False
            values.append(kwargs[key])
        sizes: dict[str, Any] = {}
        for value, spec in zip(values, self.arguments, strict=True):
            if isinstance(spec, SymbolicInt):
                if type(value) is not int or sizes.setdefault(spec.name, value) != value:
                    return False
                continue
            if isinstance(spec, Constant):
                if (
                    isinstance(value, torch.Tensor)
                    or type(value) is not type(spec.value)
                    or value != spec.value
                ):
                    return False
                continue
            if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype:
                return False
            if value.device.type != spec.device_type or value.dim() != len(spec.sizes):
                return False
            for size, want in zip(value.shape, spec.sizes, strict=True):
                if isinstance(want, str):
                    if sizes.setdefault(want, size) != size:
                        return False
                elif size != want:
                    return False
        for name, lowest, highest in self.ranges:
            if (lowest is not None and sizes[name] < lowest) or (
                highest is not None and sizes[name] > highest
            ):
                return False
        return True


def _size_spec(size: Any, ranges: dict[Any, Any]) -> int | str | None:
    if isinstance(size, int):
        return size
    expr = size.node.expr if isinstance(size, torch.SymInt) else None
    if expr is not None and expr.is_Integer:  # a dimension export specialised after all
        return int(expr)
    return str(expr) if expr is not None and expr.is_Symbol and expr in ranges else None


def _bound(value: Any) -> int | None:
    # A sympy Integer, or torch's int_oo / -int_oo (no bound).
    return int(value) if value.is_Integer else None


def signature_of(
    gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> CallSignature | None:
    """The `CallSignature` of ``gm`` captured from this call, or None when an argument is a container
    (then only `accepts` decides)."""
    ranges = getattr(gm, RANGES_ATTR)
    placeholders = iter(gm.graph.find_nodes(op="placeholder"))
    specs: list[TensorSpec | Constant | SymbolicInt] = []
    for value in (*args, *in_capture_order(gm, kwargs).values()):
        if value is None:
            # A placeholder where pytree counts None as a leaf (torch 2.14), none where it is an
            # empty node (torch 2.11); either way the value is a constant.
            for _ in pytree.tree_leaves(value):
                next(placeholders)
            specs.append(Constant(None))
            continue
        if not isinstance(value, (torch.Tensor, bool, int, float, str)):
            return None
        expected = next(placeholders).meta.get("val")
        if not isinstance(value, torch.Tensor):
            size = _size_spec(expected, ranges) if isinstance(expected, torch.SymInt) else None
            specs.append(SymbolicInt(size) if isinstance(size, str) else Constant(value))
            continue
        sizes = tuple(_size_spec(size, ranges) for size in expected.shape)
        if any(size is None for size in sizes):
            return None  # a size that is an expression of symbols: `accepts` checks it
        specs.append(TensorSpec(expected.dtype, expected.device.type, sizes))
    used = {
        size for spec in specs if isinstance(spec, TensorSpec) for size in spec.sizes if isinstance(size, str)
    } | {spec.name for spec in specs if isinstance(spec, SymbolicInt)}
    bounds = []
    for symbol, values in ranges.items():
        if str(symbol) in used:
            bounds.append((str(symbol), _bound(values.lower), _bound(values.upper)))
    return CallSignature(len(args), tuple(getattr(gm, KEYWORDS_ATTR)), tuple(specs), tuple(sorted(bounds)))


def call_signature(gm: torch.fx.GraphModule) -> CallSignature | None:
    """The `CallSignature` of a graph of `export_graph`; None when a call argument was a container."""
    return getattr(gm, SIGNATURE_ATTR, None)


def accepts(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when ``gm`` (from `export_graph`) computes this call: same argument structure and
    constants, each tensor of the captured dtype and rank, each size within its captured range."""
    if set(kwargs) != set(getattr(gm, KEYWORDS_ATTR)):
        return False
    flat, spec = pytree.tree_flatten_with_path((args, in_capture_order(gm, kwargs)))
    if spec != gm._in_spec:
        return False
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, (_, value) in zip(placeholders, flat, strict=True):
        expected = node.meta.get("val")
        if isinstance(expected, torch.Tensor) and (
            not isinstance(value, torch.Tensor)
            or value.dtype != expected.dtype
            or value.device.type != expected.device.type
        ):
            return False
    try:
        torch._export.utils._check_input_constraints_for_graph(placeholders, flat, getattr(gm, RANGES_ATTR))
    except RuntimeError:
        return False
    return True
