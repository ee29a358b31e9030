"""Run amp_fx's fused functions on the path torch.compile takes, without compiling.

amp_fx's fused ops pick their implementation from how they are called (`amp_fx.ops.dispatch`): plain
eager tensors take one path, tracers (dispatch modes, fake or functional tensors) the custom ops.
A dispatch mode that runs every op as is makes a call take the tracer path with real tensors, so
tests can check the op torch.compile will run, bit for bit, in eager time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class PassThroughMode(TorchDispatchMode):
    """Runs every op unchanged; while active, amp_fx's fused functions take their tracer path."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def as_traced(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` called under `PassThroughMode` (its backward runs as recorded there)."""

    def traced(*args: Any, **kwargs: Any) -> Any:
        with PassThroughMode():
            return function(*args, **kwargs)

    return traced
