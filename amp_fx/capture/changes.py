"""The state of a converted model that its captured graphs depend on (torch.export front end).

A captured graph holds what its capture saw: the submodules, parameter and buffer objects, the
attributes the code read (a Dropout's ``p``, a norm's ``eps``, a config's ``output_hidden_states``),
the hooks that fired and each module's train/eval mode. `Watch` is that state, taken when graphs
are captured; a call whose model differs from it drops the graphs and captures again
(`amp_fx.capture.captured_model`), as torch.compile's guards recompile.

A call compares one integer (the model's change count, `amp_fx.capture.change_counting`), the
``__dict__`` of each plain object the modules hold (a Hugging Face ``config``: writes to it are not
seen, so it is compared, a C-level dict compare), and torch's global module hooks (`unchanged`).
Only where those differ is the model walked (`take`) and compared with the `Watch`. A switch of
the whole model between train and eval costs one compare of each module's mode with the root's,
no walk: the graphs are per mode already, and a module left in another mode than the model's is
still seen. The torch.fx front end follows changes with `amp_fx.capture.graph_follower`.

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

import contextlib
import dataclasses
import enum
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from amp_fx.capture.change_counting import IGNORED_ATTRIBUTES, Counters, watch_modules

__all__ = ["Watch", "instrument_hooks", "same_model", "same_objects_and_hooks", "take", "unchanged"]

_MISSING = object()
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
    # A GraphModule's own graph (its nodes, namespace, code generator): the follower's business,
    # and comparing them on every call would trace torch.fx's internals into a compiled call.
    torch.fx.Graph,
    torch.fx.Node,
    torch.fx.graph.CodeGen,
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

# Handle ids of global hooks amp_fx's own instruments hold for one call (`capture_summary`): they
# are not the user's, so they change no model.
_INSTRUMENT_HOOK_IDS: set[int] = set()


def _model_hooks(hooks: dict[Any, Any]) -> dict[Any, Any]:
    if not _INSTRUMENT_HOOK_IDS:
        return hooks
    return {key: value for key, value in hooks.items() if key not in _INSTRUMENT_HOOK_IDS}


@contextlib.contextmanager
def instrument_hooks(*handles: RemovableHandle) -> Iterator[None]:
    """While open, the global module hooks of ``handles`` (amp_fx's own instruments, registered
    for one call) are no change of any model: no graph is dropped or captured for them.

    >>> handle = torch_module.register_module_forward_hook(lambda *_: None)
    >>> with instrument_hooks(handle):
    ...     handle.id in _model_hooks(torch_module._global_forward_hooks)
    False
    >>> handle.remove()
    """
    ids = {handle.id for handle in handles}
    _INSTRUMENT_HOOK_IDS.update(ids)
    try:
        yield
    finally:
        _INSTRUMENT_HOOK_IDS.difference_update(ids)


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
    """A model as its graphs were captured: its change count then (of ``counters``, the model's
    own, `watch_modules`), each module's state (`take`), and a copy of the ``__dict__`` of each
    plain object the modules hold and of torch's global hooks."""

    counters: Counters
    version: int
    modules: tuple[Any, ...]
    objects: tuple[tuple[Any, dict[str, Any]], ...]
    global_hooks: tuple[tuple[dict[Any, Any], dict[Any, Any]], ...]
    held: list[Any]
    # The switch count when each module's mode last agreed with the root's as in ``agreement``; the
    # modules in `named_modules` order (the root first).
    modes: int = 0
    ordered: tuple[nn.Module, ...] = ()
    agreement: tuple[bool, ...] = ()

    def modes_agree(self) -> bool:
        """Whether each module's mode agrees with the root's as it did (``agreement``): after a
        switch of the whole model (``model.eval()``) the graphs of the new mode apply, no walk."""
        if self.modes == self.counters.switches:
            return True
        if _agreement(self.ordered) != self.agreement:
            return False
        self.modes = self.counters.switches
        return True

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
        if any(not _same_dict(_model_hooks(hooks), copy) for hooks, copy in before.global_hooks):
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
    counters = watch_modules(model)
    held: list[Any] = []
    entries = []
    for name, module in model.named_modules():
        attributes = tuple(
            (key, _describe(value, held))
            for key, value in module.__dict__.items()
            if key not in IGNORED_ATTRIBUTES
        )
        held.append(module)
        entries.append((name, id(module), type(module), module.training == model.training, attributes))
    found: dict[int, Any] = {}
    for module in model.modules():
        values = (value for key, value in module.__dict__.items() if key not in IGNORED_ATTRIBUTES)
        _plain_objects(values, found)
    objects = tuple((obj, dict(vars(obj))) for obj in found.values())
    global_hooks = tuple((hooks, dict(_model_hooks(hooks))) for hooks in _GLOBAL_HOOKS)
    ordered = tuple(model.modules())
    return Watch(
        counters,
        counters.changes,
        tuple(entries),
        objects,
        global_hooks,
        held,
        counters.switches,
        ordered,
        _agreement(ordered),
    )


def _agreement(ordered: tuple[nn.Module, ...]) -> tuple[bool, ...]:
    root = ordered[0].training if ordered else False
    return tuple([module.training == root for module in ordered])


def unchanged(watch: Watch) -> bool:
    """Whether nothing the graphs depend on can have changed since ``watch`` was taken: no change
    to a watched module since, and the same plain objects' attributes and global hooks. Plain
    Python (one int, a few C-level dict compares), which torch.compile traces and guards on."""
    if watch.version != watch.counters.changes or not watch.modes_agree():
        return False
    for obj, snapshot in watch.objects:
        if not _same_dict(vars(obj), snapshot):
            return False
    for hooks, saved in watch.global_hooks:
        if _model_hooks(hooks) != saved:
            return False
    return True


def same_model(watch: Watch, now: Watch) -> bool:
    """Whether ``now`` (a later `take`) shows the model ``watch`` was taken of."""
    return watch.modules == now.modules and same_objects_and_hooks(watch, now)


def same_objects_and_hooks(watch: Watch, now: Watch) -> bool:
    """Whether the plain objects the modules hold and torch's global hooks are as in ``watch``."""
    if len(watch.objects) != len(now.objects):
        return False
    if any(
        before is not after or not _same_dict(old, new)
        for (before, old), (after, new) in zip(watch.objects, now.objects, strict=True)
    ):
        return False
    return all(_same_dict(_model_hooks(hooks), copy) for hooks, copy in watch.global_hooks)
