"""`amp_fx.capture.traced_state` records the traced code's grad-mode regions and random draws,
and nothing of other code that runs during the trace.

Its patches of torch are the whole process's while a trace runs. Other code that runs meanwhile
(a finalizer of the garbage collector, here the generator of a ``@torch.no_grad()`` function left
suspended, as torch's OpInfo ``sample_inputs`` generators are by tests that take their first
sample; another thread) must neither land in the graph nor be disturbed. The reference is the
same forward traced with no other code running.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest
import torch
import torch.fx
from torch import nn

from amp_fx.capture.traced_state import recording_grad_modes, recording_random_factories


@torch.no_grad()
def _samples():
    yield 1
    yield 2


def _suspended_generator_in_a_cycle() -> None:
    """Leave unreachable, for the collector alone to free, a generator suspended at its first
    yield: closing it enters ``no_grad()`` (torch's wrapper of a decorated generator)."""
    cycle: dict[str, object] = {"generator": _samples()}
    cycle["self"] = cycle
    next(cycle["generator"])


class Frozen(nn.Module):
    """A forward with a grad-mode region of its own; ``during`` runs other code in the middle."""

    def __init__(self, during: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.during = during

    def forward(self, x):
        with torch.no_grad():
            y = x * 2
        self.during()
        return x + y + torch.rand(())


def _targets(module: nn.Module) -> list[str]:
    tracer = torch.fx.Tracer()
    with recording_grad_modes(tracer), recording_random_factories(tracer):
        graph = tracer.trace(module)
    return [getattr(node.target, "__name__", node.target) for node in graph.nodes]


def test_a_region_a_finalizer_enters_during_the_trace_is_not_recorded() -> None:
    gc.disable()  # the collection happens in the forward, not before
    try:
        _suspended_generator_in_a_cycle()
        targets = _targets(Frozen(during=gc.collect))
    finally:
        gc.enable()
    assert targets == _targets(Frozen())
    assert torch.is_grad_enabled()


def test_regions_and_draws_of_another_thread_during_the_trace_are_not_recorded() -> None:
    drawn = []

    def elsewhere() -> None:
        with torch.no_grad():
            drawn.append(torch.rand(()))

    def on_a_thread() -> None:
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()

    assert _targets(Frozen(during=on_a_thread)) == _targets(Frozen())
    assert [type(value) for value in drawn] == [torch.Tensor]


class _FailingRecords(torch.fx.Tracer):
    """A tracer that cannot record a grad-mode region (torch.fx's own ``create_node`` raised so in
    the middle of importing torch.export)."""

    def create_node(self, kind, target, *args, **kwargs):
        if target is torch.is_grad_enabled:
            raise RuntimeError("cannot record")
        return super().create_node(kind, target, *args, **kwargs)


def test_a_region_that_cannot_be_recorded_leaves_the_grad_mode_as_it_was() -> None:
    tracer = _FailingRecords()
    with pytest.raises(RuntimeError, match="cannot record"), recording_grad_modes(tracer):
        tracer.trace(Frozen())
    assert torch.is_grad_enabled()
