"""The static dtype rules of `propagate_dtypes`: what a node produces from the dtypes it sees.

A value is a ``torch.dtype``, `UNKNOWN` (a tensor of any dtype, or anything: the output of untraced
code), `NOT_TENSOR` (a size, a shape, a Python number), or a tuple of values. A node's rule decides
the dtype its eligible floating inputs are cast to (`rule_cast_dtype`); a call whose rule casts
nothing produces what torch would (`static_output`): torch's type promotion, the dtype a conversion
names, bool for comparisons, int64 for indices (`amp_fx.core.op_facts` lists the ops).

    >>> is_eligible(torch.bfloat16), is_eligible(torch.int64), is_eligible(UNKNOWN)
    (True, False, None)
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from amp_fx.core.fusions import FUSED_OPS, OutputDtype
from amp_fx.core.node_info import node_info
from amp_fx.core.op_facts import (
    ALWAYS_VALUES_INDICES_OPS,
    BOOL_OPS,
    CONVERSION_METHOD_DTYPES,
    FACTORY_FUNCTIONS,
    FIRST_ARGUMENT_DTYPE_OPS,
    INT64_ACCUMULATING_OPS,
    INT64_OPS,
    NON_TENSOR_ATTRIBUTES,
    NON_TENSOR_METHODS,
    NON_TENSOR_MODULES,
    NORM_OPS,
    PAIR_OPS,
    SAME_DTYPE_ATTRIBUTES,
    SAME_DTYPE_IN_PLACE_OPS,
    SPLIT_OPS,
    TENSOR_TYPE_DTYPES,
    VALUES_INDICES_OPS,
)
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.ops.casts import cast_if_floating
from amp_fx.passes.shared.call_nodes import is_inplace_call

__all__ = [
    "UNKNOWN",
    "NOT_TENSOR",
    "is_eligible",
    "rule_cast_dtype",
    "low_parameter_dtype",
    "input_cast_dtypes",
    "abstract_value",
    "abstract_structure",
    "seen_dtype",
    "static_output",
]


class _Marker:
    """A static value that is not a tensor of known dtype."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# A value that may be a tensor of any dtype (output of untraced code), or anything else.
UNKNOWN = _Marker("UNKNOWN")


# A value that is certainly not a tensor (a size, a shape, a Python number).
NOT_TENSOR = _Marker("NOT_TENSOR")


@dataclass(frozen=True)
class _Repeated:
    """A list/tuple of unknown length whose elements all have one value (``torch.split``)."""

    element: Any


def is_eligible(value: Any) -> bool | None:
    """Would autocast cast this value? True for floating dtypes other than float64, False for
    other dtypes and non-tensors, None when unknown.

    >>> is_eligible(torch.bfloat16), is_eligible(torch.int64), is_eligible(UNKNOWN)
    (True, False, None)
    """
    if isinstance(value, torch.dtype):
        return value.is_floating_point and value != torch.float64
    if value is UNKNOWN:
        return None
    return False


def _autocast_promote(low: torch.dtype, values: Sequence[Any]) -> torch.dtype | None:
    # aten/src/ATen/autocast_mode.h promote_type: start from the low dtype; a float32 input makes
    # it float32; float64 and non-floating inputs are ignored. Unknown inputs leave it undecided
    # unless a float32 input already decided it.
    target, undecided = low, False
    for value in values:
        eligible = is_eligible(value)
        if eligible is None:
            undecided = True
        elif eligible and value != target:
            target = torch.float32 if torch.float32 in (value, target) else torch.promote_types(value, target)
    if target == torch.float32:
        return target
    return None if undecided else target


def _passes_dtype(node: torch.fx.Node) -> bool:
    # fp32_set_opt_dtype / fp32_append_dtype ops respect an explicit dtype (softmax(x, 0, dtype=d)).
    return isinstance(node.kwargs.get("dtype"), torch.dtype) or any(
        isinstance(a, torch.dtype) for a in node.args
    )


