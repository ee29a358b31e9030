"""`amp_fx.core.containers`: which values a `Spec` compares by value (those ``hash`` takes, decided
without calling it where it can: torch.compile traces it), and objects rebuilt by their attributes."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import pytest
import torch

from amp_fx.core.containers import Spec, _hashable, flatten, unflatten, write_back


@dataclasses.dataclass(frozen=True)
class Frozen:
    items: Any


class Color(enum.Enum):
    RED = 1


class Refuses:
    def __hash__(self) -> int:
        raise ValueError("no hash")


def _hash_succeeds(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


VALUES = [
    None, True, 3, 1.5, float("nan"), 2j, "s", b"b", torch.float16, torch.device("cpu"), int, Color.RED,
    (), (1, "a", None), ((1,), ("a", (torch.float32, int))), (1, [2]), ((1,), ({"a": 1},)), [1], {"a": 1},
    {1, 2}, frozenset({1}), Frozen(1), Frozen([1]), (Frozen(1), Frozen([1])), object(), slice(1, 2),
    len, lambda: None,
]  # fmt: skip


@pytest.mark.parametrize("value", VALUES, ids=[f"{type(v).__name__}{i}" for i, v in enumerate(VALUES)])
def test_hashable_is_the_value_exactly_where_hash_succeeds(value: Any) -> None:
    key = _hashable(value)
    if _hash_succeeds(value):
        assert key is value
    else:
        assert key == (type(value), id(value))
        hash(key)


@pytest.mark.parametrize(
    "value", [Refuses(), (1, Refuses()), ((Refuses(),),)], ids=["object", "in tuple", "nested"]
)
def test_an_error_other_than_type_error_from_hash_propagates_as_from_hash(value: Any) -> None:
    with pytest.raises(ValueError, match="no hash"):
        hash(value)
    with pytest.raises(ValueError, match="no hash"):
        _hashable(value)


def test_specs_compare_and_hash_by_structure_and_constants() -> None:
    def spec(value: Any) -> Spec:
        return flatten(value)[1]

    a = spec(((torch.ones(2),), {"ids": torch.ones(3), "mode": "train", "n": (1, 2)}))
    b = spec(((torch.zeros(5),), {"ids": torch.zeros(1), "mode": "train", "n": (1, 2)}))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != spec(((torch.ones(2),), {"input": torch.ones(3), "mode": "train", "n": (1, 2)}))
    assert a != spec(((torch.ones(2),), {"ids": torch.ones(3), "mode": "eval", "n": (1, 2)}))
    assert a != spec(((torch.ones(2),), {"ids": torch.ones(3), "mode": "train", "n": (1, 3)}))
    assert a != spec(([torch.ones(2)], {"ids": torch.ones(3), "mode": "train", "n": (1, 2)}))
    # A constant hash refuses compares by identity: the same object, not an equal one.
    held = {1, 2}
    assert spec((held, torch.ones(1))) == spec((held, torch.ones(2)))
    assert spec((held, torch.ones(1))) != spec(({1, 2}, torch.ones(1)))
    hash(spec((held,)))


class Guarded:
    """An object whose ``__setattr__`` refuses: a rebuild sets its state as vars() holds it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        object.__setattr__(self, "tensor", tensor)
        object.__setattr__(self, "count", 2)
        object.__setattr__(self, "inner", Frozen([tensor]))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("read-only")


def test_objects_are_rebuilt_with_their_attributes_set_as_vars_holds_them() -> None:
    original = Guarded(torch.ones(2))
    leaves, spec = flatten({"state": original})
    assert spec.objects == 2 and leaves[1] == 2 and len(leaves) == 3  # an int an object holds is a leaf
    new = [torch.full((2,), 5.0), 7, torch.full((2,), 6.0)]
    rebuilt, built = unflatten(new, spec)
    obj = rebuilt["state"]
    assert type(obj) is Guarded and built == [obj]
    assert list(vars(obj)) == list(vars(original))
    assert obj.tensor is new[0] and obj.count == new[1]
    assert type(obj.inner) is Frozen and obj.inner.items == [new[2]]


class Layer:
    """A cache layer: tensors in lists, as Hugging Face's dynamic cache layers hold them."""

    def __init__(self, keys: list[torch.Tensor]) -> None:
        self.keys = keys
        self.lengths = {"seen": len(keys)}


class Cache:
    def __init__(self, layers: list[Layer], offset: int) -> None:
        self.layers = layers
        self.offset = offset


def test_write_back_fills_the_callers_nested_lists_and_objects_in_place() -> None:
    # The caller keeps references into its object (a layer, a layer's list of keys): after the call
    # they must show the callee's values, so write_back fills them instead of replacing them.
    layer = Layer([torch.zeros(2)])
    cache = Cache([layer], offset=0)
    layers, keys, lengths = cache.layers, layer.keys, layer.lengths
    copy = Cache([Layer([torch.ones(2), torch.full((2,), 2.0)]), Layer([torch.full((2,), 3.0)])], offset=3)
    write_back([cache], [vars(copy)])
    assert cache.layers is layers and cache.layers[0] is layer and layer.keys is keys
    assert layer.lengths is lengths and lengths == {"seen": 2}
    assert [k.tolist() for k in keys] == [[1.0, 1.0], [2.0, 2.0]]
    assert len(layers) == 2 and type(layers[1]) is Layer and layers[1].keys[0].tolist() == [3.0, 3.0]
    assert cache.offset == 3


def test_write_back_deletes_what_the_callee_deleted_at_every_depth() -> None:
    layer = Layer([torch.zeros(2)])
    cache = Cache([layer], offset=0)
    cache.extra = torch.ones(1)
    copy = Cache([Layer([torch.ones(2)])], offset=1)  # no `extra`
    del copy.layers[0].lengths
    write_back([cache], [vars(copy)])
    assert not hasattr(cache, "extra") and not hasattr(layer, "lengths")
    assert list(vars(cache)) == ["layers", "offset"] and list(vars(layer)) == ["keys"]


def test_write_back_replaces_what_changed_type() -> None:
    # A list the callee replaced by a tuple (or an object of another class) is the callee's value.
    cache = Cache([Layer([torch.zeros(2)])], offset=0)
    replacement = (torch.ones(1),)
    write_back([cache], [{"layers": replacement, "offset": 0}])
    assert cache.layers is replacement
