"""Python state a capture cannot record: found while a front end captures, reported once.

A graph records tensor ops. What a forward does in plain Python runs once, while torch.fx traces or
torch.export captures, and its result is frozen into the graph: a layer-drop decided with
``random.random()``, a value read from ``time``, an attribute assigned in forward
(``self.step = self.step + 1`` on an int, ``self.last = x.shape[0]``). `watching_python_state`
is entered around a capture: it records each such call made by code outside torch, amp_fx and
Python's own library (so torch's timing of itself or ``logging``'s time stamps are not counted),
and each such assignment made by the model's own code, not an installed package's (a library's
one-time setup is not a frozen decision), with the source line; on exit it puts every attribute
it recorded back as it was, so a capture leaves the model as it found it. `report` logs the
findings of a model once, each with its line and its fix.

    >>> import random
    >>> class Drop(nn.Module):
    ...     def forward(self, x):
    ...         self.calls = getattr(self, "calls", 0) + 1
    ...         return x if random.random() < 0.5 else 2 * x
    >>> model = Drop()
    >>> with watching_python_state(model) as findings:
    ...     _ = model(torch.ones(1))
    >>> sorted(f.kind for f in findings), hasattr(model, "calls")
    (['attribute', 'random'], False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import random
import sys
import sysconfig
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch  # noqa: F401  (the examples' namespace)
from torch import nn

from amp_fx.capture.torch_source import TORCH_DIR, location

logger = logging.getLogger(__name__)

__all__ = ["Finding", "watching_python_state", "report", "is_library_file"]

_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep


def _package_dirs(*names: str) -> set[str]:
    """The folders of amp_fx's packages, as paths and resolved: an editable install maps
    amp_fx.passes and amp_fx.kernels to folders beside amp_fx/, next to the user's own code."""
    dirs = set()
    for name in names:
        for folder in importlib.util.find_spec(name).submodule_search_locations:
            dirs |= {os.path.abspath(folder) + os.sep, os.path.realpath(folder) + os.sep}
    return dirs


_LIBRARY_DIRS = tuple({TORCH_DIR} | _package_dirs("amp_fx", "amp_fx.passes", "amp_fx.kernels"))
_INSTALLED = ("site-packages", "dist-packages")
# Code made at run time by Python's import system and by torch.fx (a GraphModule's forward); a
# notebook's cell or a doctest ("<ipython-input-1-...>", "<doctest ...>") is the user's.
_GENERATED = ("<frozen ", "<eval_with_key>")

# What each kind of finding is, and what to write instead.
_FIXES = {
    "random": (
        "draw it with torch instead (torch.rand(()) < p, torch.randint, torch.randperm): a graph "
        "records torch's random ops and draws anew on every call"
    ),
    "time": (
        "a graph runs no Python: read the time outside the model's forward, or pass it in as a "
        "tensor argument"
    ),
    "attribute": (
        "keep state that changes per call in a buffer updated in place (self.register_buffer("
        "'{name}', torch.zeros(())) in __init__, then self.{name} += 1 or self.{name}.copy_(value)), "
        "or compute the value outside forward"
    ),
}

# The functions of these modules a forward might call whose result a graph freezes.
_RANDOM_FUNCTIONS = (
    "random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle", "gauss",
    "normalvariate", "lognormvariate", "expovariate", "betavariate", "gammavariate", "triangular",
    "vonmisesvariate", "paretovariate", "weibullvariate", "getrandbits", "randbytes", "binomialvariate",
)  # fmt: skip
_TIME_FUNCTIONS = (
    "time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
    "process_time", "process_time_ns", "thread_time", "thread_time_ns",
)  # fmt: skip
_NUMPY_RANDOM_FUNCTIONS = (
    "random", "rand", "randn", "randint", "uniform", "normal", "choice", "permutation", "shuffle",
    "random_sample", "binomial", "beta", "exponential", "poisson", "standard_normal", "integers",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing a capture ran in Python and froze: ``kind`` ("random", "time" or "attribute"),
    ``what`` (``random.random()``, ``Model.step``), ``where`` (``path:line``) and ``source``."""

    kind: str
    what: str
    where: str
    source: str

    @property
    def fix(self) -> str:
        return _FIXES[self.kind].format(name=self.what.rpartition(".")[2])

    def __str__(self) -> str:
        if self.kind == "attribute":
            head = f"{self.where}: `{self.source}` assigns {self.what} once, at capture, not per call"
        else:
            head = f"{self.where}: `{self.source}` calls {self.what}, whose result the graph freezes"
        return f"{head}; fix: {self.fix}"


def is_library_file(filename: str) -> bool:
    """True for code of torch, amp_fx and Python's own library: what they call or assign while a
    model is captured is their business, not the model's (torch times itself, ``logging`` stamps
    records with ``time.time()``)."""
    if filename.startswith(_LIBRARY_DIRS) or filename.startswith(_GENERATED):
        return True
    return filename.startswith(_STDLIB_DIR) and not any(part in filename for part in _INSTALLED)


def _is_model_code(filename: str) -> bool:
    """True for code whose attribute writes are the model's own: not a library's, and not an
    installed package's. An installed library's forward sets up state once on purpose
    (transformers marks the output-capturing hooks it installed): putting that back would undo
    the setup, so the next call would install the hooks again."""
    return not is_library_file(filename) and not any(part in filename for part in _INSTALLED)


def _caller(depth: int) -> types.FrameType | None:
    """The frame that called the code ``depth`` frames up, or None where it is library code."""
    frame: types.FrameType | None = sys._getframe(depth + 1)
    if frame is None or is_library_file(frame.f_code.co_filename):
        return None
    return frame


class _Watch:
    """What one `watching_python_state` block has seen, on the thread that captures."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.thread = threading.get_ident()
        self.modules = {id(m): m for m in modules}
        self.findings: list[Finding] = []
        # (module id, attribute) assigned by code outside the libraries -> (module, value before),
        # and -> (where, source line, value) of its last assignment.
        self.assigned: dict[tuple[int, str], tuple[nn.Module, Any]] = {}
        self.last: dict[tuple[int, str], tuple[str, str, Any]] = {}
        self.seen: set[tuple[str, str, str]] = set()

    def add(self, kind: str, what: str, where: str, source: str) -> None:
        if (kind, what, where) not in self.seen:
            self.seen.add((kind, what, where))
            self.findings.append(Finding(kind, what, where, source))


