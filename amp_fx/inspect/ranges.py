"""`amp_fx.watch(model)`: record, on the device, the range of every value a converted model
computes in fp16 or bf16, in the forward and in the backward, and read it when asked.

    >>> import torch, amp_fx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = amp_fx.convert(model, "O2", device_type="cpu")
    >>> watch = amp_fx.watch(gm)
    >>> gm(torch.randn(16, 4)).sum().backward()
    >>> [(r.node, r.dtype, r.forward.numel, r.backward.numel) for r in watch.ranges()]
    [('input_1_to_float16', torch.float16, 64, 0), ('_0', torch.float16, 128, 128),
     ('_1', torch.float16, 128, 128), ('_2', torch.float16, 32, 32)]
    >>> watch.ranges()[1].forward.headroom > 10  # log2(65504 / largest magnitude) bits
    True
    >>> watch.remove()  # the graph is as it was

What is watched: every call node whose value is a float16 or bfloat16 tensor (``nodes="all"``:
float32 too), but views and copies of values (reshape, transpose, getitem of a split, cat, ...),
which hold values a watched node computed, and amp_fx's casts of parameters. A fused op of ours
(norms, activations, rotary embeddings) is watched at its output: its kernel computes in fp32 and
rounds once, so the output is inf exactly where the fp32 value passed the dtype's largest finite
value (by half a unit or more). What is recorded per node and step, for its value and for the
gradient flowing back to it: the largest magnitude (inf included, NaN not), and the counts of
underflowing values (non-zero, below the dtype's smallest normal), of inf/NaN values and of all
values (`amp_fx.ops.range_record`, one kernel launch per value). A value the forward kernel of a
fused op writes (a norm's output and the sum of an add + norm, an activation's, a rotary
embedding's) is recorded inside that kernel, in the launch that writes it, rather than by a launch
of its own: the graph asks the op with a call of `amp_fx.ops.range_record.expect_kernel_records`
before it (the gradient is recorded apart, as any node's). Nothing is read on the host while the
model runs; `RangeWatch.ranges` reads the statistics when asked (one host sync).

Steps: one step is one call of the model (its forward and the backward that follows). ``every=N``
records the steps 0, N, 2N, ... and leaves the others as they would run unwatched but for a Python
call per watched node. The default, `DEFAULT_EVERY` (16), keeps the cost within 5% of a training
step (``benchmarks/bench_watch.py``); ``every=1`` records every step, so that the step that
overflows is always among those recorded (a recorded step costs about a third of a step more on
GPT-2 small), and ``watch.every = 1`` switches to it on a running watch: after a run starts
skipping steps or returns NaN, one more step then names the op. The last ``history`` recorded
steps are kept apart (`RangeWatch.ranges` of one step, what `amp_fx.find_overflow` reads);
`RangeWatch.ranges` without a step gives the totals since the watch began or was reset.

The graph is changed in place: a call of `amp_fx.ops.range_record.range_begin` first and a call of
`record_range` after each watched node (and `expect_kernel_records` before a fused op whose kernel
records), which returns the value unchanged (outputs and gradients are
bit-identical to the unwatched model's). `RangeWatch.remove` takes them out again, leaving the
code as it was. Graphs the torch.export front end captures after the call are watched too; a
torch.fx front-end model rewritten after a change (`amp_fx.capture.changes.GraphFollower`) is
watched again, with its statistics started afresh.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
import re
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

import amp_fx
import amp_fx.passes
from amp_fx.capture.captured_model import capture_states
from amp_fx.capture.traced_graph_module import FOLLOWER_ATTR
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.node_info import OTHER_MODE_GRAPH_KEY, node_info
from amp_fx.core.op_facts import BOOL_OPS, NON_TENSOR_METHODS, VIEW_OPS
from amp_fx.inspect.graphs import ModelGraph, model_graphs
from amp_fx.kernels import reference as kernels_reference
from amp_fx.ops.range_record import (
    BACKWARD,
    FORWARD,
    KERNEL_RECORDING_OPS,
    RangeClock,
    RangeRecorder,
    expect_kernel_records,
    range_begin,
    record_range,
)
from amp_fx.passes.shared.call_nodes import calling_module

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_HISTORY",
    "MOVING_OPS",
    "NodeRange",
    "RangeStats",
    "RangeWatch",
    "is_range_record",
    "measure",
    "source_line",
    "watch",
    "watching",
]

# Record every 16th step by default: on an H100 (benchmarks/bench_watch.py, BENCHMARKS.md) a
# recorded step of GPT-2 small costs 1.32x an unwatched one, so recording every step is over issue
# 42's 5% bound, while every 8th cost 1.2% on GPT-2 and every 16th 0.5% on the Llama 0.5B. Set
# ``every=1`` (or ``watch.every = 1`` later) to record the very step that overflows.
DEFAULT_EVERY = 16
# Recorded steps kept apart, newest last: room for a few gradient-accumulation micro-steps.
DEFAULT_HISTORY = 8
NODE_CHOICES = ("low", "all")
# gm.__dict__ key of a watched graph module's `RangeRecorder` (read by the graph's code); and the
# node.meta key marking amp_fx's recording nodes, holding their slot (the begin node: -1).
RECORDER_ATTR = "_amp_fx_ranges"
RECORD_KEY = "amp_fx_range_record"
# Ops whose values are other nodes' values moved, not computed: not watched.
MOVING_OPS = VIEW_OPS | {
    "cat", "stack", "clone", "repeat", "tile", "expand_copy", "broadcast_tensors", "broadcast_to"
}  # fmt: skip
_CALLS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class RangeStats:
    """What one node recorded in one direction: the largest magnitude (inf included, NaN not),
    the underflowing, non-finite (inf or NaN) and all values counted. ``numel == 0``: nothing
    was recorded."""

    amax: float
    underflow: int
    nonfinite: int
    numel: int
    dtype: torch.dtype | None

    @property
    def recorded(self) -> bool:
        return self.numel > 0

    @property
    def headroom(self) -> float:
        """log2(dtype's largest finite value / amax): the doublings left before overflow
        (inf for all zeros, -inf once a value was inf, negative past the largest finite value).

        >>> round(RangeStats(4096.0, 0, 0, 8, torch.float16).headroom, 3)
        3.999
        """
        if self.dtype is None or not self.recorded:
            return math.nan
        if self.amax == 0:
            return math.inf
        if math.isinf(self.amax):
            return -math.inf
        return math.log2(torch.finfo(self.dtype).max / self.amax)

    @property
    def underflow_share(self) -> float:
        """The share of the values that underflowed (0 where nothing was recorded)."""
        return self.underflow / self.numel if self.numel else 0.0

    @property
    def overflowed(self) -> bool:
        """An inf or NaN value: a value past the dtype's largest finite value rounds to inf (one
        within half a unit of it rounds down to it, and is counted `saturated`)."""
        if not self.recorded or self.dtype is None:
            return False
        return self.nonfinite > 0 or self.amax > torch.finfo(self.dtype).max

    @property
    def saturated(self) -> bool:
        """No inf or NaN, and a value of exactly the dtype's largest finite magnitude: what code
        writes for minus infinity (``torch.finfo(dtype).min`` in attention masks), or a value that
        rounded down to it.

        >>> RangeStats(65504.0, 0, 0, 4, torch.float16).saturated
        True
        """
        return self.recorded and not self.overflowed and self.amax == torch.finfo(self.dtype).max

    def describe(self) -> str:
        """One line: largest magnitude, headroom, underflow share, non-finite count.

        >>> print(RangeStats(4096.0, 2, 0, 8, torch.float16).describe())
        amax 4.1e+03 (headroom 4.0 bits), underflow 25.0%, inf/NaN 0 of 8
        """
        if not self.recorded:
            return "not recorded"
        return (
            f"amax {self.amax:.2g} (headroom {self.headroom:.1f} bits), underflow "
            f"{100 * self.underflow_share:.1f}%, inf/NaN {self.nonfinite} of {self.numel}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "amax": self.amax,
            "underflow": self.underflow,
            "nonfinite": self.nonfinite,
            "numel": self.numel,
            "headroom": self.headroom if self.recorded else None,
            "underflow_share": self.underflow_share,
            "overflowed": self.overflowed,
        }


@dataclass(frozen=True)
class NodeRange:
    """A watched node and what it recorded: its value (`forward`) and the gradient flowing back to
    it (`backward`)."""

    graph: str  # the graph's label, as `amp_fx.report` labels it
    node: str
    op: str | None
    dtype: torch.dtype | None
    forward: RangeStats
    backward: RangeStats
    # The module whose forward computes the node, qualified from the model ("" for the model's
    # own code), and the line of the user's code that made it (None where not recorded).
    module: str
    source: str | None

    @property
    def overflowed(self) -> bool:
        return self.forward.overflowed or self.backward.overflowed

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "node": self.node,
            "op": self.op,
            "dtype": None if self.dtype is None else str(self.dtype).removeprefix("torch."),
            "module": self.module,
            "source": self.source,
            "forward": self.forward.to_dict(),
            "backward": self.backward.to_dict(),
        }


@dataclass
class _Watched:
    """A graph module amp_fx watches: its recorder and the nodes of its slots."""

    graph: ModelGraph
    recorder: RangeRecorder
    slots: list[torch.fx.Node]


# The watch of each model being watched.
_WATCHES: weakref.WeakKeyDictionary[nn.Module, RangeWatch] = weakref.WeakKeyDictionary()


def watching(model: nn.Module) -> RangeWatch | None:
    """The `RangeWatch` watching ``model``, or None."""
    return _WATCHES.get(model)


def is_range_record(node: torch.fx.Node) -> bool:
    """Whether ``node`` is one of the nodes `watch` put into the graph (the report leaves them out)."""
    return RECORD_KEY in node.meta


class RangeWatch:
    """The handle `watch` returns: read the recorded ranges, reset them, pause, stop watching.

    Use it as a context manager to stop watching at the end of a block::

        with amp_fx.watch(model) as ranges:
            train_step()
        print(ranges.ranges())  # still readable after the block
    """

    def __init__(self, model: nn.Module, every: int, history: int, nodes: str) -> None:
        self.model = model
        self.history, self.nodes = history, nodes
        self.clock = RangeClock(every=every, history=history)
        self._watched: dict[int, _Watched] = {}  # id(graph module) -> what it records
        self._removed = False
        self._hooks: list[tuple[Any, Any]] = []  # (capture state, its hook)
        self._rewrite: Any = None  # the fx GraphFollower's rewrite, which `_follow_rewrites` wraps

    @property
    def every(self) -> int:
        """Record the steps that are multiples of ``every``; settable on a running watch
        (``watch.every = 1``: every step from the next one on)."""
        return self.clock.every

    @every.setter
    def every(self, every: int) -> None:
        self.clock.every = _count("every", every)

    # --- reading --------------------------------------------------------------------------------
    @property
    def steps(self) -> list[int]:
        """The recorded steps kept apart (at most ``history``), oldest first; steps count the model's
        calls from the first one watched."""
        return sorted(self.clock.row_steps.values())

    def ranges(self, step: int | None = None) -> list[NodeRange]:
        """What each watched node recorded: the totals since the watch began or was reset, or, for
        ``step`` (one of `steps`), that step's. In graph order, graph by graph. Reads the device.

        Raises ValueError for a step that is not kept (not recorded, or older than ``history``).
        """
        row = None if step is None else self._row_of(step)
        found = []
        for watched in self._current():
            if row is None:
                statistics = watched.recorder.totals()
            else:
                statistics = watched.recorder.step_statistics(row)
                if statistics is None:
                    continue
            found += _node_ranges(watched, *statistics)
        return found

    def order(self, step: int) -> list[tuple[str, str, int]]:
        """(graph label, node name, direction) of each record of ``step``, in the order they ran
        (each at its first record); direction is `amp_fx.ops.range_record.FORWARD` or `BACKWARD`."""
        row = self._row_of(step)
        where = {id(w.recorder): w for w in self._current()}
        found = []
        for recorder, slot, direction in self.clock.order.get(row, {}):
            watched = where.get(id(recorder))
            if watched is not None:
                found.append((watched.graph.label, watched.slots[slot].name, direction))
        return list(dict.fromkeys(found))

    def graphs(self) -> dict[str, ModelGraph]:
        """Label -> each watched graph the model holds now."""
        return {watched.graph.label: watched.graph for watched in self._current()}

    def watched_nodes(self) -> dict[tuple[str, str], torch.fx.Node]:
        """(graph label, node name) -> the watched node, for each node `ranges` reports (of a
        graph module with a graph per mode, the node of its current graph where both have it)."""
        found: dict[tuple[str, str], torch.fx.Node] = {}
        for watched in self._current():
            current = watched.graph.gm.graph
            for node in sorted(watched.slots, key=lambda n: n.graph is not current):
                found.setdefault((watched.graph.label, node.name), node)
        return found

    def _row_of(self, step: int) -> int:
        for row, held in self.clock.row_steps.items():
            if held == step:
                return row
        raise ValueError(
            f"step {step} is not among the recorded steps kept ({self.steps}): a watch keeps the last "
            f"{self.history} recorded steps, and records every {self.every}-th step; watch with "
            "history= or every= to keep it"
        )

    def _current(self) -> list[_Watched]:
        """The watched graphs the model holds now, in `model_graphs` order, with their labels now
        (after `remove`: those it held)."""
        if self._removed:
            return list(self._watched.values())
        found = []
        for graph in model_graphs(self.model):
            watched = self._watched.get(id(graph.gm))
            if watched is not None and graph.gm.__dict__.get(RECORDER_ATTR) is watched.recorder:
                watched.graph = graph
                found.append(watched)
        return found

    # --- control --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Zero every statistic and forget the recorded steps: the next step records afresh."""
        for watched in self._watched.values():
            watched.recorder.reset()
        self.clock.reset()

    def pause(self) -> None:
        """Record nothing until `resume` (the graph keeps its recording calls, which then return
        at once)."""
        self.clock.paused = True

    def resume(self) -> None:
        self.clock.paused = False

    def remove(self) -> None:
        """Stop watching: the graphs' code becomes what it was before `watch`. The statistics stay
        readable."""
        if self._removed:
            return
        self._removed = True
        for state, hook in self._hooks:
            if hook in state.capture_hooks:
                state.capture_hooks.remove(hook)
        follower = self.model.__dict__.get(FOLLOWER_ATTR)
        if follower is not None and self._rewrite is not None:
            follower.rewrite = self._rewrite
        for watched in self._watched.values():
            _uninstrument(watched.graph.gm)
        if follower is not None:
            follower.accept(self.model)
        _WATCHES.pop(self.model, None)

    def __enter__(self) -> RangeWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # --- instrumenting --------------------------------------------------------------------------
    def _instrument(self, graph: ModelGraph) -> None:
        if any(is_range_record(node) for g in _graphs_of(graph.gm) for node in g.nodes):
            _uninstrument(graph.gm)  # a copy of a watched model: its recording calls start afresh
        slots = [node for g in _graphs_of(graph.gm) for node in g.nodes if _watches(node, self.nodes)]
        recorder = RangeRecorder(self.clock, len(slots), graph.root, low_only=self.nodes == "low")
        graph.gm.__dict__[RECORDER_ATTR] = recorder  # before the graph reads it
        for g in _graphs_of(graph.gm):
            _instrument_graph(g, [(i, n) for i, n in enumerate(slots) if n.graph is g])
        graph.gm.recompile()
        self._watched[id(graph.gm)] = _Watched(graph, recorder, slots)

    def _instrument_captured(self, module: str, gm: torch.fx.GraphModule) -> None:
        # A graph the torch.export front end just captured for ``module``; its label is known once
        # the module keeps it (`_current`).
        self._instrument(ModelGraph("", module, gm, root=module == ""))
        self._count_steps_by_root()

    def _count_steps_by_root(self) -> None:
        # Without a graph of the model's own call, a step is told by the backward (`RangeClock`).
        self.clock.tracks_backward = not any(w.recorder.root for w in self._watched.values())

    def _follow_rewrites(self, follower: Any) -> None:
        # A torch.fx front-end model changed after conversion gets new graphs: watch them too.
        rewrite = self._rewrite = follower.rewrite

        def rewrite_and_watch(gm: nn.Module, added: frozenset[str]) -> None:
            rewrite(gm, added)
            logger.info("%s was rewritten after a change: watching its new graph", type(gm).__name__)
            self._watched = {k: w for k, w in self._watched.items() if w.graph.gm is not gm}
            self._instrument(model_graphs(gm)[0])

        follower.rewrite = rewrite_and_watch


