"""`assert_equivalent` on outputs that are not plain tensors (issue 36): caches and other objects,
dataclasses, tuples holding None, dicts, compared by their tensors wherever they sit; inputs that
a model fills in place; and training outputs whose logits the converted model fuses into its loss,
compared by the loss and the gradients.

The reference is the model itself (a deep copy must pass bit for bit), and a copy with one
weight scaled, whose error must be found and named by where the tensor sits.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_fx.testing import assert_equivalent, forward_backward
from amp_fx.testing.comparison import leaf_names, structure_difference


class Cache:
    """A key/value cache as generation code keeps one: a plain object holding lists of tensors
    and a counter, which ``update`` extends in place."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.seen = 0

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.keys.append(key)
        self.seen += key.shape[0]
        return torch.cat(self.keys)


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    extra: tuple


class Layer(nn.Module):
    """Returns a cache, a dataclass and a tuple with None in it; fills a cache it is given."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor, cache: Cache | None = None):
        h = self.proj(x)
        cache = Cache() if cache is None else cache
        keys = cache.update(h.tanh())
        if self.kind == "cache":
            return h, cache
        if self.kind == "dataclass":
            return Output(h, (None, keys.sum(0), 3))
        return {"hidden": h, "none": None, "pair": (keys, None)}


def _scaled(model: nn.Module, factor: float = 1.01) -> nn.Module:
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.proj.weight.mul_(factor)
    return wrong


@pytest.mark.parametrize(
    ("kind", "where"),
    [
        ("cache", r"output\[1\]\.keys\[0\]"),
        ("dataclass", r"output\.extra\[1\]"),
        ("dict", r"output\['pair'\]\[0\]"),
    ],
)
def test_containers_are_compared_by_their_tensors(kind: str, where: str) -> None:
    model = Layer(kind)
    x = torch.randn(3, 4)
    assert_equivalent(model, copy.deepcopy(model), (x,), exact=True)
    assert_equivalent(model, copy.deepcopy(model), (x,), dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match=where):
        assert_equivalent(model, _scaled(model), (x,), exact=True)


def test_a_cache_the_model_fills_is_copied_for_each_model() -> None:
    """Each model fills its own copy: the second does not see the first one's keys appended, and
    the caller's cache is left as it was."""
    model = Layer("cache")
    cache = Cache()
    cache.update(torch.randn(2, 4))
    assert_equivalent(model, copy.deepcopy(model), (torch.randn(3, 4),), keyword_inputs={"cache": cache})
    assert len(cache.keys) == 1 and cache.seen == 2
    run = forward_backward(model, (torch.randn(3, 4),), keyword_inputs={"cache": cache})
    assert run.input_grads[1] is not None  # the gradient of the cache's tensor, an input


def test_counts_a_cache_holds_are_compared() -> None:
    class Miscounts(Layer):
        def forward(self, x, cache=None):
            h, cache = super().forward(x, cache)
            cache.seen += 1
            return h, cache

    model = Layer("cache")
    wrong = Miscounts("cache")
    with pytest.raises(AssertionError, match=r"output\[1\]\.seen: 4 != expected 3"):
        assert_equivalent(model, wrong, (torch.randn(3, 4),), exact=True)


class TypedCache(Cache):
    """A cache that records its tensors' dtype, as transformers 5.17's ``DynamicLayer`` does."""

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.dtype = key.dtype
        return super().update(key)


class TypedLayer(nn.Module):
    """Fills a `TypedCache` with keys in ``dtype``: a converted model's cache is low, the original's FP32."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> TypedCache:
        cache = TypedCache()
        cache.update(self.proj(x).tanh().to(self.dtype))
        return cache


@pytest.mark.parametrize("measure", ["relative", "fixed"])
def test_a_dtype_a_cache_records_is_compared_as_its_tensors_are(measure: str) -> None:
    """Not as structure: the converted model's cache records bfloat16, the original's float32."""
    x = torch.randn(3, 4)
    low = TypedLayer(torch.bfloat16)
    assert_equivalent(TypedLayer(), low, (x,), dtype=torch.bfloat16, measure=measure)
    with pytest.raises(AssertionError, match=r"output\.keys\[0\]"):
        assert_equivalent(TypedLayer(), _scaled(low, 1.5), (x,), dtype=torch.bfloat16, measure=measure)


class Head(nn.Module):
    """A language-model head returning a dict as a ``ModelOutput`` does: the loss, the logits
    (None where ``fused``: the head and its loss computed together, logits never materialized),
    the hidden states the loss is computed from, and an auxiliary output it is not."""

    def __init__(self, fused: bool = False, drop: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)
        self.aux = nn.Linear(8, 2)
        self.fused, self.drop = fused, drop

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        hidden = self.body(x).relu()
        logits = self.head(hidden)
        out = {
            "loss": F.cross_entropy(logits.float(), labels),
            "logits": logits,
            "hidden": hidden,
            "aux": self.aux(x),
        }
        if self.fused:
            out["logits"] = None
        if self.drop is not None:
            del out[self.drop]
        return out


def _head_inputs() -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(6, 8, generator=generator), torch.randint(0, 5, (6,), generator=generator)), {}


@pytest.mark.parametrize("exact", [True, False])
def test_logits_fused_into_the_loss_are_compared_by_loss_and_gradients(exact: bool) -> None:
    original, fused = Head(), Head(fused=True)
    inputs, _ = _head_inputs()
    assert_equivalent(original, fused, inputs, exact=exact, dtype=torch.bfloat16)
    wrong = Head(fused=True)
    with torch.no_grad():
        wrong.head.weight.mul_(1.5)  # only the loss and the gradients can see it
    with pytest.raises(AssertionError, match=r"output\['loss'\]|grad of parameter 'head.weight'"):
        assert_equivalent(original, wrong, inputs, exact=exact, dtype=torch.bfloat16)


@pytest.mark.parametrize("check_grads", [True, False])
def test_an_output_the_loss_is_not_computed_from_may_not_be_left_out(check_grads: bool) -> None:
    inputs, _ = _head_inputs()
    why = (
        "the 'loss' is not computed from 'aux'" if check_grads else r"without gradients \(check_grads=False\)"
    )
    with pytest.raises(AssertionError, match=f"the converted model returns no 'aux'.*{why}"):
        assert_equivalent(Head(), Head(drop="aux"), inputs, exact=True, check_grads=check_grads)
    with pytest.raises(AssertionError, match="returns no 'loss' to compare by"):
        assert_equivalent(Head(), Head(fused=True, drop="loss"), inputs, exact=True)


def test_a_structure_difference_names_where() -> None:
    class Extra(Head):
        def forward(self, x, labels):
            out = super().forward(x, labels)
            out["hidden"] = (out["hidden"], None)
            return out

    inputs, _ = _head_inputs()
    with pytest.raises(AssertionError, match=r"at \['hidden'\]: the converted model returns a tuple of 2, "
                       r"the original a tensor"):  # fmt: skip
        assert_equivalent(Head(), Extra(), inputs, exact=True)


def test_leaf_names_and_structure_difference_read_objects_by_attribute() -> None:
    cache = Cache()
    cache.update(torch.ones(1, 4))
    run = forward_backward(Layer("cache"), (torch.randn(2, 4),), keyword_inputs={"cache": cache})
    assert leaf_names(run.spec) == ["[0]", "[1].keys[0]", "[1].keys[1]", "[1].seen"]
    other = forward_backward(Layer("cache"), (torch.randn(2, 4),))
    assert structure_difference(run.spec, other.spec) == (
        "at [1].keys: the converted model returns a list of 2, the original a list of 1"
    )