_WATCHES: list[_Watch] = []


def _recording(kind: str, what: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        watch = _WATCHES[-1] if _WATCHES else None
        if watch is not None and watch.thread == threading.get_ident():
            frame = _caller(1)
            if frame is not None:
                watch.add(kind, what, *location(frame))
        return function(*args, **kwargs)

    recorded.__wrapped_by_amp_fx__ = function  # type: ignore[attr-defined]
    return recorded


def _patches() -> list[tuple[Any, str, str, str]]:
    """(owner, attribute, kind, shown name) of every function `watching_python_state` records."""
    found = [(random, name, "random", f"random.{name}()") for name in _RANDOM_FUNCTIONS]
    # A user's own generator (random.Random(seed)) looks its methods up on the class.
    found += [(random.Random, name, "random", f"random.Random.{name}()") for name in _RANDOM_FUNCTIONS]
    found += [(time, name, "time", f"time.{name}()") for name in _TIME_FUNCTIONS]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        found += [(numpy_random, n, "random", f"numpy.random.{n}()") for n in _NUMPY_RANDOM_FUNCTIONS]
    return [(owner, name, kind, what) for owner, name, kind, what in found if hasattr(owner, name)]


def _recording_setattr(original: Callable[..., None]) -> Callable[..., None]:
    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        watch = _WATCHES[-1] if _WATCHES else None
        if watch is not None and id(self) in watch.modules and watch.thread == threading.get_ident():
            frame: types.FrameType | None = sys._getframe(1)
            while frame is not None and frame.f_code.co_name == "__setattr__":  # subclasses', amp_fx's
                frame = frame.f_back
            is_plain = name not in _BOOKKEEPING and not any(name in vars(self)[key] for key in _BOOKKEEPING)
            if frame is not None and is_plain and _is_model_code(frame.f_code.co_filename):
                watch.assigned.setdefault((id(self), name), (self, vars(self).get(name, _MISSING)))
                watch.last[(id(self), name)] = (*location(frame), value)
        original(self, name, value)

    return __setattr__


_BOOKKEEPING = ("_parameters", "_buffers", "_modules")
_MISSING = object()


def _unchanged(before: Any, after: Any) -> bool:
    if before is after:
        return True
    plain = (int, float, complex, str, bytes, bool, type(None))
    return type(before) is type(after) and isinstance(before, plain) and before == after


def _restore(watch: _Watch) -> None:
    """Report each plain attribute code outside the libraries assigned a new value, and put its
    value from before the capture back (also where torch.export put it back itself: the value a
    call assigns is what is lost). Parameters, buffers and submodules are the front ends'."""
    for key, (module, before) in watch.assigned.items():
        where, source, value = watch.last[key]
        name = key[1]
        if _unchanged(before, value):
            continue
        watch.add("attribute", f"{type(module).__name__}.{name}", where, source)
        if before is _MISSING:
            vars(module).pop(name, None)
        else:
            vars(module)[name] = before


@contextlib.contextmanager
def watching_python_state(model: nn.Module) -> Iterator[list[Finding]]:
    """While open, record calls of Python's ``random`` and ``time`` (and ``numpy.random`` where
    loaded) and attribute assignments on ``model``'s modules made by code outside the libraries;
    on exit put those attributes back as they were. Yields the list of `Finding` it fills on exit.

    Calls bound before the block (``from random import random``) are not seen: they do not look
    the function up on its module.
    """
    modules = list(model.modules())
    watch = _Watch(modules)
    patched = [(owner, name, getattr(owner, name)) for owner, name, _, _ in _patches()]
    original_setattr = nn.Module.__setattr__
    try:
        for (owner, name, kind, what), (_, _, function) in zip(_patches(), patched, strict=True):
            setattr(owner, name, _recording(kind, what, function))
        nn.Module.__setattr__ = _recording_setattr(original_setattr)  # type: ignore[method-assign]
        _WATCHES.append(watch)
        yield watch.findings
    finally:
        _WATCHES.remove(watch)
        nn.Module.__setattr__ = original_setattr  # type: ignore[method-assign]
        for owner, name, function in patched:
            setattr(owner, name, function)
        _restore(watch)


# Per model, the lines reported already: each is reported once, not at every capture.
_REPORTED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def report(model: nn.Module, findings: list[Finding], front_end: str) -> None:
    """Log one warning naming each finding not reported for ``model`` before (line and fix)."""
    reported = _REPORTED.setdefault(model, set())
    new = [f for f in findings if str(f) not in reported]
    if not new:
        return
    reported.update(str(f) for f in new)
    lines = "\n".join(f"  - {f}" for f in new)
    logger.warning(
        "%s: %s captured Python that runs once, at capture, and never again: every call of the "
        "converted model repeats what it did then.\n%s",
        type(model).__name__,
        front_end,
        lines,
    )
