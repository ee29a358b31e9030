"""Changes made to a converted model after its graphs were captured (torch.export front end).

A captured graph holds what its capture saw: the submodules, parameter and buffer objects, the
attributes the code read (a Dropout's ``p``, a norm's ``eps``, a config's ``output_hidden_states``),
the hooks that fired and each module's train/eval mode. `Watch` is that state, taken when graphs
are captured; a call whose model differs from it drops the graphs and captures again
(`amp_fx.capture.captured_model`), as torch.compile's guards recompile.

Comparing the whole model on every call would cost a walk over every module (hundreds of
microseconds for 500 of them), so changes are counted instead: `watch_modules` flags a converted
model's modules (a key in their ``__dict__``), and one-time wraps of ``nn.Module.__setattr__`` /
``__delattr__``, torch's global module, parameter and buffer registration hooks, the hook
registration methods (and the handles they return) and the container methods that write
``_modules`` directly (``ModuleDict.__delitem__``/``clear``, ``ModuleList.insert``,
``Sequential.insert``) add one to the change count of each model that watches a module they change
(its counters, kept per model: a change to one model never invalidates another's graphs, compiled
ones included). A call then compares one integer, and the ``__dict__`` of each plain object the
modules hold (a Hugging Face ``config``: writes to it are not seen, so it is compared, a C-level
dict compare), and torch's global module hooks. Only where those differ is the model walked
(`take`) and compared with the `Watch`.

A switch of the whole model between train and eval (``training`` writes count apart, in the
model's second counter) costs one compare of each module's mode with the root's, no walk: the graphs are per
mode already, and a module left in another mode than the model's is still seen.

The torch.fx front end's GraphModule holds a `GraphFollower`: the graphs as traced, rewritten by
the passes again when the model changed, or a clear error where the change needs code the graph
traced through and does not keep.

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
import copy
import dataclasses
import enum
import functools
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from amp_fx.capture.state import STATE_ATTR
from amp_fx.capture.traced_graph_module import FOLLOWER_ATTR
from amp_fx.core.node_info import OTHER_MODE_GRAPH_KEY

logger = logging.getLogger(__name__)

__all__ = [
    "FOLLOWER_ATTR",
    "FollowError",
    "GraphFollower",
    "COUNTERS_ATTR",
    "WATCHED_ATTR",
    "Watch",
    "install",
    "same_model",
    "take",
    "unchanged",
    "watch_modules",
]

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
_IGNORED = frozenset(
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


def _bump(module: nn.Module, switch: bool = False) -> None:
    """Count a change (or a train/eval switch) of ``module`` for each model watching it."""
    for counters in module.__dict__[WATCHED_ATTR].counters:
        if switch:
            counters.switches += 1
        else:
            counters.changes += 1


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
        if WATCHED_ATTR not in self.__dict__ or (name in _IGNORED and name != "training"):
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
            (key, _describe(value, held)) for key, value in module.__dict__.items() if key not in _IGNORED
        )
        held.append(module)
        entries.append((name, id(module), type(module), module.training == model.training, attributes))
    found: dict[int, Any] = {}
    for module in model.modules():
        _plain_objects((value for key, value in module.__dict__.items() if key not in _IGNORED), found)
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
    return watch.modules == now.modules and _same_objects_and_hooks(watch, now)


def _same_objects_and_hooks(watch: Watch, now: Watch) -> bool:
    """Whether the plain objects the modules hold and torch's global hooks are as in ``watch``."""
    if len(watch.objects) != len(now.objects):
        return False
    if any(
        before is not after or not _same_dict(old, new)
        for (before, old), (after, new) in zip(watch.objects, now.objects, strict=True)
    ):
        return False
    return all(_same_dict(_model_hooks(hooks), copy) for hooks, copy in watch.global_hooks)


# -- The torch.fx front end: a `TracedGraphModule` follows changes by rewriting its traced graph. --