def watch(
    model: nn.Module, *, every: int = DEFAULT_EVERY, history: int = DEFAULT_HISTORY, nodes: str = "low"
) -> RangeWatch:
    """Watch the value ranges of a model `amp_fx.convert` returned (module docstring): returns the
    `RangeWatch` to read them with.

    Args:
        model: a converted model, either front end (a torch.export front-end model is watched in
            the graphs it has captured and in those it captures later).
        every: record every ``every``-th step (default `DEFAULT_EVERY`, 16; 1: every step).
        history: recorded steps kept apart for `amp_fx.find_overflow` (default `DEFAULT_HISTORY`).
        nodes: "low" (default): nodes computing in float16/bfloat16; "all": float32 ones too.

    Raises TypeError for a model not converted, ValueError for bad arguments or a model already
    watched.

    >>> import torch, amp_fx
    >>> gm = amp_fx.convert(torch.nn.Linear(4, 2), "O2", device_type="cpu")
    >>> with amp_fx.watch(gm, every=2) as ranges:
    ...     for _ in range(3):
    ...         _ = gm(torch.randn(2, 4))
    >>> ranges.steps
    [0, 2]
    """
    graphs = model_graphs(model)  # TypeError for a model not converted
    _count("every", every)
    _count("history", history)
    if nodes not in NODE_CHOICES:
        raise ValueError(f"nodes must be one of {NODE_CHOICES}, got {nodes!r}")
    if model in _WATCHES:
        raise ValueError(
            "this model is watched already: read that watch (amp_fx.watching(model)), or call its "
            "remove() before watching again"
        )
    handle = RangeWatch(model, every, history, nodes)
    for graph in graphs:
        handle._instrument(graph)
    for name, state in capture_states(model):
        hook = functools.partial(handle._instrument_captured, name)
        state.capture_hooks.append(hook)
        handle._hooks.append((state, hook))
    handle._count_steps_by_root()
    follower = model.__dict__.get(FOLLOWER_ATTR)
    if follower is not None:
        handle._follow_rewrites(follower)
        follower.accept(model)  # the recording calls are not a change to follow
    _WATCHES[model] = handle
    logger.info(
        "watching %d nodes of %s in %d graphs, every %d step(s)",
        sum(len(w.slots) for w in handle._watched.values()),
        type(model).__name__,
        len(graphs),
        every,
    )
    return handle


