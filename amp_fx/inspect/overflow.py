"""`amp_fx.find_overflow(model)`: after a step whose loss or gradients held inf/NaN, or that the
loss scaler skipped, the op that overflowed first, the line of the model that made it, the ranges
of what it read, and whether the values or the loss scale were the cause, in one call.

It reads what `amp_fx.watch` recorded (`amp_fx.inspect.ranges`): the newest recorded step in which
a watched node overflowed (an inf or NaN value: a value past the dtype's largest finite value
rounds to inf), and in it the first such record in execution order: the forward in graph order,
then the backward in the order autograd ran it (the host keeps that order as the records are made).

    >>> import torch, amp_fx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> _ = torch.nn.init.constant_(model[0].weight, 1.0)
    >>> gm = amp_fx.convert(model, "O2", device_type="cpu")
    >>> watch = amp_fx.watch(gm)
    >>> gm(torch.full((2, 4), 30000.0)).sum().backward()  # 4 x 30000 > 65504: the first Linear overflows
    >>> overflow = amp_fx.find_overflow(gm)
    >>> overflow.node.node, overflow.direction, overflow.cause
    ('_0', 'forward', 'values')
    >>> [entry.name for entry in overflow.inputs]
    ['input_1_to_float16', '0.weight', '0.bias']

Its causes: "values" where the forward overflowed (no loss scale prevents that: keep the op in
FP32, or use bf16: `amp_fx.propose_policy`), "loss scale" where only gradients did (the loss scaler
skips such a step and halves its scale; a step that keeps skipping at a small scale means the
gradients themselves overflow).
"""

from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.inspect.graphs import ModelGraph
from amp_fx.inspect.ranges import (
    MOVING_OPS,
    NodeRange,
    RangeStats,
    RangeWatch,
    is_range_record,
    measure,
    watching,
)
from amp_fx.inspect.report_text import REPORT_WIDTH
from amp_fx.ops.range_record import BACKWARD, FORWARD

logger = logging.getLogger(__name__)

__all__ = ["InputRange", "Overflow", "consumers_of", "find_overflow", "origin", "read_ranges"]

DIRECTIONS = {FORWARD: "forward", BACKWARD: "backward"}
# Overflowing records listed after the first one in `Overflow.__str__`.
_SHOWN_AFTER = 4


@dataclass(frozen=True)
class InputRange:
    """What an overflowing op read: a watched value (its range in that step), the gradient flowing
    into a consumer, a parameter (measured now), or a value nothing recorded."""

    name: str
    # "value", "gradient", "parameter", "model input" or "not watched".
    kind: str
    stats: RangeStats | None
    note: str = ""

    def describe(self) -> str:
        note = f", {self.note}" if self.note else ""
        what = self.stats.describe() if self.stats is not None else "not recorded"
        return f"{self.name} ({self.kind}{note}): {what}"


