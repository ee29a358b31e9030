"""Changes made to a converted model after its graphs were captured (torch.export front end).

A captured graph holds what its capture saw: the submodules, parameter and buffer objects, the
attributes the code read (a Dropout's ``p``, a norm's ``eps``, a config's ``output_hidden_states``),
the hooks that fired and each module's train/eval mode. `Watch` is that state, taken when graphs
are captured; a call whose model differs from it drops the graphs and captures again
(`amp_fx.captured_model`), as torch.compile's guards recompile.

Comparing the whole model on every call would cost a walk over every module (hundreds of
microseconds for 500 of them), so changes are counted instead: `watch_modules` flags a converted
model's modules (a key in their ``__dict__``), and one-time wraps of ``nn.Module.__setattr__`` /
``__delattr__``, torch's global module, parameter and buffer registration hooks, the hook
registration methods (and the handles they return) and the container methods that write
``_modules`` directly (``ModuleDict.__delitem__``/``clear``, ``ModuleList.insert``,
``Sequential.insert``) add one to `VERSION` when they change a flagged module. A call then
compares one integer, and the ``__dict__`` of each plain object the modules hold (a Hugging Face
``config``: writes to it are not seen, so it is compared, a C-level dict compare), and torch's global
module hooks. Only where those differ is the model walked (`take`) and compared with the `Watch`.

Not seen: in-place changes of a container an attribute holds (``config.rope_scaling["factor"] = 2``,
``module._modules[name] = m``): assign the attribute instead.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    >>> watch = take(model)
    >>> unchanged(watch)
    True
    >>> model[1].p = 0.0
    >>> unchanged(watch), take(model).differences(watch)
    (False, ['1.p'])
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from amp_fx.capture.state import STATE_ATTR

__all__ = ["VERSION", "WATCHED_ATTR", "Watch", "install", "same_model", "take", "unchanged", "watch_modules"]

# The key of a watched module's __dict__, and the count of changes made to watched modules.
WATCHED_ATTR = "_amp_fx_watched"
VERSION = [0]

_MISSING = object()
_INSTALLED: list[bool] = []

# Entries of a module's __dict__ that say nothing about what its forward computes. ``training`` is
# compared against the root's: graphs are per mode already (`amp_fx.capture.fit`).
_IGNORED = frozenset(
    {
        STATE_ATTR,
        WATCHED_ATTR,
        "training",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_non_persistent_buffers_set",
        "_amp_fx_master_sources",
        "_amp_fx_loaded_values",
    }
)
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
# Values held by identity that are not plain objects whose attributes forward reads.
_NOT_OBJECTS = (
    dict,
    list,
    tuple,
    set,
    frozenset,
    nn.Module,
    torch.Tensor,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
)
# torch's global module hooks: each fires for every module.
_GLOBAL_HOOKS = tuple(
    getattr(torch_module, name)
    for name in (
        "_global_forward_pre_hooks",
        "_global_forward_hooks",
        "_global_forward_hooks_always_called",
        "_global_backward_pre_hooks",
        "_global_backward_hooks",
    )
    if hasattr(torch_module, name)
)


def _bump() -> None:
    VERSION[0] += 1


def _watched(module: Any) -> bool:
    return WATCHED_ATTR in module.__dict__


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
        if WATCHED_ATTR not in self.__dict__:
            return setattr_(self, name, value)
        before = _current(self, name)
        setattr_(self, name, value)
        # ``model.train()`` on a model in training mode, as Trainer does each step, changes nothing.
        if _current(self, name) is not before:
            _bump()
        return None

    return __setattr__


def _wrap_after(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if WATCHED_ATTR in self.__dict__:
            _bump()
        return result

    return wrapped


class _WatchedHandle(RemovableHandle):
    """The handle of a hook registered on a watched module: removing the hook is a change."""

    def remove(self) -> None:
        super().remove()
        _bump()


def _wrap_hook_registration(method: Callable[..., RemovableHandle]) -> Callable[..., RemovableHandle]:
    @functools.wraps(method)
    def register(self: nn.Module, *args: Any, **kwargs: Any) -> RemovableHandle:
        handle = method(self, *args, **kwargs)
        if WATCHED_ATTR in self.__dict__:
            _bump()
            if type(handle) is RemovableHandle:
                handle.__class__ = _WatchedHandle
        return handle

    return register


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    if WATCHED_ATTR in module.__dict__:
        _bump()


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


def watch_modules(model: nn.Module) -> None:
    """Flag ``model`` and its descendants: a change to one of them counts in `VERSION`."""
    install()
    for module in model.modules():
        module.__dict__[WATCHED_ATTR] = True


def _describe(value: Any, held: list[Any], depth: int = 0) -> Any:
    """A value equal for equal scalars and containers of them, else the object's identity (kept
    alive in ``held``, so that its id is not reused)."""
    if isinstance(value, _SCALARS):
        return value
    if depth < 3 and isinstance(value, (tuple, list)):
        return (type(value), tuple(_describe(item, held, depth + 1) for item in value))
    if depth < 3 and isinstance(value, dict):
        return (type(value), tuple((key, _describe(item, held, depth + 1)) for key, item in value.items()))
    held.append(value)
    return ("object", id(value))


def _plain_objects(values: Any, found: dict[int, Any], depth: int = 0) -> None:
    """Objects among ``values`` whose attributes forward may read (a config), and theirs in turn."""
    for value in values:
        if isinstance(value, (*_SCALARS, *_NOT_OBJECTS)) or id(value) in found:
            continue
        attributes = getattr(value, "__dict__", None)
        if type(attributes) is dict:
            found[id(value)] = value
            if depth < 2:
                _plain_objects(attributes.values(), found, depth + 1)


@dataclasses.dataclass
class Watch:
    """A model as its graphs were captured: `VERSION` then, each module's state (`take`), and a
    copy of the ``__dict__`` of each plain object the modules hold and of torch's global hooks."""

    version: int
    modules: tuple[Any, ...]
    objects: tuple[tuple[Any, dict[str, Any]], ...]
    global_hooks: tuple[tuple[dict[Any, Any], dict[Any, Any]], ...]
    held: list[Any]

    def tensor_ids(self) -> set[int]:
        """ids of the parameters and buffers the model held."""
        return {id(value) for value in self.held if isinstance(value, torch.Tensor)}

    def differences(self, before: Watch) -> list[str]:
        """What differs from ``before``: qualified names of modules and attributes, object types."""
        old = {entry[0]: entry for entry in before.modules}
        new = {entry[0]: entry for entry in self.modules}
        changed = [f"{name or '<model>'} added" for name in new if name not in old]
        changed += [f"{name or '<model>'} removed" for name in old if name not in new]
        for name, entry in new.items():
            previous = old.get(name)
            if previous is None or previous == entry:
                continue
            if previous[1:4] != entry[1:4]:
                changed.append(f"{name or '<model>'} replaced or its mode changed")
                continue
            attributes, before_attributes = dict(entry[4]), dict(previous[4])
            prefix = f"{name}." if name else ""
            changed += [
                f"{prefix}{key}"
                for key in sorted(attributes.keys() | before_attributes.keys())
                if attributes.get(key, _MISSING) != before_attributes.get(key, _MISSING)
            ]
        old_objects = dict((id(obj), snapshot) for obj, snapshot in before.objects)
        for obj, snapshot in self.objects:
            if not _same_dict(snapshot, old_objects.get(id(obj), {})):
                changed.append(f"a {type(obj).__name__}'s attributes")
        if any(not _same_dict(hooks, copy) for hooks, copy in before.global_hooks):
            changed.append("torch's global module hooks")
        return changed


