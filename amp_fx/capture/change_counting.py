"""Counting the changes made to a converted model's modules, so that a call compares one integer.

Comparing the whole model on every call would cost a walk over every module (hundreds of
microseconds for 500 of them), so changes are counted instead: `watch_modules` flags a converted
model's modules (a key in their ``__dict__``), and one-time wraps (`install`) of
``nn.Module.__setattr__`` / ``__delattr__``, torch's global module, parameter and buffer
registration hooks, the hook registration methods (and the handles they return) and the container
methods that write ``_modules`` directly (``ModuleDict.__delitem__``/``clear``,
``ModuleList.insert``, ``Sequential.insert``) add one to the change count of each model that
watches a module they change (its `Counters`, kept per model: a change to one model never
invalidates another's graphs, compiled ones included). ``training`` writes count apart, in the
model's ``switches`` (`amp_fx.capture.changes.Watch.modes_agree`). Setting an attribute to the
object it holds counts nothing.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> counters = watch_modules(model)
    >>> model[0].register_forward_hook(lambda *args: None).remove()
    >>> _ = model.eval()
    >>> counters.changes, counters.switches
    (2, 2)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from amp_fx.capture.state import STATE_ATTR
from amp_fx.capture.traced_graph_module import FOLLOWER_ATTR

__all__ = ["COUNTERS_ATTR", "Counters", "IGNORED_ATTRIBUTES", "WATCHED_ATTR", "install", "watch_modules"]

# The key of a watched module's __dict__ (the `Counters` of each model watching it), and the key
# under which a model keeps its own.
WATCHED_ATTR = "_amp_fx_watched"
COUNTERS_ATTR = "_amp_fx_change_counters"


class Counters:
    """A model's count of changes and of train/eval switches (kept apart: graphs are per mode
    already, so a switch of the whole model only needs each module's mode compared with the
    root's, no walk). Objects, not lists: torch.export rebuilds the containers a module's
    ``__dict__`` holds after a capture, which would part a module from its model's counts."""

    __slots__ = ("changes", "switches")

    def __init__(self) -> None:
        self.changes = 0
        self.switches = 0


class _Watchers:
    """The `Counters` of each model watching a module (an object, for the reason above)."""

    __slots__ = ("counters",)

    def __init__(self) -> None:
        self.counters: list[Counters] = []


_MISSING = object()
_INSTALLED: list[bool] = []

# Entries of a module's __dict__ that say nothing about what its forward computes. ``training`` is
# compared against the root's: graphs are per mode already (`amp_fx.capture.graph_choice`).
IGNORED_ATTRIBUTES = frozenset(
    {
        STATE_ATTR,
        WATCHED_ATTR,
        COUNTERS_ATTR,
        FOLLOWER_ATTR,
        "training",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
        "_amp_fx_master_sources",
        "_amp_fx_loaded_values",
        "_is_torch_compile",  # torch.compile's mark on the module it wraps
        "_compile_kwargs",  # Lightning's record of the torch.compile call on the module it wraps
    }
)


def _bump(module: nn.Module, switch: bool = False) -> None:
    """Count a change (or a train/eval switch) of ``module`` for each model watching it."""
    for counters in module.__dict__[WATCHED_ATTR].counters:
        if switch:
            counters.switches += 1
        else:
            counters.changes += 1


def _current(module: nn.Module, name: str) -> Any:
    state = module.__dict__
    for store in ("_parameters", "_buffers", "_modules"):
        values = state.get(store)
        if values is not None and name in values:
            return values[name]
    return state.get(name, _MISSING)


def _wrap_setattr(setattr_: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(setattr_)
    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if WATCHED_ATTR not in self.__dict__ or (name in IGNORED_ATTRIBUTES and name != "training"):
            return setattr_(self, name, value)
        before = _current(self, name)
        setattr_(self, name, value)
        # ``model.train()`` on a model in training mode, as Trainer does each step, changes nothing.
        if _current(self, name) is not before:
            _bump(self, switch=name == "training")
        return None

    return __setattr__


def _wrap_after(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if WATCHED_ATTR in self.__dict__:
            _bump(self)
        return result

    return wrapped


class _WatchedHandle(RemovableHandle):
    """The handle of a hook registered on a watched module: removing the hook is a change."""

    module: nn.Module

    def remove(self) -> None:
        super().remove()
        _bump(self.module)


def _wrap_hook_registration(method: Callable[..., RemovableHandle]) -> Callable[..., RemovableHandle]:
    @functools.wraps(method)
    def register(self: nn.Module, *args: Any, **kwargs: Any) -> RemovableHandle:
        handle = method(self, *args, **kwargs)
        if WATCHED_ATTR in self.__dict__:
            _bump(self)
            if type(handle) is RemovableHandle:
                handle.__class__ = _WatchedHandle
                handle.module = self
        return handle

    return register


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    if WATCHED_ATTR in module.__dict__:
        _bump(module)


def install() -> None:
    """Wrap what changes a module, once per process (see the module docstring)."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    nn.Module.__setattr__ = _wrap_setattr(nn.Module.__setattr__)  # type: ignore[method-assign]
    nn.Module.__delattr__ = _wrap_after(nn.Module.__delattr__)  # type: ignore[method-assign]
    for name in (
        "register_forward_pre_hook",
        "register_forward_hook",
        "register_full_backward_pre_hook",
        "register_full_backward_hook",
        "register_backward_hook",
    ):
        setattr(nn.Module, name, _wrap_hook_registration(getattr(nn.Module, name)))
    for cls, name in (
        (nn.ModuleDict, "__delitem__"),
        (nn.ModuleDict, "clear"),
        (nn.ModuleList, "insert"),
        (nn.Sequential, "insert"),
    ):
        setattr(cls, name, _wrap_after(getattr(cls, name)))
    torch_module.register_module_module_registration_hook(_on_registration)
    torch_module.register_module_parameter_registration_hook(_on_registration)
    torch_module.register_module_buffer_registration_hook(_on_registration)


def watch_modules(model: nn.Module) -> Counters:
    """Flag ``model`` and its descendants: a change to one of them counts in ``model``'s
    `Counters`, which it returns."""
    install()
    counters = model.__dict__.setdefault(COUNTERS_ATTR, Counters())
    for module in model.modules():
        watchers = module.__dict__.setdefault(WATCHED_ATTR, _Watchers()).counters
        if not any(watcher is counters for watcher in watchers):
            watchers.append(counters)
    return counters
