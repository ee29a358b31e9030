"""fuse_activations: at O2 gated activations and written-out tanh GELUs run as one fp32 call.

Both front ends: torch.fx (`amp_fx.convert` of small modules written as real code writes them)
and torch.export (small Hugging Face models called with their defaults). References: the same
conversion with ``fused_activations=False`` (what the graph computed before: a near miss must
leave the graph exactly as it was), the FP32 model within O2's tolerances, and torch.autocast
bit for bit at O1.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import capture_states
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import preset
from amp_fx.ops.activations import fp32_activation, fp32_gated_activation
from amp_fx.testing import assert_equivalent, compare_tensors, tolerances, with_autocast
from tests.bit_equality import bits_equal
from tests.models.hf import MODELS

BF16, F16 = torch.bfloat16, torch.float16
FUSED_OPS = ("fp32_gated_activation", "fp32_activation")


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's NewGELUActivation, as written there."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_cubed(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))


def gelu_power_operator(x):
    return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_half_inside(x):
    return x * (0.5 * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3)))))


class Mlp(nn.Module):
    """up/gate projections, an activation expression, a down projection (the shape of every
    transformer MLP); ``expression(gate, up)`` is what the test varies."""

    def __init__(self, expression, width: int = 12) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, width), nn.Linear(8, width), nn.Linear(width, 8)
        self.expression = expression
        self.silu, self.gelu, self.gelu_tanh = nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down(self.expression(self, self.gate(x), self.up(x)))


class FusedMlp(nn.Module):
    """One projection to both halves, split with ``chunk`` (as some models write a gated MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(8, 24), nn.Linear(12, 8)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


# (expression, the fused function, its activation): the spellings real code writes.
SPELLINGS = {
    "F.silu": (lambda m, g, u: F.silu(g) * u, fp32_gated_activation, "silu"),
    "nn.SiLU, up first": (lambda m, g, u: u * m.silu(g), fp32_gated_activation, "silu"),
    "F.gelu": (lambda m, g, u: F.gelu(g) * u, fp32_gated_activation, "gelu"),
    "nn.GELU": (lambda m, g, u: m.gelu(g) * u, fp32_gated_activation, "gelu"),
    "F.gelu tanh": (lambda m, g, u: F.gelu(g, approximate="tanh") * u, fp32_gated_activation, "gelu_tanh"),
    "nn.GELU tanh": (lambda m, g, u: u * m.gelu_tanh(g), fp32_gated_activation, "gelu_tanh"),
    "gelu_new gated": (lambda m, g, u: new_gelu(g) * u, fp32_gated_activation, "gelu_tanh"),
    "gelu_new": (lambda m, g, u: new_gelu(g), fp32_activation, "gelu_tanh"),
    "gelu_new x*x*x": (lambda m, g, u: gelu_cubed(g), fp32_activation, "gelu_tanh"),
    "gelu_new x**3, x * 0.5": (lambda m, g, u: gelu_power_operator(g), fp32_activation, "gelu_tanh"),
    "gelu_new 0.5 inside": (lambda m, g, u: gelu_half_inside(g), fp32_activation, "gelu_tanh"),
}

# Expressions that must be left exactly as they are.
NEAR_MISSES = {
    "another cubic constant": lambda m, g, u: (
        0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.0447 * torch.pow(g, 3.0))))
    ),
    "square, not cube": lambda m, g, u: (
        0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 2.0))))
    ),
    "tanh of another value": lambda m, g, u: (
        0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * torch.pow(g, 3.0))))
    ),
    "an intermediate read elsewhere": lambda m, g, u: (lambda a: a * u + a)(F.silu(g)),
    "in-place silu": lambda m, g, u: F.silu(g, inplace=True) * u,
    "sigmoid gate": lambda m, g, u: torch.sigmoid(g) * u,
    "added, not multiplied": lambda m, g, u: F.silu(g) + u,
    "float32 gate": lambda m, g, u: F.silu(g.float()) * u.float(),
}


def _convert(
    model: nn.Module, fused: bool, level: str = "O2", dtype: torch.dtype = BF16, front_end: str = "fx"
) -> nn.Module:
    converted = amp_fx.convert(
        model,
        level,
        policy=preset(level, dtype=dtype, device_type="cpu", fused_activations=fused),
        front_end=front_end,
    )
    if front_end == "export":
        converted(*_inputs())  # the export front end captures on the first call
    return converted


def _nodes(model: nn.Module) -> list[torch.fx.Node]:
    """The nodes of every graph the converted model captured, on either front end."""
    return [n for gm in amp_fx.report(model).graphs.values() for n in gm.graph.nodes]


def _fused_nodes(model: nn.Module) -> list[torch.fx.Node]:
    return [n for n in _nodes(model) if node_info(n).op in FUSED_OPS]


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_each_spelling_becomes_one_call(spelling: str, front_end: str) -> None:
    expression, function, activation = SPELLINGS[spelling]
    torch.manual_seed(0)
    model = Mlp(expression)
    converted = _convert(model, fused=True, front_end=front_end)
    (node,) = _fused_nodes(converted)
    assert node.target is function and node.args[-1] == activation
    # Nothing of the expression is left: no elementwise op, no cast between the projections.
    nodes = _nodes(converted)
    assert not {"mul", "add", "silu", "gelu", "tanh", "pow"} & {node_info(n).op for n in nodes}
    assert sum(node_info(n).is_cast for n in nodes) == 2  # the model's input and output
    assert any("replaced" in note for note in node_info(node).notes)
    assert_equivalent(model, converted, _inputs(), dtype=BF16)


