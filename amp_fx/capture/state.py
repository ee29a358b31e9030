"""What the torch.export front end keeps on a captured module, and the journal that makes a call's
captures transactional (`amp_fx.capture.captured_model`).

>>> state = CaptureState(policy=None)
>>> state.graphs, state.islands
([], {})
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.core.policy import Policy

__all__ = [
    "EXPORTING",
    "JOURNALS",
    "STATE_ATTR",
    "CaptureState",
    "Journal",
    "attached_state",
    "capture_states",
    "record",
]

# The attribute of a captured module's __dict__ holding its `CaptureState`.
STATE_ATTR = "_amp_fx_capture"


@dataclasses.dataclass
class CaptureState:
    """What the torch.export front end keeps on each captured module (read by `amp_fx.capture_summary`)."""

    policy: Policy
    graphs: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    # Argument structure (see `_structure`) -> why calls of that structure run in an island.
    islands: dict[tuple[Any, ...], str] = dataclasses.field(default_factory=dict)
    # The model's parameters not stored yet (`amp_fx.capture.storage`): one list, shared by the
    # states of a converted model and its captured parts.
    unstored: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # The model as its graphs were captured (`amp_fx.capture.changes.Watch`); None until the first
    # call. A call on a model changed since drops the graphs and captures again.
    watch: Any = None
    # Called with each graph this module captures, once it is rewritten, before it runs (how
    # `amp_fx.watch` instruments graphs captured after it was called); not copied with the model.
    capture_hooks: list[Callable[[torch.fx.GraphModule], None]] = dataclasses.field(default_factory=list)

    def __deepcopy__(self, memo: dict[int, Any]) -> CaptureState:
        # Graphs hold the model's tensors; a copy of the model captures its own. Through ``memo``
        # the copy's list is one list again, of the copy's parameters.
        unstored = copy.deepcopy(self.unstored, memo)
        return CaptureState(self.policy, islands=dict(self.islands), unstored=unstored)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled without graphs, as deep-copied: they are captured again at the next call.
        return {"policy": self.policy, "islands": dict(self.islands), "unstored": self.unstored}

    def __setstate__(self, values: dict[str, Any]) -> None:
        values.pop("called", None)  # kept by pickles of an earlier version
        self.__init__(**values)  # type: ignore[misc]


class Journal:
    """What one eager call changed in the capture state, undone if the call fails.

    Capture is transactional: a call that raises (a typo'd keyword, float token ids) and a call
    on fake tensors (someone else's torch.export of the model) leave every module's graphs,
    islands and class as they were. Nested calls hand their changes to the enclosing call's
    journal; the outermost one logs the islands made, as one notice.
    """

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.islands: list[tuple[nn.Module, str]] = []

    def rollback(self) -> None:
        for action in reversed(self.undo):
            action()

    def merge_into(self, outer: Journal) -> None:
        outer.undo += self.undo
        outer.islands += self.islands


# Open journals of the eager calls in progress, innermost last; and whether one of our own
# torch.export captures is running (then captured descendants run their own code, so the graph
# being captured records it and no graph is captured on the capture's fake tensors).
JOURNALS: list[Journal] = []
EXPORTING: list[bool] = []


def record(undo: Callable[[], None]) -> None:
    """Add ``undo`` to the journal of the eager call in progress (none: nothing to undo)."""
    if JOURNALS:
        JOURNALS[-1].undo.append(undo)


def attached_state(module: nn.Module) -> CaptureState | None:
    """The module's own `CaptureState`; None for a module the front end does not capture."""
    return module.__dict__.get(STATE_ATTR)


def capture_states(model: nn.Module) -> list[tuple[str, CaptureState]]:
    """(qualified name, its `CaptureState`) for ``model`` and each descendant the torch.export front
    end captures, in ``named_modules`` order; empty for a model of the torch.fx front end."""
    return [
        (name, module.__dict__[STATE_ATTR])
        for name, module in model.named_modules()
        if STATE_ATTR in module.__dict__
    ]
