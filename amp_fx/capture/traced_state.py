"""What a forward changes, recorded by torch.fx: updates of its buffers and the grad mode.

torch.fx reads a buffer as a constant and runs Python for real, so out of the box a forward's
``self.count += 1`` runs once, while tracing, on the buffer of the traced copy, and a
``with torch.no_grad():`` region is not in the graph at all. Here:

* `StateUpdates` finds each buffer a trace updates (in place, or by assigning it) and puts its
  value back; `amp_fx.capture.fx` then traces again with those buffers read as graph values
  (``get_attr``), so their updates are graph ops on the module's own buffers, every call. An
  assignment ``self.buf = value`` becomes ``self.buf.copy_(value)`` (as torch.export records it).
  An update the graph cannot hold (a tensor attribute that is not a buffer, a buffer reached some
  other way than ``self.name``) raises `UnrecordedUpdate`, naming it and the fix.
* `recording_random_factories` records ``torch.rand(())`` and torch's other random factories as
  graph ops, also where no argument is traced (torch.fx would draw once, at trace time).
* `recording_grad_modes` records ``torch.no_grad()``, ``torch.enable_grad()`` and
  ``torch.set_grad_enabled(mode)`` regions as torch.export's graphs hold them after
  `amp_fx.capture.export` inlines them: ``torch._C._set_grad_enabled(mode)`` and, at the end, the
  mode read with ``torch.is_grad_enabled()`` at the start.

Both patch torch for the whole process while a trace runs, so they record only the traced code's
own calls (`TracedCode`): another thread's, or those of a finalizer the garbage collector runs in
the middle of the trace (a suspended generator of a ``@torch.no_grad()`` function, closed there
under its own ``no_grad()``), run as they would without the trace.

    >>> class Frozen(nn.Module):
    ...     def forward(self, x):
    ...         with torch.no_grad():
    ...             y = x * 2
    ...         return x + y
    >>> tracer = torch.fx.Tracer()
    >>> with recording_grad_modes(tracer):
    ...     graph = tracer.trace(Frozen())
    >>> [getattr(n.target, "__name__", n.target) for n in graph.nodes]
    ['x', 'is_grad_enabled', '_set_grad_enabled', 'mul', '_set_grad_enabled', 'add', 'output']
"""

from __future__ import annotations

import contextlib
import gc
import operator
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.autograd import grad_mode

__all__ = [
    "StateUpdates",
    "TracedCode",
    "UnrecordedUpdate",
    "drop_empty_grad_regions",
    "recording_grad_modes",
    "recording_random_factories",
]

# torch's functions that draw random numbers from sizes alone: with no traced argument torch.fx
# would run them once, at trace time, and every call would reuse that draw.
_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson")


class UnrecordedUpdate(TypeError):
    """A forward updates state that a torch.fx graph cannot update on each call."""


