"""drop_empty_concats: a cache's first append is the keys themselves, and nothing else changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.passes.drop_empty_concats import drop_empty_concats
from tests.models.hf import MODELS


class _Append(nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, key: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.ones(self.shape), key.transpose(0, 1)], dim=-2) * 2


def _concats(gm: torch.fx.GraphModule) -> int:
    return sum(node.target is torch.ops.aten.cat.default for node in gm.graph.nodes)


@pytest.mark.parametrize(
    ("shape", "dropped"),
    [
        ((0,), True),  # the cache's lazy start: a 1-D empty tensor, which torch.cat skips
        ((0, 3), True),  # empty along the concatenated dimension
        ((1, 3), False),  # not empty
    ],
)
def test_a_concatenation_with_empty_tensors_is_its_one_tensor(shape: tuple[int, ...], dropped: bool) -> None:
    key = torch.randn(3, 4)
    module = _Append(shape)
    gm = torch.export.export(module, (key,)).module()
    assert drop_empty_concats(gm).modified is dropped
    assert (_concats(gm) == 0) is dropped
    assert torch.equal(gm(key), module(key))


def test_an_empty_tensor_of_a_wider_dtype_is_kept() -> None:
    """torch.cat promotes to the widest dtype, empty inputs included: the output is not the key."""

    class Promote(nn.Module):
        def forward(self, key: torch.Tensor) -> torch.Tensor:
            return torch.cat([torch.zeros(0, dtype=torch.float32), key], dim=-1)

    key = torch.randn(3, 4, dtype=torch.bfloat16)
    gm = drop_empty_concats(torch.export.export(Promote(), (key,)).module()).graph_module
    assert _concats(gm) == 1 and gm(key).dtype == torch.float32


def test_a_default_call_computes_what_a_call_without_a_cache_computes() -> None:
    """GPT-2's default call: attention reads the step's keys as they are, no copy in between."""
    model, make_inputs = MODELS["gpt2"]()
    converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    output = converted(**make_inputs(2, 8))
    (graph,) = amp_fx.captured_graphs(converted)
    assert _concats(graph) == 0 and "lifted_tensor" not in graph.code
    assert all(
        type(t) is torch.Tensor for layer in output.past_key_values.layers for t in (layer.keys, layer.values)
    )