def _count(name: str, value: Any) -> int:
    """``value`` where it is an int >= 1; else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def measure(tensor: torch.Tensor) -> RangeStats:
    """The statistics a watched node records, of one tensor now (reads it on the host).

    >>> measure(torch.tensor([0.0, -2.0, float("nan")], dtype=torch.bfloat16))
    RangeStats(amax=2.0, underflow=0, nonfinite=1, numel=3, dtype=torch.bfloat16)
    """
    amax, counts = torch.zeros(1), torch.zeros(3, dtype=torch.int64)
    kernels_reference.record_range_(tensor.detach().cpu(), amax, counts, 0)
    return RangeStats(float(amax[0]), *(int(c) for c in counts), dtype=tensor.dtype)


def _graphs_of(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """The graphs a graph module runs: its own, and the other mode's where it holds one."""
    graphs = [gm.graph]
    if OTHER_MODE_GRAPH_KEY in gm.meta:
        graphs.append(gm.meta[OTHER_MODE_GRAPH_KEY][1])
    return graphs


def _watches(node: torch.fx.Node, nodes: str) -> bool:
    """Whether `watch` records ``node`` (module docstring: what is watched)."""
    if node.op not in _CALLS or is_range_record(node):
        return False
    info = node_info(node)
    if info.is_cast:
        source = node.args[0] if node.args else None
        if isinstance(source, torch.fx.Node) and source.op == "get_attr":
            return False  # a parameter's cast: the optimizer keeps weights in range
    elif info.op == "getitem":
        # An element of a tuple an op computed (not of a split of a value, which moves values).
        source = node.args[0] if node.args else None
        if not isinstance(source, torch.fx.Node) or node_info(source).op in MOVING_OPS:
            return False
    elif info.op in MOVING_OPS or info.op in NON_TENSOR_METHODS or info.op in BOOL_OPS:
        return False
    if node.op == "call_function" and node.target is getattr:
        return False  # an attribute (x.shape, x.T is a view)
    dtype = info.out_dtype
    allowed = LOW_PRECISION_DTYPES if nodes == "low" else (*LOW_PRECISION_DTYPES, torch.float32)
    return dtype is None or dtype in allowed