def test_chunks_of_one_projection_fuse() -> None:
    torch.manual_seed(0)
    model = FusedMlp()
    gm = _convert(model, fused=True)
    (node,) = _fused_nodes(gm)
    assert [node_info(a).op for a in node.args[:2]] == ["getitem", "getitem"]
    assert_equivalent(model, gm, _inputs(), dtype=BF16)


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("miss", list(NEAR_MISSES))
def test_near_misses_are_left_alone(miss: str, front_end: str) -> None:
    torch.manual_seed(0)
    model = Mlp(NEAR_MISSES[miss])
    fused = _convert(model, fused=True, front_end=front_end)
    unfused = _convert(model, fused=False, front_end=front_end)
    assert not _fused_nodes(fused)
    codes = [[gm.code for gm in amp_fx.report(m).graphs.values()] for m in (fused, unfused)]
    assert codes[0] == codes[1] != []


def test_a_hooked_module_and_a_float32_reader_are_left_alone() -> None:
    torch.manual_seed(0)
    hooked = Mlp(SPELLINGS["nn.SiLU, up first"][0])
    hooked.silu.register_forward_hook(lambda module, args, out: None)
    assert not _fused_nodes(_convert(hooked, fused=True))

    class ReturnsTheGelu(Mlp):
        def forward(self, x):  # the float32 value itself is an output, not cast down
            return new_gelu(self.gate(x))

    assert not _fused_nodes(_convert(ReturnsTheGelu(SPELLINGS["F.silu"][0]), fused=True))


def test_default_on_at_o2_only_and_o1_stays_autocast() -> None:
    assert preset("O2", device_type="cpu").fused_activations
    assert preset("O2", device_type="cuda").fused_activations
    assert not any(preset(level, device_type="cpu").fused_activations for level in ("O0", "O1", "O3"))
    torch.manual_seed(0)
    model = Mlp(SPELLINGS["gelu_new gated"][0])
    assert len(_fused_nodes(amp_fx.convert(model, "O2", dtype=F16))) == 1
    o1 = amp_fx.convert(model, "O1", dtype=BF16)
    assert not _fused_nodes(o1)
    assert_equivalent(with_autocast(model, "cpu", BF16), o1, _inputs(), exact=True)


def test_converting_again_keeps_the_calls() -> None:
    torch.manual_seed(0)
    gm = _convert(Mlp(SPELLINGS["gelu_new"][0]), fused=True)
    again = _convert(gm, fused=True)
    assert len(_fused_nodes(again)) == 1
    assert torch.equal(again(*_inputs()), gm(*_inputs()))


# ---- torch.export front end: small Hugging Face models called with their defaults ------------


def _hf_fused(model: nn.Module) -> list[torch.fx.Node]:
    return [n for _, state in capture_states(model) for g in state.graphs for n in _fused_nodes(g)]


# Llama's SwiGLU, GPT-2's written-out gelu_new and Gemma 3's GeGLU (gelu_pytorch_tanh): one call
# per layer (the test models have two). Each costs 10-25 s on CI's CPU: GPT-2 runs by default.
@pytest.mark.parametrize(
    ("name", "function", "activation"),
    [
        pytest.param("llama", fp32_gated_activation, "silu", marks=pytest.mark.slow),
        ("gpt2", fp32_activation, "gelu_tanh"),
        pytest.param("gemma3", fp32_gated_activation, "gelu_tanh", marks=pytest.mark.slow),
    ],
)
def test_hugging_face_mlps_fuse_at_o2(name, function, activation) -> None:
    torch.manual_seed(0)
    model, make_inputs = MODELS[name]()
    model.eval()  # no dropout: the same function on both sides
    inputs = make_inputs(2, 8)
    reference = with_autocast(model, "cpu", BF16)(**inputs)
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    output = converted(**inputs)
    fused = _hf_fused(converted)
    assert len(fused) == 2 and all(n.target is function and n.args[-1] == activation for n in fused)
    assert type(output.loss) is torch.Tensor
    rtol, atol = tolerances(BF16)
    for actual, expected, what in (
        (output.loss, reference.loss, "loss"),
        (output.logits, reference.logits, "logits"),
    ):
        assert compare_tensors(actual.float(), expected.float(), rtol=rtol, atol=atol, name=what) is None
    output.loss.backward()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hugging_face_o1_is_unchanged(name) -> None:
    torch.manual_seed(0)
    model, make_inputs = MODELS[name]()
    model.eval()
    inputs = make_inputs(2, 8)
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    output, reference = converted(**inputs), with_autocast(model, "cpu", BF16)(**inputs)
    assert not _hf_fused(converted)
    assert bits_equal(output.loss, reference.loss) and bits_equal(output.logits, reference.logits)