@dataclass(frozen=True)
class Overflow:
    """The first overflow of a recorded step (`find_overflow`)."""

    step: int
    # The node, with the statistics it recorded in that step.
    node: NodeRange
    direction: str  # "forward" or "backward"
    cause: str  # "values" or "loss scale"
    inputs: tuple[InputRange, ...]
    # For an overflowing gradient: the ops whose backward produced it (the node's consumers).
    consumers: tuple[str, ...]
    # Every overflowing record of the step after the first: (graph label, node, direction).
    later: tuple[tuple[str, str, str], ...]

    @property
    def stats(self) -> RangeStats:
        """What the node recorded in the overflowing direction."""
        return self.node.forward if self.direction == "forward" else self.node.backward

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "node": self.node.to_dict(),
            "direction": self.direction,
            "cause": self.cause,
            "inputs": [
                {"name": i.name, "kind": i.kind, "note": i.note, "stats": i.stats and i.stats.to_dict()}
                for i in self.inputs
            ],
            "consumers": list(self.consumers),
            "later": [list(entry) for entry in self.later],
        }

    def __str__(self) -> str:
        node = self.node
        where = f"[{node.graph}] " if node.graph else ""
        dtype = str(node.dtype).removeprefix("torch.")
        what = f"{where}{node.node} ({node.op or '-'}, {dtype})"
        if self.direction == "forward":
            first = f"step {self.step} overflowed first in the forward, at {what}"
        else:
            producers = ", ".join(self.consumers) or "code after the graph (the loss?)"
            first = (
                f"step {self.step} overflowed first in the backward, in the gradient flowing back into "
                f"{what}, from the backward of {producers}"
            )
        if self.cause == "values":
            cause = "the values: the forward overflowed, which no loss scale prevents"
        else:
            cause = (
                "the loss scale: only gradients overflowed; the loss scaler skips the step and lowers "
                "its scale (a step that keeps skipping at a small scale means the gradients overflow)"
            )
        lines = [first, f"  cause: {cause}"]
        if node.source:
            lines.append(f"  line: {node.source}")
        lines.append(f"  module: {node.module or '<model>'}")
        lines.append(f"  {self.direction}: {self.stats.describe()}")
        if self.inputs:
            lines.append("  read:" if self.direction == "forward" else "  computed from:")
            lines += [f"    {entry.describe()}" for entry in self.inputs]
        if self.later:
            shown = ", ".join(f"{name} ({direction})" for _, name, direction in self.later[:_SHOWN_AFTER])
            more = f", and {len(self.later) - _SHOWN_AFTER} more" if len(self.later) > _SHOWN_AFTER else ""
            lines.append(f"  then: {shown}{more}")
        if self.cause == "values":
            lines.append("  to keep it in range: amp_fx.propose_policy(model) proposes policy rules")
        return "\n".join(line for text in lines for line in _wrapped(text))


def _wrapped(text: str) -> list[str]:
    # Continued lines indented under the text, two more spaces.
    indent = " " * (len(text) - len(text.lstrip()) + 2)
    return textwrap.wrap(text, REPORT_WIDTH, subsequent_indent=indent, break_long_words=False) or [text]


def find_overflow(model: nn.Module, step: int | None = None) -> Overflow | None:
    """The first overflow of the newest recorded step that holds one (or of ``step``, one of the
    watch's kept `RangeWatch.steps`); None where no kept step overflowed. Reads the device.

    Raises ValueError for a model `amp_fx.watch` does not watch (watch it before training: the
    step that overflows must be recorded, which ``every=1``, or ``watch.every = 1`` set before
    the step, makes sure of).
    """
    watch = watching(model)
    if watch is None:
        raise ValueError(
            f"this {type(model).__name__} is not watched, so nothing recorded its values: call "
            "amp_fx.watch(model) before training (every=1 records every step; the default, every "
            "16th), then call find_overflow after the step that overflowed"
        )
    steps = [step] if step is not None else list(reversed(watch.steps))
    for candidate in steps:
        found = _first_overflow(watch, candidate)
        if found is not None:
            return found
    hint = "" if watch.every == 1 else "; set watch.every = 1 to record every step from the next on"
    logger.info("no overflow in the recorded steps kept (%s)%s", watch.steps, hint)
    return None


def _first_overflow(watch: RangeWatch, step: int) -> Overflow | None:
    ranges = {(r.graph, r.node): r for r in watch.ranges(step)}
    bad = []
    for label, name, direction in watch.order(step):
        node_range = ranges.get((label, name))
        if node_range is not None and _in(node_range, direction).overflowed:
            bad.append((label, name, direction))
    if not bad:
        return None
    label, name, direction = bad[0]
    node = watch.watched_nodes()[(label, name)]
    graph = watch.graphs()[label]
    if direction == FORWARD:
        inputs = read_ranges(node, graph, ranges)
        consumers: list[torch.fx.Node] = []
    else:
        consumers = consumers_of(node)
        inputs = []
        for consumer in consumers:
            grad = ranges.get((label, consumer.name))
            inputs.append(
                InputRange(consumer.name, "gradient", grad.backward)
                if grad is not None
                else InputRange(consumer.name, "gradient", None, _not_watched(consumer))
            )
            inputs += read_ranges(consumer, graph, ranges, leaving_out=node)
    return Overflow(
        step=step,
        node=ranges[(label, name)],
        direction=DIRECTIONS[direction],
        cause="values" if any(d == FORWARD for _, _, d in bad) else "loss scale",
        inputs=tuple({(entry.name, entry.kind): entry for entry in inputs}.values()),
        consumers=tuple(f"{c.name} ({node_info(c).op or c.target})" for c in consumers),
        later=tuple((g, n, DIRECTIONS[d]) for g, n, d in bad[1:]),
    )


