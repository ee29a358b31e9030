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
    from amp_fx.capture.fx import trace

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
    stack = _convert(Stack([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]), "O2")
    with pytest.raises(TypeError, match=r"amp_fx\.convert\(model\[:2\], 'O2'"):
        stack[:2]  # a ModuleList's slice is no chain to cut from the graph


class Scale(nn.Module):
    """A layer the tracer goes into (its ops carry the layer's nn_module_stack)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight)


class Noisy(nn.Module):
    """A layer whose graph differs by mode (it reads self.training)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 1.0, self.training)


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8), nn.GELU(), Scale(8), nn.LayerNorm(8), nn.Linear(8, 8), nn.SiLU(), Scale(8)
    )


def _intermediates(model: nn.Module, x: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Each layer's output in one call of ``model`` (forward hooks), where the graph calls the layer
    as a module (O1 computes a Linear without calling it; a hook on a layer traced through is
    refused), and the model's output."""
    outputs: dict[int, torch.Tensor] = {}
    called = {node.target for node in model.graph.nodes if node.op == "call_module"}
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out, i=i: outputs.__setitem__(i, out))
        for i, layer in enumerate(model)
        if str(i) in called
    ]
    try:
        return outputs, model(x)
    finally:
        for hook in hooks:
            hook.remove()


SLICES = [slice(0, 2), slice(1, 3), slice(2, 4), slice(2, None), slice(-4, -1), slice(5, 7), slice(None)]


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("index", SLICES, ids=str)
def test_a_slice_runs_its_part_of_the_converted_graph(level: str, index: slice) -> None:
    from amp_fx.testing.dtype_tolerances import RELATIVE_BOUND
    from amp_fx.testing.relative_error import error_ratio

    model = _chain().eval()
    converted = _convert(model, level).eval()
    start, stop, _ = index.indices(len(model))
    x = torch.randn(6, 8)
    seen, output = _intermediates(converted, x)
    part = converted[index]
    assert type(part).__name__ == "Sequential" and len(part) == stop - start
    assert list(part) == list(converted)[index]  # the same layers, not copies
    assert {id(p) for p in part.parameters()} <= {id(p) for p in converted.parameters()}
    # The pieces before, of and after the slice compose to the whole model, bit for bit ...
    value = part(converted[:start](x))
    assert torch.equal(converted[stop:](value), output)
    # ... and the slice hands on what the whole model's layer computes (where a hook sees it).
    if stop - 1 in seen and (start == 0 or start - 1 in seen):
        expected = output if stop == len(model) else seen[stop - 1]  # the output casts at the end
        assert torch.equal(part(x if start == 0 else seen[start - 1]), expected)
    # Against eager FP32 and torch.autocast, from the FP32 model's own intermediate value.
    fp32_input = x if start == 0 else model[:start](x)
    measured = error_ratio(model[index], part, (fp32_input,))
    assert measured.ratio <= RELATIVE_BOUND, measured


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("index", [slice(None, None, 2), slice(None, None, -1), slice(5, 0, -2)], ids=str)
def test_a_stepped_slice_chains_the_converted_layers(level: str, index: slice) -> None:
    from amp_fx.testing.dtype_tolerances import RELATIVE_BOUND
    from amp_fx.testing.relative_error import error_ratio

    model = _chain().eval()
    converted = _convert(model, level).eval()
    part = converted[index]
    assert list(part) == list(converted)[index]
    measured = error_ratio(model[index], part, (torch.randn(6, 8),))
    assert measured.ratio <= RELATIVE_BOUND, measured


def test_a_slice_runs_the_graph_of_its_mode() -> None:
    torch.manual_seed(0)
    converted = _convert(nn.Sequential(nn.Linear(4, 4), Noisy(), nn.Linear(4, 4)), "O2").eval()
    part = converted[1:]
    x = torch.randn(2, 4)
    assert torch.equal(part(x), converted[2](x.to(BF16)))
    assert torch.equal(part.train()(x), converted[2](torch.zeros(2, 4, dtype=BF16)))


def test_a_slice_that_would_split_fused_layers_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.ReLU(), nn.Flatten()
    )
    # O2 for CUDA runs the BatchNorm and its ReLU as one call (fuse_batch_norm).
    converted = amp_fx.convert(model, "O2", dtype=torch.float16, front_end="fx", device_type="cuda")
    for index, shown in [(slice(2, None), "2:"), (slice(0, 2), "0:2"), (slice(3, 5), "3:5")]:
        with pytest.raises(TypeError, match=rf"fused it with.*amp_fx\.convert\(model\[{shown}\], 'O2'"):
            converted[index]
    assert len(converted[4:]) == 2  # away from the fused layers


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


class Same(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_layer_that_computes_nothing_is_cut_around(level: str) -> None:
    torch.manual_seed(0)
    converted = _convert(nn.Sequential(nn.Linear(4, 4), Same(), nn.Linear(4, 4)), level)
    x = torch.randn(2, 4)
    for cut in (1, 2):
        assert torch.equal(converted[cut:](converted[:cut](x)), converted(x))
    assert len(converted[1:2]) == 1