def _tensors(root: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """Every tensor ``root``'s modules hold, by (qualified module name, attribute): parameters,
    buffers and plain tensor attributes (a cache a forward might update in place)."""
    found: dict[tuple[str, str], torch.Tensor] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for name, value in (*module._parameters.items(), *module._buffers.items(), *vars(module).items()):
            if isinstance(value, torch.Tensor):
                found.setdefault((path, name), value)
    return found


def _qualified(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class StateUpdates:
    """The buffers the forward of ``root`` (a copy of ``model``) updates, found trace by trace.

    Before a trace `StateUpdates` notes each tensor of ``root`` and its version; `check` after it
    names the buffers updated since, puts the values of ``model`` back into them, and raises
    `UnrecordedUpdate` for an update a graph would lose."""

    def __init__(self, root: nn.Module, model: nn.Module) -> None:
        self.root = root
        self.model = model
        self.stateful: dict[int, str] = {}  # id -> qualified name, the tracer's `stateful`
        self.assigned: set[str] = set()  # buffers assigned since the last `check`
        self.before = {key: (t, t._version) for key, t in _tensors(root).items()}

    def check(self) -> bool:
        """After a trace: True where it found buffers to read as graph values (trace again)."""
        found = set(self.assigned)
        self.assigned.clear()
        for (path, name), (tensor, version) in self.before.items():
            module = self.root.get_submodule(path)
            now = module._buffers.get(name, module._parameters.get(name, vars(module).get(name)))
            if now is tensor and tensor._version == version:
                continue
            if now is not tensor:  # put the object back: an assignment was recorded, not done
                self._put_back(module, name, tensor)
            with torch.no_grad():
                tensor.copy_(self._original(path, name))
            self.before[(path, name)] = (tensor, tensor._version)
            if now is tensor:
                found.add(self._unrecordable(module, path, name))
        new = {name for name in found if name not in self.stateful.values()}
        for name in new:
            self.stateful[id(self.root.get_buffer(name))] = name
        return bool(new)

    def _unrecordable(self, module: nn.Module, path: str, name: str) -> str:
        """The buffer an in-place update at trace time reached; raises where a graph cannot
        record it (not a buffer, or one already read as a graph value)."""
        qualified = _qualified(path, name)
        if name in module._buffers and qualified not in self.stateful.values():
            return qualified
        kind = "parameter" if name in module._parameters else "buffer" if name in module._buffers else None
        if kind is None:
            raise UnrecordedUpdate(
                f"forward updates the tensor attribute {qualified!r} of {type(module).__name__} in place; "
                "torch.fx records updates of buffers only: register it as a buffer "
                f"(self.register_buffer({name!r}, tensor, persistent=False)) and update it in place"
            )
        raise UnrecordedUpdate(
            f"forward updates the {kind} {qualified!r} of {type(module).__name__} in place where torch.fx "
            "cannot record it (it is not read as an attribute, `self.name`, there): update it through "
            f"the attribute (self.{name}.add_(...), self.{name}.copy_(...))"
        )

    def _put_back(self, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        for store in (module._buffers, module._parameters):
            if name in store:
                store[name] = tensor
                return
        vars(module)[name] = tensor

    def _original(self, path: str, name: str) -> torch.Tensor:
        module = self.model.get_submodule(path)
        return module._buffers.get(name, module._parameters.get(name, vars(module).get(name)))

    @contextlib.contextmanager
    def recording(self, tracer: torch.fx.Tracer) -> Iterator[None]:
        """While a trace runs: ``self.buf = value`` on a buffer read as a graph value records
        ``buf.copy_(value)``; on any other buffer it is noted for `check` (and not done)."""
        paths: dict[int, str] = {}
        for path, module in self.root.named_modules():
            paths.setdefault(id(module), path)
        original = nn.Module.__setattr__

        def __setattr__(module: nn.Module, name: str, value: Any) -> None:
            path = paths.get(id(module))
            buffers = vars(module).get("_buffers")
            if path is None or buffers is None or name not in buffers:
                original(module, name, value)
                return
            qualified = _qualified(path, name)
            if qualified not in self.stateful.values():
                self.assigned.add(qualified)
                return
            if not isinstance(value, (torch.Tensor, torch.fx.Proxy)):
                raise UnrecordedUpdate(
                    f"forward assigns {type(value).__name__} to the buffer {qualified!r} of "
                    f"{type(module).__name__}; a graph can only update it with a tensor: assign a "
                    "tensor, or keep the value in a plain attribute outside forward"
                )
            target = tracer.create_proxy("get_attr", qualified, (), {})
            tracer.create_proxy("call_method", "copy_", (target, value), {})

        nn.Module.__setattr__ = __setattr__  # type: ignore[method-assign]
        # torch.fx's Proxy takes no item assignment; ``buf[i] = v`` on a buffer read as a graph
        # value is recorded as torch.fx records it on a constant: operator.setitem.
        torch.fx.Proxy.__setitem__ = _record_setitem  # type: ignore[attr-defined]
        try:
            yield
        finally:
            nn.Module.__setattr__ = original  # type: ignore[method-assign]
            del torch.fx.Proxy.__setitem__  # type: ignore[attr-defined]


def _record_setitem(self: torch.fx.Proxy, key: Any, value: Any) -> None:
    self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class TracedCode:
    """While a trace runs (``with`` it), whether a call comes from the traced code: it runs on the
    thread that traces, and not inside a garbage collection, whose finalizers run whatever code
    holds unreachable objects (a generator's ``finally``, a ``__del__``) wherever it happens to
    start.

    >>> with TracedCode() as traced:
    ...     traced.calls()
    True
    """

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.collecting = False

    def calls(self) -> bool:
        return not self.collecting and threading.get_ident() == self.thread

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() == self.thread:
            self.collecting = phase == "start"

    def __enter__(self) -> TracedCode:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_collection)


# The grad-mode context managers, and the methods of each that switch the mode.
_ENTERING = {
    grad_mode.no_grad: "__enter__",
    grad_mode.enable_grad: "__enter__",
    grad_mode.set_grad_enabled: "__init__",
}
_PREVIOUS_ATTR = "_amp_fx_previous_grad_modes"


@contextlib.contextmanager
def recording_grad_modes(tracer: torch.fx.Tracer) -> Iterator[None]:
    """While a trace runs, each grad-mode region the traced code enters is recorded in its graph:
    ``previous = torch.is_grad_enabled(); torch._C._set_grad_enabled(mode)`` where it starts, and
    ``torch._C._set_grad_enabled(previous)`` where it ends, so the graph leaves the caller's mode
    as it found it (``torch.no_grad()`` around a converted model stays in force). A region is
    recorded before the mode switches: where recording raises, the mode is as it was (the region's
    ``__exit__`` never runs to put it back)."""
    depth = [0]  # no_grad's __enter__ runs set_grad_enabled's __init__: record the outer one only
    saved = []

    def entering(cls: type, method: Any) -> Any:
        def enter(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not traced.calls():
                return method(self, *args, **kwargs)
            if depth[0] == 0:
                if cls is grad_mode.set_grad_enabled:
                    mode = args[0] if args else kwargs["mode"]
                else:
                    mode = cls is grad_mode.enable_grad
                previous = tracer.create_node("call_function", torch.is_grad_enabled, (), {})
                tracer.create_node("call_function", torch._C._set_grad_enabled, (mode,), {})
                self.__dict__.setdefault(_PREVIOUS_ATTR, []).append(previous)
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return enter

    def exiting(method: Any) -> Any:
        def exit_(self: Any, *args: Any) -> Any:
            if not traced.calls():
                return method(self, *args)
            depth[0] += 1
            try:
                result = method(self, *args)
            finally:
                depth[0] -= 1
            previous = self.__dict__.get(_PREVIOUS_ATTR)
            if depth[0] == 0 and previous:
                tracer.create_node("call_function", torch._C._set_grad_enabled, (previous.pop(),), {})
            return result

        return exit_

    for cls, name in _ENTERING.items():
        saved += [(cls, name, cls.__dict__[name]), (cls, "__exit__", cls.__dict__["__exit__"])]
    with TracedCode() as traced:
        try:
            for cls, name in _ENTERING.items():
                setattr(cls, name, entering(cls, cls.__dict__[name]))
                cls.__exit__ = exiting(cls.__dict__["__exit__"])
            yield
        finally:
            for cls, name, method in saved:
                setattr(cls, name, method)


def _is_call(node: torch.fx.Node, target: Any) -> bool:
    return node.op == "call_function" and node.target is target


def drop_empty_grad_regions(graph: torch.fx.Graph) -> None:
    """Erase the grad-mode regions `recording_grad_modes` recorded around no op of the graph (a
    ``no_grad()`` around Python-only code, or around code of a leaf module's own): nothing to
    switch the mode for. A region is ``previous, set(mode), ..., set(previous)``."""
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            if not _is_call(node, torch.is_grad_enabled):
                continue
            start, end = node.next, node.next.next
            if (
                _is_call(start, torch._C._set_grad_enabled)
                and _is_call(end, torch._C._set_grad_enabled)
                and end.args == (node,)
                and len(node.users) == 1
            ):
                for each in (end, start, node):
                    graph.erase_node(each)
                changed = True


@contextlib.contextmanager
def recording_random_factories(tracer: torch.fx.Tracer) -> Iterator[None]:
    """While a trace runs, ``torch.rand(())`` and the other `_RANDOM_FACTORIES` are graph ops even
    with no traced argument (a layer-drop draw), so each call draws anew, as eagerly (other code's
    calls meanwhile draw as they would, `TracedCode`)."""
    saved = {name: getattr(torch, name) for name in _RANDOM_FACTORIES}

    def recorded(function: Any) -> Any:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if not traced.calls():
                return function(*args, **kwargs)
            return tracer.create_proxy("call_function", function, args, kwargs)

        return factory

    with TracedCode() as traced:
        try:
            for name, function in saved.items():
                setattr(torch, name, recorded(function))
            yield
        finally:
            for name, function in saved.items():
                setattr(torch, name, function)