def read_ranges(
    node: torch.fx.Node,
    graph: ModelGraph,
    ranges: dict[tuple[str, str], NodeRange],
    leaving_out: torch.fx.Node | None = None,
) -> list[InputRange]:
    """What ``node`` read, with the ranges recorded in ``ranges`` (keyed by graph label and node
    name): each value it reads, named by the watched node it comes from (through views, copies and
    casts), and the parameters of the module it calls, measured now; ``leaving_out`` the value of
    that node."""
    prefix = f"{graph.module}." if graph.module else ""
    found = [
        _source(arg, graph.label, ranges, graph.gm, prefix)
        for arg in node.all_input_nodes
        if leaving_out is None or origin(arg) is not leaving_out
    ]
    if node.op == "call_module":
        for name, parameter in graph.gm.get_submodule(node.target).named_parameters(recurse=False):
            entry = InputRange(
                f"{prefix}{node.target}.{name}", "parameter", measure(parameter), "measured now"
            )
            found.append(entry)
    return found


def consumers_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ops that read ``node``'s value: through recording calls and ops that only move values."""
    found: dict[torch.fx.Node, None] = {}
    pending = list(node.users)
    while pending:
        user = pending.pop(0)
        if is_range_record(user) or node_info(user).op in MOVING_OPS:
            pending += list(user.users)
        elif user.op != "output":
            found[user] = None
    return list(found)


def _in(node_range: NodeRange, direction: int) -> RangeStats:
    return node_range.forward if direction == FORWARD else node_range.backward


def origin(node: torch.fx.Node) -> torch.fx.Node:
    """The node a value comes from, through amp_fx's recording calls."""
    while is_range_record(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _source(
    arg: torch.fx.Node,
    label: str,
    ranges: dict[tuple[str, str], NodeRange],
    gm: torch.fx.GraphModule,
    prefix: str,
) -> InputRange:
    """What an op read through ``arg``: the watched value it comes from (through views, copies and
    casts), a parameter (measured now, in the dtype the op read it in), or a value not recorded."""
    passed: list[str] = []
    cast_to: torch.dtype | None = None
    node = arg
    while True:
        node = origin(node)
        watched = ranges.get((label, node.name))
        if watched is not None and watched.forward.recorded:
            note = f"via {', '.join(passed)}" if passed else ""
            return InputRange(node.name, "value", watched.forward, note)
        info = node_info(node)
        if node.op == "get_attr":
            tensor = _attribute(gm, node.target)
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                return InputRange(prefix + node.target, "not watched", None)
            read = tensor if cast_to is None else tensor.to(cast_to)
            return InputRange(prefix + node.target, "parameter", measure(read), "measured now")
        if node.op == "placeholder":
            return InputRange(node.name, "model input", None)
        source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if source is not None and (info.is_cast or info.op in MOVING_OPS):
            if info.is_cast and cast_to is None:
                cast_to = info.out_dtype
            passed.append(info.op or node.name)
            node = source
            continue
        return InputRange(node.name, "not watched", None, _not_watched(node))


def _not_watched(node: torch.fx.Node) -> str:
    dtype = node_info(node).out_dtype
    shown = str(dtype).removeprefix("torch.") if dtype is not None else "dtype unknown"
    return f"{shown}; amp_fx.watch(nodes='all') records it"


def _attribute(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