def _instrument_graph(graph: torch.fx.Graph, slots: list[tuple[int, torch.fx.Node]]) -> None:
    placeholders = list(graph.find_nodes(op="placeholder"))
    place = graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None)
    with place, warnings.catch_warnings():
        # fx warns of a get_attr of anything but a module, parameter or buffer: the recorder is none.
        warnings.simplefilter("ignore", UserWarning)
        recorder = graph.get_attr(RECORDER_ATTR)
    with graph.inserting_after(recorder):
        begin = graph.call_function(range_begin, (recorder,))
    recorder.meta[RECORD_KEY] = begin.meta[RECORD_KEY] = -1
    kernel_recorded = _kernel_recorded(slots)  # before the records come between an op and its getitems
    for slot, node in slots:
        with graph.inserting_after(node):
            record = graph.create_node(
                "call_function", record_range, (node, begin, slot), name=f"{node.name}_range"
            )
        record.meta[RECORD_KEY] = slot
        node.replace_all_uses_with(record, delete_user_cb=lambda user, record=record: user is not record)
    for fused, outputs in kernel_recorded.items():
        with graph.inserting_before(fused):
            request = graph.call_function(expect_kernel_records, (begin, tuple(outputs)))
        request.meta[RECORD_KEY] = -1


def _kernel_recorded(slots: list[tuple[int, torch.fx.Node]]) -> dict[torch.fx.Node, list[tuple[Any, int]]]:
    """The fused-op calls whose kernels record what they write (`records_in_kernel`), each with
    (position in its result, slot) of its watched outputs: the call itself (position None), or an
    element of the tuple it returns."""
    found: dict[torch.fx.Node, list[tuple[Any, int]]] = {}
    for slot, node in slots:
        fused, position = node, None
        if _is_getitem(node) and isinstance(node.args[0], torch.fx.Node):
            fused, position = node.args
        elif any(_is_getitem(user) for user in node.users):
            continue  # a tuple (its elements are asked for): a slot that never records
        if fused.op == "call_function" and fused.target in KERNEL_RECORDING_OPS:
            found.setdefault(fused, []).append((position, slot))
    return found


