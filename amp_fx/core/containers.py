"""Containers of tensors that cross a captured boundary: flattened to their tensors and rebuilt.

torch.export takes and returns pytrees: tensors in tuples, lists, dicts and registered types. A
Hugging Face call passes a ``DynamicCache`` in and out (an ``EncoderDecoderCache`` for T5 and
Whisper), torchvision's detection models an ``ImageList``; export refuses them, and without this
module each module they cross would run in an autocast island. `flatten` turns any value into
its tensors and a `Spec` that holds everything else (types, constants, the shape of the
nesting), whatever the type:

- tensors are the leaves; ``None``, numbers, strings, dtypes, devices and objects that hold no
  tensor are constants of the spec;
- tuples, lists, dicts and the types registered with ``torch.utils._pytree`` (namedtuples,
  ``ModelOutput``) are taken apart one level by pytree and their children flattened in turn;
- any other object (a cache, a dataclass, a type this code has never seen) is taken apart by its
  attributes (``vars(obj)``), so no registration is needed, none is made, and nothing outlives
  the capture.

`unflatten` rebuilds the value from new leaves (the fake tensors of a capture, or a graph's
outputs). Objects are rebuilt as new instances of their class with the rebuilt attributes, and a
container the callee changes in place (``DynamicCache.update`` appends to the caller's cache) is
changed in place for the caller too: `write_back` gives the caller's objects the attributes of
their rebuilt copies after the call, keeping the identity of every object it can.

Example::

    >>> class Cache:
    ...     def __init__(self):
    ...         self.keys = [torch.zeros(1)]
    >>> leaves, spec = flatten(({"cache": Cache(), "n": 2},))
    >>> [tuple(t.shape) for t in leaves], spec.objects
    ([(1,)], 1)
    >>> rebuilt, objects = unflatten([torch.ones(1)], spec)
    >>> rebuilt[0]["cache"].keys, rebuilt[0]["n"]
    ([tensor([1.])], 2)
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "Spec",
    "flatten",
    "unflatten",
    "outer_objects",
    "write_back",
    "holds_objects",
    "leaves_in_objects",
]

_CONSTANT_TYPES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    type,
    enum.Enum,
)


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """How to rebuild a value from its tensors (see the module docstring).

    ``kind`` is ``"leaf"`` (a tensor, or an int an object holds), ``"constant"`` (``value``),
    ``"node"`` (a pytree node: ``value`` is its type and context), ``"object"`` (``value`` is its
    class; one child, the attribute dict) or ``"same"`` (``value`` is the index of an object
    already seen: an output that is one of the call's own input objects). Specs compare and hash
    by what they rebuild.
    """

    kind: str
    value: Any = None
    children: tuple[Spec, ...] = ()
    # Computed once (children first): a graph is chosen by comparing specs at every call.
    key: tuple[Any, ...] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        key = (self.kind, _hashable(self.value), tuple(child.key for child in self.children))
        object.__setattr__(self, "key", key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def leaves(self) -> int:
        return (self.kind == "leaf") + sum(child.leaves for child in self.children)

    @property
    def objects(self) -> int:
        """How many objects taken apart by their attributes (each is written back after a call)."""
        return (self.kind == "object") + sum(child.objects for child in self.children)


def _hashable(value: Any) -> Any:
    # The value where it hashes (compared by value), else its identity.
    return value if _hashes(value) else (type(value), id(value))


def _hashes(value: Any) -> bool:
    # Whether ``hash(value)`` succeeds, without calling ``hash`` on the values a call's structure
    # is made of: torch.compile traces the choice of a graph (`amp_fx.capture.graph_choice`), and torch
    # 2.11's Dynamo cannot trace ``hash`` (a graph break). A tuple hashes where its items do.
    if type(value) in _HASHABLE_TYPES:
        return True
    if type(value) is tuple:
        return all(_hashes(item) for item in value)
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _node_type(value: Any) -> Any:
    # pytree's own key for the value's node type (namedtuples and structseqs share one each).
    node_type = pytree._get_node_type(value)
    return node_type if node_type in pytree.SUPPORTED_NODES else None


# Leaves: tensors, and the symbolic sizes a capture with dynamic shapes may leave in a container's
# state (a sliding-window cache's length), which the graph returns as ints.
_LEAF_TYPES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)


def _is_object(value: Any) -> bool:
    # Lists, tuples and dicts (ModelOutput too) go through pytree; other plain Python objects by
    # their attributes, also while they hold no tensor (an empty cache the callee fills). Modules
    # and objects that object.__new__ cannot rebuild are constants.
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, (tuple, list, dict, torch.nn.Module))
        and type(value).__new__ is object.__new__
        and not type(value).__module__.startswith("torch.")  # torch's machinery, not user data
    )


def flatten(value: Any, inputs: list[Any] | None = None) -> tuple[list[Any], Spec]:
    """The tensors in ``value`` (depth first) and the `Spec` that rebuilds it. ``inputs``: objects
    of the call (from `unflatten`) that ``value`` may return; each is recorded as ``"same"``."""
    leaves: list[Any] = []
    return leaves, _flatten(value, leaves, inputs or [])


def _flatten(value: Any, leaves: list[Any], inputs: list[Any], within: tuple[int, ...] = ()) -> Spec:
    # An int an object holds is a leaf, not a constant: a sliding-window cache counts its tokens,
    # and a graph that baked the count in would be captured again at every token.
    if isinstance(value, _LEAF_TYPES) or (within and type(value) is int):
        leaves.append(value)
        return Spec("leaf")
    if isinstance(value, _CONSTANT_TYPES):
        return Spec("constant", value)
    for index, known in enumerate(inputs):
        if value is known:
            return Spec("same", index)
    if _is_object(value) and id(value) not in within:  # an object holding itself stays whole
        state = _flatten(dict(vars(value)), leaves, inputs, (*within, id(value)))
        return Spec("object", type(value), (state,))
    node_type = _node_type(value)
    if node_type is not None:
        children, context = pytree.SUPPORTED_NODES[node_type].flatten_fn(value)
        flat = tuple(_flatten(child, leaves, inputs, within) for child in children)
        return Spec("node", (node_type, _context_key(context)), flat)
    return Spec("constant", value)


class _Context:
    # A pytree context compared by value where it can be, kept as it is for unflattening.
    def __init__(self, context: Any) -> None:
        self.context = context
        self.key = _hashable(context)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Context) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


# Types (exactly: a subclass may define its own __hash__) whose values always hash; a `_Context`
# hashes its key, which `_hashable` made hashable.
_HASHABLE_TYPES = (
    type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, type, _Context
)  # fmt: skip


def _context_key(context: Any) -> _Context:
    if isinstance(context, list):
        context = tuple(context)
    return _Context(context)


def unflatten(leaves: list[Any], spec: Spec, inputs: list[Any] | None = None) -> tuple[Any, list[Any]]:
    """The value ``spec`` describes, built from ``leaves``, and the outermost objects it built (in
    the order `outer_objects` finds them). ``inputs`` are what ``"same"`` specs refer to."""
    built: list[Any] = []
    value = _unflatten(iter(leaves), spec, built, inputs or [])
    return value, built


def _unflatten(leaves: Any, spec: Spec, built: list[Any] | None, inputs: list[Any]) -> Any:
    if spec.kind == "leaf":
        return next(leaves)
    if spec.kind == "constant":
        return spec.value
    if spec.kind == "same":
        return inputs[spec.value]
    if spec.kind == "object":
        obj = object.__new__(spec.value)
        if built is not None:
            built.append(obj)
        state = vars(obj)
        # Item by item: torch 2.11's Dynamo cannot trace ``__dict__.update`` (a graph break).
        for name, value in _unflatten(leaves, spec.children[0], None, inputs).items():
            state[name] = value
        return obj
    node_type, context = spec.value
    children = [_unflatten(leaves, child, built, inputs) for child in spec.children]
    return pytree.SUPPORTED_NODES[node_type].unflatten_fn(children, context.context)


def outer_objects(value: Any) -> list[Any]:
    """The objects `flatten` takes apart by attributes that no other such object holds, in order."""
    found: list[Any] = []
    _collect_objects(value, found)
    return found


def _collect_objects(value: Any, found: list[Any]) -> None:
    if isinstance(value, (*_LEAF_TYPES, *_CONSTANT_TYPES)):
        return
    if _is_object(value):
        found.append(value)
        return
    node_type = _node_type(value)
    if node_type is not None:
        for child in pytree.SUPPORTED_NODES[node_type].flatten_fn(value)[0]:
            _collect_objects(child, found)


def leaves_in_objects(spec: Spec) -> list[bool]:
    """For each leaf of ``spec``, in order: whether it belongs to an object (a cache's state)."""
    flags: list[bool] = []
    _mark_object_leaves(spec, False, flags)
    return flags


def _mark_object_leaves(spec: Spec, inside: bool, flags: list[bool]) -> None:
    if spec.kind == "leaf":
        flags.append(inside)
    for child in spec.children:
        _mark_object_leaves(child, inside or spec.kind == "object", flags)


def holds_objects(value: Any) -> bool:
    """Whether ``value`` holds an object that only `flatten` takes apart (torch.export refuses it)."""
    return flatten(value)[1].objects > 0


def write_back(originals: list[Any], states: list[dict[str, Any]]) -> None:
    """Give each of the caller's objects the attributes (``states``) its copy had after the call,
    keeping the identity of nested objects and lists that are still there."""
    for original, state in zip(originals, states, strict=True):
        _assign_attributes(original, state)


def _assign_attributes(original: Any, new_state: dict[str, Any]) -> None:
    old_state = vars(original)
    for name in [name for name in old_state if name not in new_state]:
        del old_state[name]
    for name, value in new_state.items():
        old_state[name] = _merged(old_state.get(name), value)


def _merged(old: Any, new: Any) -> Any:
    if type(old) is type(new) and _is_object(new):
        _assign_attributes(old, vars(new))
        return old
    if type(old) is list and type(new) is list:
        old[:] = [_merged(old[i] if i < len(old) else None, item) for i, item in enumerate(new)]
        return old
    if type(old) is dict and type(new) is dict:
        merged = {key: _merged(old.get(key), value) for key, value in new.items()}
        old.clear()
        old.update(merged)
        return old
    return new
