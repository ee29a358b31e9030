"""The rows of `amp_fx.report`: a node of a converted graph, where a model input was cast, a
parameter's storage dtype. `amp_fx.inspect.report` builds them and `amp_fx.inspect.report_text`
lays them out; both import them from here.

    >>> row = NodeRow("fc", "call_module", "fc", "linear", "lower", "O2: linear is on a list",
    ...               (torch.float16,), torch.float16, False, "", None, ())
    >>> row.why, row.to_dict()["in_dtypes"]
    ('O2: linear is on a list', ['float16'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["InputCast", "NodeRow", "ParameterRow"]


@dataclass(frozen=True)
class NodeRow:
    """One node of the converted graph as the report shows it."""

    name: str
    # fx's node kind: placeholder, get_attr, call_function, call_method, call_module, output.
    kind: str
    target: str
    # Canonical op ("linear", "softmax", "to" for casts); None for placeholders, get_attr, output.
    op: str | None
    # The rule's value ("lower", "fp32", "promote", "passthrough", "opaque"), or None.
    rule: str | None
    reason: str
    in_dtypes: tuple[torch.dtype | None, ...]
    out_dtype: torch.dtype | None
    is_cast: bool
    cast_reason: str
    opaque_reason: str | None
    notes: tuple[str, ...]
    # For a linear layer under a policy with ``fp8``: whether it runs in FP8, and why not.
    fp8: str = ""
    # The graph the node belongs to, where a report covers several (the torch.export front end's
    # graphs, labelled by module name); "" for a report of one graph.
    graph: str = ""

    @property
    def why(self) -> str:
        """The reason column: the cast's reason for casts, the rule's reason plus opaque reason otherwise."""
        if self.is_cast:
            return self.cast_reason or self.reason
        if self.opaque_reason:
            return (
                f"{self.reason} [opaque: {self.opaque_reason}]"
                if self.reason
                else f"opaque: {self.opaque_reason}"
            )
        if self.kind == "placeholder":
            return self.reason or "input"
        return self.reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "target": self.target,
            "op": self.op,
            "rule": self.rule,
            "reason": self.reason,
            "in_dtypes": [_dtype_str(d) for d in self.in_dtypes],
            "out_dtype": _dtype_str(self.out_dtype),
            "is_cast": self.is_cast,
            "cast_reason": self.cast_reason,
            "opaque_reason": self.opaque_reason,
            "notes": list(self.notes),
            "fp8": self.fp8,
            "graph": self.graph,
        }


@dataclass(frozen=True)
class InputCast:
    """Where a floating model input was cast, and why (`Report.input_casts`)."""

    # The graph's label ("" for the one graph of a torch.fx front-end model) and the input's node.
    graph: str
    name: str
    # amp_fx's casts of the input or of values computed from it (names of cast nodes), and the
    # nodes that read those casts.
    casts: tuple[str, ...]
    consumers: tuple[str, ...]
    # The ops that read it first, uncast (statistics, subtraction, ...), in graph order.
    read_as_is_by: tuple[str, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "name": self.name,
            "casts": list(self.casts),
            "consumers": list(self.consumers),
            "read_as_is_by": list(self.read_as_is_by),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class ParameterRow:
    """A parameter or buffer of the converted module and the dtype it is stored in."""

    name: str
    dtype: torch.dtype
    numel: int
    is_buffer: bool


def _dtype_str(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