def rule_cast_dtype(
    rule: Rule | None, policy: Policy, input_values: Sequence[Any], node: torch.fx.Node | None = None
) -> torch.dtype | None:
    """The dtype a node's eligible floating inputs are cast to under `rule` (None: no casts).

    LOWER: the policy's low dtype. FP32: float32, unless the call passes an explicit ``dtype=``
    (autocast respects it). PROMOTE: autocast's promote type over `input_values`. OPAQUE: the
    model-entry dtype at O2/O3 (the island's weights are low there), nothing at O1.

    >>> from amp_fx.core.policy import preset
    >>> rule_cast_dtype(Rule.PROMOTE, preset("O1", torch.bfloat16, "cpu"), [torch.bfloat16, torch.float32])
    torch.float32
    """
    if rule is Rule.LOWER:
        return policy.dtype
    if rule is Rule.FP32:
        return None if node is not None and _passes_dtype(node) else torch.float32
    if rule is Rule.PROMOTE:
        return _autocast_promote(policy.dtype, input_values)
    if rule is Rule.OPAQUE:
        return policy.cast_inputs_dtype
    return None


def low_parameter_dtype(
    node: torch.fx.Node, values: Sequence[Any], params: dict[str, Any]
) -> torch.dtype | None:
    """The dtype a PASSTHROUGH call must run in because of its parameters, or None.

    A module (or functional norm) whose parameters are stored in a low dtype cannot take a
    float32 input (an FP32 island's output at O2): "expected scalar type", "mixed dtype (CPU):
    expect parameter to have scalar type of Float". Its floating inputs are cast to the
    parameters' dtype; float32 parameters need nothing (low input with fp32 weights works).
    """
    if node.op == "call_module":
        weights = list(params.values())
    elif (node_info(node).op or "") in NORM_OPS:
        weights = values[1:]  # all_input_nodes: the input first, then weight/bias/statistics
    else:
        return None
    low = {d for d in weights if is_eligible(d) and d != torch.float32}
    return low.pop() if len(low) == 1 else None


def input_cast_dtypes(
    node: torch.fx.Node, target: torch.dtype | None, values: Sequence[Any]
) -> tuple[torch.dtype | None, ...]:
    """The dtype each input of `node` (``all_input_nodes``, static `values`) is cast to: `target`,
    the rule's, for every input; for an in-place op whose kernel takes one floating dtype
    (`SAME_DTYPE_IN_PLACE_OPS`), none for the destination and its dtype for the sources.

    O2 makes mixes eager would not (a bf16 product written into an FP32 buffer by ``index_add_``);
    the in-place op keeps its destination's dtype, so casting the sources to it is what eager does
    where the dtypes match. The destination is never cast: the update would land on a copy.

    >>> gm = torch.fx.symbolic_trace(lambda out, i, y: out.index_add_(0, i, y))
    >>> node = [n for n in gm.graph.nodes if n.op == "call_method"][0]
    >>> node_info(node).op = "index_add"
    >>> input_cast_dtypes(node, None, [torch.float32, torch.int64, torch.bfloat16])
    (None, torch.float32, torch.float32)
    """
    destination = values[0] if values else None
    if (
        target is None
        and node.args
        and node.args[0] is (node.all_input_nodes or [None])[0]
        and (node_info(node).op or "") in SAME_DTYPE_IN_PLACE_OPS
        and is_inplace_call(node)
        and isinstance(destination, torch.dtype)
        and is_eligible(destination)
    ):
        return (None, *(destination for _ in values[1:]))
    return tuple(target for _ in values)


def _flat_values(value: Any) -> Iterator[Any]:
    """The tensor-like leaves of an argument structure (lists/tuples/dicts of values)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat_values(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat_values(item)
    elif isinstance(value, _Repeated):
        yield value.element
    else:
        yield value


def abstract_value(value: Any) -> Any:
    """The static value of a concrete (fake) one: its dtype for a tensor, structure kept."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (list, tuple)):
        return tuple(abstract_value(v) for v in value)
    return NOT_TENSOR


def abstract_structure(structure: Any) -> Any:
    """A returned tuple/namedtuple of static values keeps its elements (for getitem); others are unknown."""
    return tuple(structure) if isinstance(structure, tuple) else UNKNOWN


def seen_dtype(value: Any, target: torch.dtype | None) -> torch.dtype | None:
    """The dtype a user sees of `value` when its rule casts eligible inputs to `target`."""
    eligible = is_eligible(value)
    if target is not None and eligible is not False:
        return target
    return value if isinstance(value, torch.dtype) else None


