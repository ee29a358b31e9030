"""Recording value ranges in a converted graph: what `amp_fx.watch` puts into it, and the
statistics the recorded values accumulate into on the device.

A watched graph begins with a call of `range_begin` and holds, after each node it watches, a call
of `record_range` that returns the node's value unchanged (the same tensor, or a detached alias
whose backward records the gradient flowing back through it and passes it on unchanged), so the
graph computes the same bits as without it::

    ranges = amp_fx_ops_range_record_range_begin(self._amp_fx_ranges)
    fc = self.fc(x_to_float16)
    fc_range = amp_fx_ops_range_record_record_range(fc, ranges, 0)

Each record is one launch of ``amp_fx.kernels`` ``record_range_`` (Triton on CUDA, its torch
reference elsewhere) into the statistics row of the step in progress: the largest magnitude, and
the counts of underflowing values (non-zero, below the dtype's smallest normal), of inf and NaN
values and of all values, per watched node, for the forward value and for its gradient. Nothing is
read on the host while the model runs.

What the recorders of one model share is a `RangeClock`: which steps record, the steps still in
its history, and the order each recorded step's records ran in (kept on the host: it is known
there without reading the device). A step begins at each call of the model's own graph (a "root"
graph); for a model whose own call runs no watched graph (a torch.export front-end model whose
top module is an island), a step begins at the first graph call after a backward.

A fused op of ours whose kernel writes the watched value records it in that kernel instead, in
the same launch (the kernel families' ``record=`` argument, ``amp_fx.kernels.range_stats``): the
graph calls `expect_kernel_records` right before the op, the op asks `kernel_record` for the
argument to pass its kernel, and the `record_range` after it then records only the gradient (and
keeps the order). An op that runs no kernel of ours for that call (its torch expression) takes no
request, and `record_range` records its value as any node's. The ops whose kernels do so are
registered with `records_in_kernel`.

This module is the runtime half; `amp_fx.inspect.ranges` inserts the calls and reads the
statistics.

Example:
    >>> clock = RangeClock(every=1, history=2)
    >>> recorder = RangeRecorder(clock, size=1, root=True, low_only=True)
    >>> x = torch.tensor([1e-6, 3.0], dtype=torch.float16, requires_grad=True)
    >>> y = record_range(x, range_begin(recorder), 0)
    >>> y.sum().backward()
    >>> amax, counts = recorder.totals()
    >>> amax[0].tolist(), counts[0].tolist()
    ([3.0, 1.0], [[1, 0, 2], [0, 0, 2]])
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.kernels import implementation_for
from amp_fx.kernels.range_stats import COUNT_FIELDS, KernelRecord

__all__ = [
    "BACKWARD",
    "FORWARD",
    "KERNEL_RECORDING_OPS",
    "RangeClock",
    "RangeRecorder",
    "expect_kernel_records",
    "kernel_record",
    "range_begin",
    "record_range",
    "records_in_kernel",
]

# The two directions each watched node records: its value, and the gradient flowing back to it.
FORWARD, BACKWARD = 0, 1
# The dtypes a record reads (float64 values are not watched: nothing rounds them low).
_RECORDED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# The clock and the recorders have no ``__dict__`` (slots): a converted model holds its recorders,
# and `amp_fx.capture.changes` compares the ``__dict__`` of plain objects a model holds to see
# changes, which a record, changing these every step, is not.
@dataclasses.dataclass(slots=True)
class RangeClock:
    """The steps of one watched model: which record (every ``every``-th, counted from the first),
    and for the last ``history`` recorded ones, the statistics row each went to and the order its
    records ran in (entries ``(recorder, slot, direction)``, each once, at its first record)."""

    every: int
    history: int
    step: int = -1
    recording: bool = False
    paused: bool = False
    # No root graph is watched: steps are told apart by the backward, which then records always.
    tracks_backward: bool = False
    in_backward: bool = False
    recorded_steps: int = 0
    # Row (1..history) -> the step it holds, and that step's records in the order they ran.
    row_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    order: dict[int, dict[tuple[Any, int, int], None]] = dataclasses.field(default_factory=dict)

    @property
    def row(self) -> int:
        """The statistics row of the step in progress (row 0 holds older steps' totals)."""
        return 1 + (self.recorded_steps - 1) % self.history

    def begin(self, root: bool) -> None:
        """A watched graph is called: a new step where it is the model's own graph, or where a
        backward ran since the last step began."""
        if not (root or self.in_backward or self.step < 0):
            return
        self.step += 1
        self.in_backward = False
        self.recording = not self.paused and self.step % self.every == 0
        if self.recording:
            self.recorded_steps += 1
            self.row_steps[self.row] = self.step
            self.order[self.row] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Pickled without its history (the recorders pickle without statistics).
        state = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**state, "order": {}, "row_steps": {}, "recorded_steps": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def reset(self) -> None:
        """Forget the recorded steps (their statistics are zeroed by each recorder's `reset`)."""
        self.recorded_steps = 0
        self.row_steps.clear()
        self.order.clear()
        self.recording = False


class RangeRecorder:
    """The statistics of one watched graph: per device, ``amax`` (float32) and ``counts`` (int64,
    `COUNT_FIELDS` per entry) of shapes ``[1 + history, size, 2]`` and ``[1 + history, size, 2,
    3]``, indexed by row, slot (the watched node) and direction (`FORWARD`, `BACKWARD`). Row ``r``
    of 1..history holds the step ``clock.row_steps[r]``; a row is folded into row 0 when a later
    step takes it, so that the totals since the watch began are the reduction over all rows.

    ``low_only`` records fp16 and bf16 values only (a node whose dtype the graph does not know
    is checked at run time); otherwise float32 values too. ``dtypes[slot]`` is the dtype the slot
    recorded last."""

    __slots__ = ("clock", "size", "root", "low_only", "dtypes", "buffers", "_row_steps", "_rows")

    def __init__(self, clock: RangeClock, size: int, root: bool, low_only: bool) -> None:
        self.clock = clock
        self.size = size
        self.root = root
        self.low_only = low_only
        self.dtypes: list[torch.dtype | None] = [None] * size
        self.buffers: dict[torch.device, tuple[Tensor, Tensor]] = {}
        # (device, row) -> the step the row holds on that device.
        self._row_steps: dict[tuple[torch.device, int], int] = {}
        # (device, row) -> that row's (amax, counts) views, while it holds the step above.
        self._rows: dict[tuple[torch.device, int], tuple[Tensor, Tensor]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> RangeRecorder:
        # A copy of the watched model records apart from it, with a clock of its own.
        clock = memo.get(id(self.clock))
        if clock is None:
            clock = memo[id(self.clock)] = dataclasses.replace(self.clock, order={}, row_steps={})
        copied = RangeRecorder(clock, self.size, self.root, self.low_only)
        copied.dtypes = list(self.dtypes)
        return copied

    def __getstate__(self) -> dict[str, Any]:
        # Pickled without statistics: a loaded model records from its first step.
        return {"clock": self.clock, "size": self.size, "root": self.root, "low_only": self.low_only}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def wants(self, value: Any) -> bool:
        """Whether ``value`` is a tensor this recorder records."""
        return isinstance(value, Tensor) and self.wants_dtype(value.dtype)

    def wants_dtype(self, dtype: torch.dtype) -> bool:
        """Whether this recorder records values of ``dtype``."""
        return dtype in (LOW_PRECISION_DTYPES if self.low_only else _RECORDED_DTYPES)

    def record(self, value: Tensor, slot: int, direction: int) -> None:
        """Accumulate ``value``'s statistics into the row of the step in progress (unless the
        kernel that wrote it did: `expect_kernel_records`)."""
        clock = self.clock
        if direction == BACKWARD:
            clock.in_backward = True
        if not clock.recording:
            return
        self.dtypes[slot] = value.dtype
        if direction == BACKWARD or not _recorded_by_kernel(self, slot):
            amax, counts = self.step_row(value.device)
            # No detach: neither kernel records autograd (the reference runs under no_grad).
            implementation_for((value,)).record_range_(value, amax, counts, 2 * slot + direction)
        clock.order[clock.row].setdefault((self, slot, direction), None)

    def step_row(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The (amax, counts) views, on ``device``, of the row of the step in progress, where each
        record of the step adds: ``[size, 2]`` and ``[size, 2, 3]``, entry ``2 * slot + direction``."""
        return self._row(device, self.clock.row, self.clock.step)

    def _row(self, device: torch.device, row: int, step: int) -> tuple[Tensor, Tensor]:
        if device not in self.buffers:
            rows = 1 + self.clock.history
            self.buffers[device] = (
                torch.zeros(rows, self.size, 2, device=device),
                torch.zeros(rows, self.size, 2, len(COUNT_FIELDS), dtype=torch.int64, device=device),
            )
        amax, counts = self.buffers[device]
        key = (device, row)
        if self._row_steps.get(key) != step:
            # The row held an older step: fold it into the totals, then start this one at zero.
            torch.maximum(amax[0], amax[row], out=amax[0])
            counts[0].add_(counts[row])
            amax[row].zero_()
            counts[row].zero_()
            self._row_steps[key] = step
            # Every record of the step writes into these views: made once a step, not per record.
            self._rows[key] = (amax[row], counts[row])
        return self._rows[key]

    def step_statistics(self, row: int) -> tuple[Tensor, Tensor] | None:
        """(amax ``[size, 2]``, counts ``[size, 2, 3]``) on the CPU that row ``row`` recorded for the
        step the clock says it holds, summed over devices; None where this recorder recorded
        nothing in that step. Reads the device (a host sync)."""
        step = self.clock.row_steps.get(row)
        parts = [
            (amax[row].cpu(), counts[row].cpu())
            for device, (amax, counts) in self.buffers.items()
            if step is not None and self._row_steps.get((device, row)) == step
        ]
        return _combined(parts)

    def totals(self) -> tuple[Tensor, Tensor]:
        """(amax ``[size, 2]``, counts ``[size, 2, 3]``) on the CPU over every recorded step since
        the watch began or was reset, summed over devices. Reads the device (a host sync)."""
        parts = [(amax.amax(0).cpu(), counts.sum(0).cpu()) for amax, counts in self.buffers.values()]
        combined = _combined(parts)
        if combined is None:
            return torch.zeros(self.size, 2), torch.zeros(self.size, 2, len(COUNT_FIELDS), dtype=torch.int64)
        return combined

    def reset(self) -> None:
        """Zero every statistic (the next record starts afresh)."""
        for amax, counts in self.buffers.values():
            amax.zero_()
            counts.zero_()
        self._row_steps.clear()
        self._rows.clear()


def _combined(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor] | None:
    if not parts:
        return None
    amax = torch.stack([part[0] for part in parts]).amax(0)
    counts = torch.stack([part[1] for part in parts]).sum(0)
    return amax, counts


class _RecordRange(torch.autograd.Function):
    """Records the value in the forward and the gradient in the backward; passes both on as they
    are. The forward returns a detached alias of the value (no copy): autograd then lets a later
    in-place op modify it, as it may modify the value itself in the graph without the recorder."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, recorder: RangeRecorder, slot: int) -> Tensor:
        recorder.record(value, slot, FORWARD)
        ctx.recorder, ctx.slot = recorder, slot
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, None, None]:
        if grad is not None and ctx.recorder.wants(grad):
            ctx.recorder.record(grad, ctx.slot, BACKWARD)
        return grad, None, None


# --- recording inside a fused op's kernel ---------------------------------------------------------

# The fused-op functions (as graphs call them) whose kernels record their outputs when asked.
KERNEL_RECORDING_OPS: set[Callable[..., Any]] = set()


def records_in_kernel(*functions: Callable[..., Any]) -> None:
    """Register fused-op functions that take `kernel_record`'s request for their kernels: the
    watch then asks them (`expect_kernel_records`) instead of recording their outputs apart."""
    KERNEL_RECORDING_OPS.update(functions)


@dataclasses.dataclass(slots=True)
class _KernelRequest:
    """What `expect_kernel_records` asked of the fused op the graph calls next."""

    recorder: RangeRecorder
    # The watched outputs: position in the op's result (None: the result itself) -> slot.
    slots: dict[int | None, int]
    taken: bool = False
    recorded: set[int] = dataclasses.field(default_factory=set)


# The request of the fused op running on this thread (graphs run on the thread that calls them).
_requests = threading.local()


def expect_kernel_records(recorder: RangeRecorder | None, slots: tuple[tuple[int | None, int], ...]) -> None:
    """Called by a watched graph right before a fused op registered with `records_in_kernel`:
    where this call records, asks the op's kernel to record the outputs ``slots`` names
    (``(position in the op's result, slot)``; position None: the result itself).

    Example:
        >>> recorder = RangeRecorder(RangeClock(every=1, history=1), size=1, root=True, low_only=True)
        >>> expect_kernel_records(range_begin(recorder), ((None, 0),))
        >>> amax, counts, indices = kernel_record(torch.device("cpu"), [(None, torch.float16)])
        >>> indices, amax.shape
        ((0,), torch.Size([1, 2]))
    """
    if recorder is None or not recorder.clock.recording:
        _requests.pending = None
        return
    _requests.pending = _KernelRequest(recorder, dict(slots))


def kernel_record(
    device: torch.device, outputs: Sequence[tuple[int | None, torch.dtype] | None]
) -> KernelRecord | None:
    """The ``record`` argument for the kernel a fused op is about to launch on ``device``, or None
    where nothing asked (the usual case) or none of its outputs is watched. ``outputs``: per value
    the kernel writes, in its contract's order, its position in the op's result (None: the result
    itself) and its dtype; None for a value this call does not write. A request is taken once.

    Example:
        >>> kernel_record(torch.device("cpu"), [(None, torch.float16)]) is None
        True
    """
    request = getattr(_requests, "pending", None)
    if request is None or request.taken:
        return None
    request.taken = True
    recorder = request.recorder
    indices: list[int | None] = []
    for output in outputs:
        slot = None if output is None else request.slots.get(output[0])
        if slot is None or not recorder.wants_dtype(output[1]):
            indices.append(None)
            continue
        request.recorded.add(slot)
        indices.append(2 * slot + FORWARD)
    if not request.recorded:
        return None
    amax, counts = recorder.step_row(device)
    return amax, counts, tuple(indices)


def _recorded_by_kernel(recorder: RangeRecorder, slot: int) -> bool:
    """Whether the kernel that wrote ``slot``'s value recorded it (and forget it: once a step)."""
    request = getattr(_requests, "pending", None)
    if request is None or request.recorder is not recorder or slot not in request.recorded:
        return False
    request.recorded.discard(slot)
    if not request.recorded:
        _requests.pending = None
    return True


def range_begin(recorder: RangeRecorder) -> RangeRecorder | None:
    """Called first by a watched graph: tells the clock a graph began, and returns the recorder
    where this call records (or must see its backward), else None.

    Example:
        >>> recorder = RangeRecorder(RangeClock(every=2, history=1), size=1, root=True, low_only=True)
        >>> [range_begin(recorder) is recorder for _ in range(3)]
        [True, False, True]
    """
    clock = recorder.clock
    clock.begin(recorder.root)
    _requests.pending = None  # none left over from a graph that stopped early
    return recorder if clock.recording or clock.tracks_backward else None


def record_range(value: Any, recorder: RangeRecorder | None, slot: int) -> Any:
    """``value``, with its statistics recorded in ``slot`` (and its gradient's, in the backward)
    where ``recorder`` (`range_begin`'s answer) records this call and ``value`` is a tensor of a
    recorded dtype; else ``value`` itself.

    Example:
        >>> x = torch.ones(2)
        >>> record_range(x, None, 0) is x
        True
    """
    request = getattr(_requests, "pending", None)
    if request is not None:
        request.taken = True  # the op ran: no later op may take its request
        if not request.recorded:
            _requests.pending = None  # nothing left to tell (and the recorder is not held)
    if recorder is None or not recorder.wants(value):
        return value
    return _RecordRange.apply(value, recorder, slot)
