"""In-place ops whose kernels take one dtype, written into a buffer O2 keeps FP32 (both front ends).

O2 keeps norms and FP32 islands (softmax, sums) in FP32 where CPU autocast leaves them in the
dtype that flows in, so a buffer made with ``dtype=x.dtype`` or ``zeros_like(x)`` from such a value
is FP32 under O2 and bf16 under autocast, while the product written into it is bf16 in both. The
in-place op keeps the buffer's dtype, so O2 casts its sources to it (`input_cast_dtypes`), as
eager's matching dtypes have them. Each model is checked against torch.autocast with the relative
oracle, and a training step must move every parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.core.policy import preset
from amp_fx.testing import assert_equivalent

BF16 = torch.bfloat16


class Writes(nn.Module):
    """A product written in place into a buffer whose dtype comes from a norm or a softmax."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)
        self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("index", torch.tensor([0, 2, 2, 1]), persistent=False)

    def forward(self, x):
        h = self.norm(self.embed(x))  # FP32 under O2, bf16 under CPU autocast
        y, kind, index = self.fc(h), self.kind, self.index
        if kind == "index_add_":
            out = torch.zeros(5, 4, dtype=h.dtype).index_add_(0, index, y)
        elif kind == "index_put_accumulate":
            out = torch.zeros(5, 4, dtype=h.dtype)
            out.index_put_((index,), y, accumulate=True)
        elif kind == "index_copy_":
            out = torch.zeros(5, 4, dtype=h.dtype)
            out.index_copy_(0, torch.arange(4), y)
        elif kind == "setitem":
            out = torch.zeros_like(h)
            out[index] = y
        elif kind == "scatter_add_":
            weights = torch.softmax(h, -1)  # an FP32 island under O2
            out = torch.zeros_like(weights).scatter_add_(1, index.expand(4, 4), y)
        elif kind == "masked_scatter_":
            out = h.clone()
            out.masked_scatter_(h > 0, y)
        elif kind == "index_add_to_dtype":
            # torch.export captures under autocast, where h is bf16: `.to(bf16)` is in the graph,
            # and O2's FP32 norm makes h FP32 when it runs (index_add's promote rule casts).
            out = torch.zeros_like(h).index_add(0, index, y.to(h.dtype))
        elif kind == "lerp_":
            out = h.clone()
            out.lerp_(y, 0.25)
        return self.head(out)


KINDS = [
    "index_add_",
    "index_put_accumulate",
    "index_copy_",
    "setitem",
    "scatter_add_",
    "masked_scatter_",
    "lerp_",
    "index_add_to_dtype",
]


def _case(kind: str):
    torch.manual_seed(0)
    return Writes(kind), (torch.randn(4, 4),)


def _convert(model: nn.Module, front_end: str) -> nn.Module:
    return amp_fx.convert(copy.deepcopy(model), policy=preset("O2", BF16, "cpu"), front_end=front_end)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_in_place_writes_into_fp32_buffers_run_as_accurately_as_autocast(kind, front_end) -> None:
    model, inputs = _case(kind)
    converted = _convert(model, front_end)
    out = converted(*inputs)
    assert type(out) is torch.Tensor and out.dtype == torch.float32
    assert_equivalent(model, converted, inputs)


@pytest.mark.parametrize("kind", ["index_add_", "setitem", "scatter_add_"])
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_a_training_step_through_in_place_writes_moves_every_parameter(kind, front_end) -> None:
    model, inputs = _case(kind)
    converted = _convert(model, front_end)
    optimizer = amp_fx.optim.FusedAdam(converted.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in converted.named_parameters()}
    converted(*inputs).float().square().mean().backward()
    optimizer.step()
    assert not [n for n, p in converted.named_parameters() if torch.equal(p, before[n])]


def test_the_destination_keeps_its_dtype_and_is_never_cast() -> None:
    # The source is cast to the buffer's dtype; the buffer itself is updated, not a copy of it.
    model, inputs = _case("index_add_")
    converted = _convert(model, "fx")
    calls = [n for n in converted.graph.nodes if n.target == "index_add_"]
    assert len(calls) == 1
    destination, source = calls[0].args[0], calls[0].args[3]
    assert destination.target is torch.zeros
    assert source.target == "to" and source.args[1] == torch.float32