def _scalar_category(value: Any) -> int:
    # bool < int < float < complex, as torch's type promotion orders dtype categories.
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return 1
    if isinstance(value, float):
        return 2
    if isinstance(value, complex):
        return 3
    return -1


def _dtype_category(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    return 1


_CATEGORY_DEFAULTS = {0: torch.bool, 1: torch.int64, 3: torch.complex64}


def _promote(args: Any) -> Any:
    """torch's type promotion over the tensor values among `args` (Python numbers take part as
    scalars: they only raise the category, as ``int_tensor * 0.5`` is float32)."""
    dtypes: list[torch.dtype] = []
    scalar_category = -1
    unknown = False
    for value in _flat_values(args):
        if isinstance(value, torch.dtype):
            dtypes.append(value)
        elif value is UNKNOWN or isinstance(value, tuple):
            unknown = True
        else:
            scalar_category = max(scalar_category, _scalar_category(value))
    if unknown:
        return UNKNOWN
    if not dtypes:
        return None
    result = dtypes[0]
    for dtype in dtypes[1:]:
        result = torch.promote_types(result, dtype)
    if scalar_category > _dtype_category(result):
        result = _CATEGORY_DEFAULTS.get(scalar_category, torch.get_default_dtype())
    return result


def _conversion_dtype(node: torch.fx.Node, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Output of x.to(...), x.float(), x.type(...), x.type_as(y)."""
    method = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    source = args[0] if args else UNKNOWN
    if method in CONVERSION_METHOD_DTYPES:
        return CONVERSION_METHOD_DTYPES[method]
    if method == "type_as":
        return args[1] if len(args) > 1 else UNKNOWN
    if method == "type":
        spec = args[1] if len(args) > 1 else kwargs.get("dtype")
        if spec is None:
            return NOT_TENSOR  # x.type() returns a string
        if isinstance(spec, torch.dtype):
            return spec
        return TENSOR_TYPE_DTYPES.get(spec, UNKNOWN)
    if method in ("cuda", "cpu"):
        return source
    # to(dtype) / to(device, dtype) / to(tensor) / to(dtype=...) / to(device)
    if isinstance(kwargs.get("dtype"), torch.dtype):
        return kwargs["dtype"]
    for original, value in zip(node.args[1:], args[1:], strict=False):
        if isinstance(original, torch.dtype):
            return original
        if isinstance(original, torch.fx.Node):
            return value  # to(other_tensor): other's dtype
    return source


def _first(args: Sequence[Any]) -> Any:
    return args[0] if args else UNKNOWN


def _has_dim_argument(node: torch.fx.Node) -> bool:
    if "dim" in node.kwargs:
        return True
    return len(node.args) > 1 and isinstance(node.args[1], int) and not isinstance(node.args[1], bool)


# Fused ops typed by their ``out_dtype=`` keyword (`amp_fx.core.fusions`); the others among them
# (`OutputDtype.PROMOTED`) are typed as any op the rules know nothing else about.
_OUT_DTYPE_OUTPUTS = (OutputDtype.OUT_DTYPE, OutputDtype.SUM_AND_OUT_DTYPE)


def _static_passthrough(
    node: torch.fx.Node, op: str, args: Sequence[Any], kwargs: dict[str, Any], params: dict[str, torch.dtype]
) -> Any:
    """The static output value of a call whose rule casts nothing."""
    target = node.target
    if node.op == "call_function" and target is cast_if_floating:
        return args[1] if is_eligible(args[0]) is not False else args[0]
    if op == "to":
        return _conversion_dtype(node, args, kwargs)
    if node.op == "call_method" and target in NON_TENSOR_METHODS:
        return NOT_TENSOR
    if node.op == "call_function" and target is builtins.getattr:
        attribute = node.args[1] if len(node.args) > 1 else None
        if attribute in NON_TENSOR_ATTRIBUTES:
            return NOT_TENSOR
        if attribute in SAME_DTYPE_ATTRIBUTES:
            return _first(args)
        container = _first(args)
        if isinstance(container, tuple) and attribute in ("values", "indices") and len(container) == 2:
            return container[0 if attribute == "values" else 1]
        return UNKNOWN
    if node.op == "call_function" and target is operator.getitem:
        container, index = _first(args), args[1] if len(args) > 1 else None
        if isinstance(container, tuple):
            return (
                container[index]
                if isinstance(index, int) and -len(container) <= index < len(container)
                else UNKNOWN
            )
        if isinstance(container, _Repeated):
            return container.element if isinstance(index, int) else container
        return container  # tensor indexing keeps the dtype; NOT_TENSOR/UNKNOWN stay so
    fused_output = FUSED_OPS[op].output if op in FUSED_OPS else None
    if fused_output in _OUT_DTYPE_OUTPUTS and isinstance(kwargs.get("out_dtype"), torch.dtype):
        out = kwargs["out_dtype"]
        return (_promote(args[:2]), out) if fused_output is OutputDtype.SUM_AND_OUT_DTYPE else out
    if isinstance(kwargs.get("dtype"), torch.dtype):
        return kwargs["dtype"]
    if is_inplace_call(node) and node.target is not operator.setitem and args:
        return _first(args)  # an in-place op returns its destination, in its dtype
    if node.op == "call_module":
        if op in ("embedding", "embedding_bag"):
            return params.get("weight", UNKNOWN)
        return _first(args)
    if node.op == "call_function" and target in FACTORY_FUNCTIONS:
        name = target.__name__
        if name.endswith("_like"):
            return _first(args)
        if name in ("arange", "full"):
            scalars = [_scalar_category(a) for a in node.args if not isinstance(a, torch.fx.Node)]
            if name == "full":
                scalars = scalars[-1:]
            category = max(scalars, default=1)
            return _CATEGORY_DEFAULTS.get(category, torch.get_default_dtype())
        if name in ("randint", "randperm"):
            return torch.int64
        if name in ("tensor", "as_tensor"):
            return UNKNOWN
        return torch.get_default_dtype()
    if op in BOOL_OPS:
        return torch.bool
    if op in INT64_OPS:
        return torch.int64
    if op in VALUES_INDICES_OPS and (op in ALWAYS_VALUES_INDICES_OPS or _has_dim_argument(node)):
        if op in ("max", "min") and len(args) > 1 and isinstance(args[1], (torch.dtype, _Marker)):
            return _promote(args[:2])  # torch.max(a, b): elementwise
        return (_first(args), torch.int64)
    if op in PAIR_OPS:
        return (_first(args), _first(args))
    if op in SPLIT_OPS:
        return _Repeated(_first(args))
    if op == "embedding":
        return args[1] if len(args) > 1 else kwargs.get("weight", UNKNOWN)
    if op in FIRST_ARGUMENT_DTYPE_OPS or op.startswith("new_"):
        return _first(args)
    if op in INT64_ACCUMULATING_OPS:
        source = _first(args)
        if isinstance(source, torch.dtype) and not source.is_floating_point and not source.is_complex:
            return torch.int64
        return source
    if op == "div" and kwargs.get("rounding_mode") is None:
        promoted = _promote(args)
        if isinstance(promoted, torch.dtype) and _dtype_category(promoted) < 2:
            return torch.get_default_dtype()
        return promoted
    promoted = _promote(list(args) + list(kwargs.values()))
    if promoted is not None:
        return promoted
    module = getattr(target, "__module__", None) or ""
    if node.op == "call_function" and module in NON_TENSOR_MODULES:
        return NOT_TENSOR  # arithmetic on sizes
    return UNKNOWN


def static_output(
    node: torch.fx.Node,
    rule: Rule | None,
    target: torch.dtype | None,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    gm: torch.fx.GraphModule,
    params: dict[str, torch.dtype],
) -> Any:
    """The static value `node` produces under `rule`, its inputs cast to `target`; `args` and
    `kwargs` are the static values of its arguments, `params` the dtypes of its module's tensors."""
    if rule is Rule.OPAQUE:
        return UNKNOWN
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), AutocastIsland):
        return UNKNOWN
    op = node_info(node).op or ""
    if target is not None and rule in (Rule.LOWER, Rule.FP32, Rule.PROMOTE):
        inputs = [*_flat_values(list(args) + list(kwargs.values())), *params.values()]
        if any(is_eligible(v) is not False for v in inputs):
            return target
    if rule is Rule.FP32 and isinstance(kwargs.get("dtype"), torch.dtype):
        return kwargs["dtype"]
    return _static_passthrough(node, op, args, kwargs, params)