_HOOK_KEYS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class GraphFollower:
    """What keeps a converted GraphModule (the torch.fx front end) in step with changes made to it
    after conversion. ``sources`` are its graphs as traced, before any pass (one per mode the
    forward reads); ``rewrite(gm, added)`` runs the passes on copies of them again with the modules
    the model holds now, storing the tensors named in ``added`` as conversion stores them.

    The graph calls leaf modules (``call_module``: their own forward runs, with their hooks and
    attributes) and reads tensors; the code of the modules it traced through is not kept. So a
    change to a leaf, or a tensor replaced, is followed by rewriting; a change that would need the
    traced-through code (a module or tensor the graph uses deleted, a module or tensor added where
    traced code would read it, a leaf replaced by a module with children, a hook on a traced-through
    module) raises `FollowError` at each call, before anything runs."""

    def __init__(
        self,
        gm: nn.Module,
        sources: list[torch.fx.Graph],
        rewrite: Callable[[nn.Module, frozenset[str]], None],
    ) -> None:
        self.sources = sources
        self.rewrite = rewrite
        self.calls, self.reads, self.opaque = set(), set(), set()
        for graph in sources:
            for node in graph.nodes:
                if node.op == "call_module":
                    self.calls.add(node.target)
                    if _is_opaque(node):
                        self.opaque.add(node.target)
                elif node.op == "get_attr":
                    self.reads.add(node.target)
        # torch.fx makes the modules it traced through anew, in training mode: give them the
        # model's, so that a module later set to another mode than the model's is seen.
        for name, module in gm.named_modules():
            if not self.in_leaf(name):
                module.__dict__["training"] = gm.training
        self.owner = id(gm)
        self.watch = take(gm)

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphFollower:
        # A deepcopy of the GraphModule (``memo`` maps each object's id to its copy): the copy's
        # follower watches the copied modules, as they were when copied.
        def mapped(value: Any) -> Any:
            return memo.get(id(value), value)

        def mapped_id(key: int) -> int:
            return id(memo[key]) if key in memo else key

        def remap(described: Any) -> Any:
            if isinstance(described, tuple):
                if len(described) == 2 and described[0] == "object" and isinstance(described[1], int):
                    return ("object", mapped_id(described[1]))
                return tuple(remap(item) for item in described)
            return described

        new = copy.copy(self)
        watch = self.watch
        new.owner = mapped_id(self.owner)
        new.watch = dataclasses.replace(
            watch,
            counters=copy.deepcopy(watch.counters, memo),  # the copied modules count in this one
            modules=tuple(
                (name, mapped_id(key), kind, agree, remap(attributes))
                for name, key, kind, agree, attributes in watch.modules
            ),
            objects=tuple(
                (mapped(obj), {k: mapped(v) for k, v in snapshot.items()}) for obj, snapshot in watch.objects
            ),
            held=[mapped(value) for value in watch.held],
            ordered=tuple(mapped(module) for module in watch.ordered),
        )
        return new

    def in_leaf(self, name: str) -> bool:
        """Whether the module ``name`` is one the graph calls, or inside one."""
        return _inside(name, self.calls)

    def __call__(self, gm: nn.Module) -> bool:
        """Follow changes made to ``gm`` since the last call; True if its graphs were rewritten."""
        # Plain Python, which torch.compile traces and guards on, as `unchanged`'s.
        if unchanged(self.watch):
            return False
        return self._follow(gm)

    @torch.compiler.disable
    def _follow(self, gm: nn.Module) -> bool:
        now = take(gm)
        if self.owner != id(gm):  # a copy (deepcopy) holds the graphs of its own modules
            self.owner, self.watch = id(gm), now
            return False
        if same_model(self.watch, now) or self._only_hooks_on_called_modules(gm, now):
            # A hook on a module the graphs call fires as it is: nothing to rewrite (a rewrite
            # would make the modules a pass put in anew, without the hook).
            self.watch = now
            return False
        problems = self.problems(gm, now)
        if problems:
            policy = getattr(gm, "meta", {}).get("amp_fx_policy")
            level = f"{policy.opt_level!r}, dtype={policy.dtype}" if policy is not None else "..."
            raise FollowError(
                f"{type(gm).__name__} (converted with front_end='fx') was changed after conversion in a "
                f"way its graph cannot follow: {'; '.join(problems[:6])}. Its graph was traced from the "
                "model's forward, whose code it does not keep, so it cannot run this change. Make the "
                "change on the original model and convert that again: amp_fx.convert(model, "
                f"{level}, front_end='fx'), or convert with front_end='export', which captures a "
                "changed model again."
            )
        known = self.watch.tensor_ids()
        added = frozenset(
            name
            for name, tensor in [
                *gm.named_parameters(remove_duplicate=False),
                *gm.named_buffers(remove_duplicate=False),
            ]
            if id(tensor) not in known
        )
        logger.info(
            "%s changed since conversion (%s): rewriting its traced graph",
            type(gm).__name__,
            ", ".join(now.differences(self.watch)[:8]),
        )
        self.rewrite(gm, added)
        self.watch = take(gm)
        return True

    def _only_hooks_on_called_modules(self, gm: nn.Module, now: Watch) -> bool:
        old = {entry[0]: entry for entry in self.watch.modules}
        if len(old) != len(now.modules) or not _same_objects_and_hooks(self.watch, now):
            return False
        called = _called_modules(gm) | {""}  # hooks on the model itself fire when it is called
        for entry in now.modules:
            before = old.get(entry[0])
            if before is None or before[1] != entry[1] or before[3] != entry[3]:
                return False
            # A wrapper that subclasses the model in place (FSDP2's fully_shard) keeps its forward.
            if before[2] is not entry[2] and not (entry[0] == "" and issubclass(entry[2], before[2])):
                return False
            attributes, previous = dict(entry[4]), dict(before[4])
            changed = {
                key for key in attributes.keys() | previous.keys() if attributes.get(key) != previous.get(key)
            }
            if changed and (not changed <= set(_HOOK_KEYS) or not _inside(entry[0], called)):
                return False
        return True

    def accept(self, gm: nn.Module) -> None:
        """Take ``gm`` as it is now as the state its graphs follow, for a change amp_fx made
        knowing the graphs stay right (`amp_fx.training.fsdp.fully_shard_converted` shards the parameters
        the graphs read and hooks the modules they call)."""
        self.owner, self.watch = id(gm), take(gm)

    def problems(self, gm: nn.Module, now: Watch) -> list[str]:
        """What changed that the graph cannot follow (the class docstring), one phrase each."""
        calls, reads, opaque = self.calls, self.reads, self.opaque
        problems = []
        for target in sorted(calls):
            if _resolve(gm, target) is None:
                problems.append(f"`{target}`, a module the graph calls, was deleted")
        for target in sorted(reads):
            if _resolve(gm, target) is None:
                problems.append(f"`{target}`, which the graph reads, was deleted or set to None")
        old = {entry[0]: entry for entry in self.watch.modules}
        new = {entry[0]: entry for entry in now.modules}
        for target in sorted(calls - opaque):
            before, after = old.get(target), new.get(target)
            if before is None or after is None or before[1] == after[1] or before[2] is after[2]:
                continue
            if any(True for _ in gm.get_submodule(target).children()):
                problems.append(
                    f"`{target}` was replaced by a {after[2].__module__}.{after[2].__qualname__}, a "
                    "module with submodules the "
                    "graph would have to trace through"
                )
        mode_graphs = len(self.sources) > 1
        for name, entry in new.items():
            if self.in_leaf(name):
                continue
            shown = name or "the model"
            before = old.get(name)
            if before is None:
                problems.append(f"`{name}` was added where the graph's traced code would call it")
                continue
            if before[1] != entry[1]:
                continue  # a module the graph does not call, replaced (held for its state)
            if mode_graphs and before[3] != entry[3]:
                problems.append(f"{shown}'s train/eval mode differs from the model's (a graph per mode)")
            attributes, previous = dict(entry[4]), dict(before[4])
            for key in _HOOK_KEYS:
                if attributes.get(key) != previous.get(key) and getattr(gm.get_submodule(name), key, None):
                    problems.append(f"a hook was registered on `{shown}`, which the graph traced through")
            for key in ("_parameters", "_buffers"):
                added = _keys(attributes.get(key)) - _keys(previous.get(key))
                problems += [
                    f"`{name + '.' if name else ''}{attribute}` was added where traced code would read it"
                    for attribute in sorted(added)
                    if getattr(gm.get_submodule(name), attribute, None) is not None
                ]
        return problems


def _inside(name: str, leaves: set[str]) -> bool:
    return any(name == leaf or name.startswith(leaf + ".") for leaf in leaves)


def _called_modules(gm: nn.Module) -> set[str]:
    """The modules the rewritten graphs (each mode's) call by ``call_module``."""
    graphs = [gm.graph]
    other = gm.meta.get(OTHER_MODE_GRAPH_KEY)
    if other is not None:
        graphs.append(other[1])
    return {node.target for graph in graphs for node in graph.nodes if node.op == "call_module"}


class FollowError(RuntimeError):
    """A change made to a converted GraphModule that its traced graph cannot follow."""


def _keys(described: Any) -> set[str]:
    # A dict as `_describe` gives it: (type, ((key, value), ...)).
    if not isinstance(described, tuple) or len(described) != 2 or not isinstance(described[1], tuple):
        return set()
    return {key for key, _ in described[1]}


def _resolve(gm: nn.Module, target: str) -> Any:
    owner: Any = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def _is_opaque(node: torch.fx.Node) -> bool:
    from amp_fx.core.node_info import node_info
    from amp_fx.core.policy import Rule

    return node_info(node).rule is Rule.OPAQUE
