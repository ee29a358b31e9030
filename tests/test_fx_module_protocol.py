"""An fx-front-end result behaves like the module it came from (issue 36).

- Casts (``.float()``, ``.half()``, ``.bfloat16()``, ``.double()``, ``.to(dtype)``, ``.type()``):
  on a model whose graph holds a conversion's casts (O1-O3) a cast that would change a parameter's
  dtype is refused before anything changes, naming ``amp_fx.convert`` as the fix; one that changes
  nothing, and ``.to(device)``, work. At O0 (no casts) a cast does what it does to the eager model.
- Containers: a converted ``nn.Sequential`` (``ModuleList``, ``ModuleDict`` subclasses with a
  forward) indexes, counts, iterates and slices like the model, over the same layers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_fx

BF16 = torch.bfloat16


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Dropout(0.0), nn.Linear(8, 3))


def _convert(model: nn.Module, level: str) -> nn.Module:
    return amp_fx.convert(model, level, dtype=BF16, front_end="fx", device_type="cpu")


CASTS = {
    "float": (lambda m: m.float(), torch.float32),
    "double": (lambda m: m.double(), torch.float64),
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), BF16),
    "to(float32)": (lambda m: m.to(torch.float32), torch.float32),
    "to(cpu, float16)": (lambda m: m.to("cpu", torch.float16), torch.float16),
    "to(tensor)": (lambda m: m.to(torch.ones(1, dtype=torch.float64)), torch.float64),
    "type(float16)": (lambda m: m.type(torch.float16), torch.float16),
}


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("cast", list(CASTS))
def test_a_cast_that_breaks_the_graphs_casts_is_refused(level: str, cast: str) -> None:
    apply, dtype = CASTS[cast]
    converted = _convert(_mlp(), level)
    x = torch.randn(2, 4)
    expected = converted(x)
    before = {name: t.dtype for name, t in converted.state_dict().items()}
    if all(t == dtype for t in before.values() if t.is_floating_point):
        assert torch.equal(apply(converted)(x), expected)  # changes nothing: allowed
        return
    with pytest.raises(
        TypeError, match=rf"converted at {level}.*Convert the FP32 model again.*amp_fx\.convert"
    ):
        apply(converted)
    assert {name: t.dtype for name, t in converted.state_dict().items()} == before
    assert torch.equal(converted(x), expected)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_to_a_device_keeps_working(level: str) -> None:
    converted = _convert(_mlp(), level)
    x = torch.randn(2, 4)
    expected = converted(x)
    assert (
        converted.to("cpu") is converted and converted.to(torch.device("cpu"), non_blocking=True) is converted
    )
    assert torch.equal(converted(x), expected)


@pytest.mark.parametrize("cast", ["double", "half", "bfloat16", "to(float32)"])
@pytest.mark.parametrize("level", [None, "O0"])
def test_without_casts_in_the_graph_a_cast_is_the_eager_models(level: str | None, cast: str) -> None:
    from amp_fx.passes.trace import trace

    apply, dtype = CASTS[cast]
    model = _mlp()
    traced = trace(copy.deepcopy(model)) if level is None else _convert(model, level)
    x = torch.randn(2, 4, dtype=dtype)
    assert torch.equal(apply(traced)(x), apply(model)(x))


class Branches(nn.ModuleDict):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self["a"](x) + self["b"](x)


class Stack(nn.ModuleList):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_a_converted_sequential_indexes_counts_and_iterates(level: str) -> None:
    model = _mlp()
    converted = _convert(model, level)
    assert type(converted).__name__ == "Sequential" and len(converted) == len(model)
    layers = list(converted)
    assert [type(m) for m in layers] == [type(m) for m in model]
    assert converted[0] is converted.get_submodule("0") and converted[-1] is converted.get_submodule("4")
    assert converted[-1] is layers[-1] and converted[0] in converted and model[0] not in converted
    if level == "O2":
        assert converted[0].weight.dtype == BF16  # the layer the graph calls, not a copy
    with pytest.raises(IndexError, match="out of range for a Sequential of 5"):
        converted[5]
    with pytest.raises(TypeError, match="indices must be integers or slices"):
        converted["0"]
    copied = copy.deepcopy(converted)
    assert type(copied).__name__ == "Sequential" and len(copied) == 5 and copied[0] is not converted[0]


def test_a_slice_is_the_layers_where_the_graph_holds_no_casts() -> None:
    model = _mlp()
    converted = _convert(model, "O0")
    head = converted[:2]
    assert type(head) is nn.Sequential and list(head) == list(converted)[:2]
    x = torch.randn(2, 4)
    assert torch.equal(head(x), model[:2](x))
    with pytest.raises(TypeError, match=r"amp_fx\.convert\(model\[:2\], 'O2'"):
        _convert(model, "O2")[:2]


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_other_containers_with_a_forward_index_as_they_did(level: str) -> None:
    torch.manual_seed(0)
    branches = _convert(Branches({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}), level)
    assert len(branches) == 2 and list(branches) == ["a", "b"] == branches.keys() and "a" in branches
    assert branches["b"] is branches.get_submodule("b")
    with pytest.raises(KeyError):
        branches["c"]
    stack = _convert(Stack([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]), level)
    assert len(stack) == 3 and stack[2].out_features == 2 and [type(m) for m in stack][1] is nn.ReLU


def test_a_model_that_was_no_container_is_none() -> None:
    converted = _convert(nn.Linear(4, 4), "O2")
    assert bool(converted) and not hasattr(converted, "__len__")
    with pytest.raises(TypeError, match="not subscriptable"):
        converted[0]