def _is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _uninstrument(gm: torch.fx.GraphModule) -> None:
    for graph in _graphs_of(gm):
        records = [node for node in graph.nodes if is_range_record(node)]
        for node in reversed(records):  # users first: the begin node after every record
            if node.meta[RECORD_KEY] >= 0:
                node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    gm.__dict__.pop(RECORDER_ATTR, None)
    gm.recompile()


def _node_ranges(watched: _Watched, amax: torch.Tensor, counts: torch.Tensor) -> list[NodeRange]:
    """One `NodeRange` per watched node name (a node of both mode graphs counts once)."""
    by_name: dict[str, list[int]] = {}
    for slot, node in enumerate(watched.slots):
        by_name.setdefault(node.name, []).append(slot)
    found = []
    for name, slots in by_name.items():
        node = watched.slots[slots[0]]
        dtype = next((watched.recorder.dtypes[s] for s in slots if watched.recorder.dtypes[s]), None)
        dtype = dtype or node_info(node).out_dtype

        def stats(direction: int, slots: list[int] = slots, dtype: Any = dtype) -> RangeStats:
            top = max(float(amax[s, direction]) for s in slots)
            total = [sum(int(counts[s, direction, k]) for s in slots) for k in range(3)]
            return RangeStats(top, *total, dtype=dtype)

        found.append(
            NodeRange(
                graph=watched.graph.label,
                node=name,
                op=node_info(node).op,
                dtype=dtype,
                forward=stats(FORWARD),
                backward=stats(BACKWARD),
                module=_module_of(node, watched.graph),
                source=source_line(node),
            )
        )
    return found