def _same_dict(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    # Equal entries are the same objects (identity is checked first); a changed tensor cannot say.
    try:
        return bool(a == b)
    except RuntimeError:
        return False


def take(model: nn.Module) -> Watch:
    """The state of ``model`` a graph depends on (see `Watch`); flags its modules (`watch_modules`)."""
    watch_modules(model)
    held: list[Any] = []
    entries = []
    for name, module in model.named_modules():
        attributes = tuple(
            (key, _describe(value, held)) for key, value in module.__dict__.items() if key not in _IGNORED
        )
        held.append(module)
        entries.append((name, id(module), type(module), module.training == model.training, attributes))
    found: dict[int, Any] = {}
    for module in model.modules():
        _plain_objects((value for key, value in module.__dict__.items() if key not in _IGNORED), found)
    objects = tuple((obj, dict(vars(obj))) for obj in found.values())
    global_hooks = tuple((hooks, dict(hooks)) for hooks in _GLOBAL_HOOKS)
    return Watch(VERSION[0], tuple(entries), objects, global_hooks, held)


def unchanged(watch: Watch) -> bool:
    """Whether nothing the graphs depend on can have changed since ``watch`` was taken: no change
    to a watched module since, and the same plain objects' attributes and global hooks. Plain
    Python (one int, a few C-level dict compares), which torch.compile traces and guards on."""
    if watch.version != VERSION[0]:
        return False
    for obj, snapshot in watch.objects:
        if not _same_dict(vars(obj), snapshot):
            return False
    for hooks, copy in watch.global_hooks:
        if hooks != copy:
            return False
    return True


def same_model(watch: Watch, now: Watch) -> bool:
    """Whether ``now`` (a later `take`) shows the model ``watch`` was taken of."""
    if watch.modules != now.modules or len(watch.objects) != len(now.objects):
        return False
    if any(
        before is not after or not _same_dict(old, new)
        for (before, old), (after, new) in zip(watch.objects, now.objects, strict=True)
    ):
        return False
    return all(_same_dict(hooks, copy) for hooks, copy in watch.global_hooks)