def _module_of(node: torch.fx.Node, graph: ModelGraph) -> str:
    name, _ = calling_module(node, graph.gm)
    parts = [part for part in (graph.module, name or "") if part]
    return ".".join(parts)


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n\s*(?P<code>[^\n]*)')


# Files that are not the user's: torch's and amp_fx's own (the passes and kernels are installed
# from folders of their own).
_LIBRARY_DIRS = tuple(
    os.path.realpath(os.path.dirname(module.__file__)) + os.sep for module in (torch, amp_fx, amp_fx.passes)
)


def source_line(node: torch.fx.Node) -> str | None:
    """``file:line in function: code`` of the innermost frame of the user's code in the node's
    recorded stack trace; for a cast amp_fx inserted, that of the op it casts for, or of its input.
    None where no trace was recorded."""
    for candidate in _trace_candidates(node):
        trace = candidate.meta.get("stack_trace")
        frames = [
            frame
            for frame in (_FRAME.finditer(trace) if trace else ())
            if not os.path.realpath(frame["path"]).startswith(_LIBRARY_DIRS)
        ]
        if frames:
            frame = frames[-1]
            where = f"{frame['path']}:{frame['line']} in {frame['function']}"
            return f"{where}: {frame['code'].strip()}" if frame["code"].strip() else where
    return None


def _trace_candidates(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    yield node
    if node_info(node).is_cast:
        yield from (user for user in node.users if not is_range_record(user))
        for user in node.users:
            if is_range_record(user):
                yield from user.users
        yield from (arg for arg in node.all_input_nodes if not is_range_record(arg))
