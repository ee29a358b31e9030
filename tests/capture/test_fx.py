"""Tests for `amp_fx.capture.fx`: primitive leaves, opaque nodes, errors, torchvision models."""

from __future__ import annotations

import gc
import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx._symbolic_trace import _wrapped_fns_to_patch as registry

import amp_fx
from amp_fx.capture.fx import TraceError, trace
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule


def _call_modules(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "call_module"]


def _opaque(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Opaque node -> its opaque_reason (node target for modules, node name for functions)."""
    return {
        (n.target if n.op == "call_module" else n.name): node_info(n).opaque_reason
        for n in gm.graph.nodes
        if node_info(n).rule is Rule.OPAQUE
    }


def _line_of(obj, text: str) -> int:
    lines, first = inspect.getsourcelines(obj)
    return first + next(i for i, line in enumerate(lines) if text in line)


class DataDependentGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        if x.sum() > 0:
            return x * self.scale
        return -x


class Block(nn.Module):
    """A traceable block holding an untraceable gate: only the gate must become opaque."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = DataDependentGate()

    def forward(self, x):
        return torch.relu(self.gate(self.fc(x))) + x


class FlagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, use_fc=True):
        if use_fc:
            return self.fc(x)
        return x


@torch.fx.wrap
def wrapped_scale(x, factor: float):
    return x * factor


class UsesWrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return wrapped_scale(h, 1.0 / math.sqrt(h.shape[-1]))


def test_primitive_modules_are_leaves_and_containers_are_traced_through():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 2))
    gm = trace(model)
    assert _call_modules(gm) == ["0", "1", "2", "3", "4"]
    assert _opaque(gm) == {}


def test_transformer_encoder_layer_is_traced_through_with_opaque_attention():
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    # As the root, its optional mask arguments would be traced as inputs: specialise them.
    gm = trace(layer, concrete_args={"src_mask": None, "src_key_padding_mask": None, "is_causal": False})
    modules = _call_modules(gm)
    assert "self_attn" in modules and "linear1" in modules and "norm2" in modules
    assert "" not in modules  # the layer itself was traced through
    assert set(_opaque(gm)) == {"self_attn"}
    assert "MultiheadAttention" in _opaque(gm)["self_attn"]
    x = torch.randn(2, 5, 16)
    # Grad enabled: eager takes torch's slow path too, so the results must match bit for bit.
    assert torch.equal(gm(x), layer(x))


def test_transformer_encoder_is_traced_through_its_layers():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=False))
    gm = trace(model.eval())
    assert set(_opaque(gm)) == {"0.layers.0.self_attn", "0.layers.1.self_attn"}
    assert {"0.layers.0.linear1", "0.layers.1.norm2", "0.norm"} <= set(_call_modules(gm))
    x = torch.randn(2, 5, 16)
    assert torch.equal(gm(x), model(x))


def test_a_mask_the_tracer_cannot_inspect_makes_only_the_layers_opaque():
    class CausalEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
            return self.encoder(x, mask=mask, is_causal=True)

    model = CausalEncoder().eval()
    gm = trace(model)
    opaque = _opaque(gm)
    assert set(opaque) == {"encoder.layers.0", "encoder.layers.1"}
    # The reported line is the call that received the traced mask, not torch's argument check.
    assert "torch/nn/modules/transformer.py" in opaque["encoder.layers.0"]
    assert "raise" not in opaque["encoder.layers.0"]
    x = torch.randn(2, 5, 8)
    assert torch.equal(gm(x), model(x))


def test_untraceable_submodule_becomes_opaque_with_file_line_and_source():
    model = Block()
    gm = trace(model)
    assert set(_opaque(gm)) == {"gate"}
    reason = _opaque(gm)["gate"]
    line = _line_of(DataDependentGate.forward, "if x.sum() > 0:")
    assert reason.startswith("untraceable: ")
    assert f"{Path(__file__).name}:{line}: if x.sum() > 0:" in reason
    assert "fc" in _call_modules(gm)  # the rest of the block is traced
    gate = next(n for n in gm.graph.nodes if n.target == "gate")
    assert node_info(gate).op == "DataDependentGate"
    for sign in (1.0, -1.0):
        x = sign * torch.rand(3, 4) + sign
        assert torch.equal(gm(x), model(x))


def test_untraceable_modules_deep_in_the_hierarchy_are_all_found():
    model = nn.Sequential(Block(), nn.ReLU(), Block())
    gm = trace(model)
    assert set(_opaque(gm)) == {"0.gate", "2.gate"}
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), model(x))


def test_leaf_modules_by_type_and_by_name():
    model = nn.Sequential(Block(), Block(), nn.Linear(4, 4))
    by_type = trace(model, leaf_modules=(Block,))
    assert set(_opaque(by_type)) == {"0", "1"}
    assert all(reason == "leaf_modules: Block" for reason in _opaque(by_type).values())
    by_name = trace(model, leaf_modules=("1", "2"))
    assert {"1", "2"} <= set(_opaque(by_name))
    assert "0.fc" in _call_modules(by_name)
    assert "0.gate" in _opaque(by_name)  # still found automatically


def test_leaf_modules_rejects_unknown_names_and_bad_entries():
    model = Block()
    with pytest.raises(ValueError, match=r"'missing'.*named_modules"):
        trace(model, leaf_modules=("missing",))
    with pytest.raises(TypeError, match="leaf_modules entries"):
        trace(model, leaf_modules=(42,))


def test_not_a_module_is_rejected():
    with pytest.raises(TypeError, match="nn.Module"):
        trace(lambda x: x)


def test_untraceable_top_level_forward_raises_with_line_and_concrete_args_hint():
    line = _line_of(FlagModel.forward, "if use_fc:")
    with pytest.raises(TraceError) as caught:
        trace(FlagModel())
    message = str(caught.value)
    assert f"{Path(__file__).name}:{line}" in message
    assert "`if use_fc:`" in message
    assert "concrete_args={'use_fc': True}" in message
    assert isinstance(caught.value, TypeError)


def test_concrete_args_specialises_the_forward():
    model = FlagModel()
    x = torch.randn(2, 4)
    with_fc = trace(model, concrete_args={"use_fc": True})
    without_fc = trace(model, concrete_args={"use_fc": False})
    assert "fc" in _call_modules(with_fc) and "fc" not in _call_modules(without_fc)
    assert torch.equal(with_fc(x), model(x, True))
    assert torch.equal(without_fc(x, False), x)
    with pytest.raises(AssertionError, match="specialized"):
        without_fc(x, True)


def test_fx_wrapped_functions_are_opaque_but_torch_and_math_are_not():
    model = UsesWrapped()
    gm = trace(model)
    opaque = _opaque(gm)
    assert list(opaque) == ["wrapped_scale"]  # F.linear, getattr and math.sqrt are not opaque
    assert opaque["wrapped_scale"].startswith("fx.wrap: ")
    assert opaque["wrapped_scale"].endswith("wrapped_scale")
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), model(x))


def test_freed_graphs_leave_no_fx_wrap_registrations_behind():
    """Converted graphs register their generated code's globals with torch.fx.wrap (so that
    tracing them again keeps their casts as calls); a trace first forgets those of graphs that
    were freed or recompiled, and keeps those of live ones."""

    def generated() -> int:  # registrations of generated code (a real module's globals have a name)
        return sum(1 for frame_dict in registry.values() if "__name__" not in frame_dict)

    def convert(model: nn.Module) -> torch.fx.GraphModule:
        return amp_fx.convert(model, "O2", dtype=torch.bfloat16, device_type="cpu")

    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    live = convert(model)
    gc.collect()
    trace(model)
    before = generated()
    for _ in range(20):
        convert(model)
    gc.collect()  # the freed graphs' generated code (classes are collected by the cycle collector)
    trace(model)
    # The last trace's patches may still hold one freed graph's globals: at most one is left.
    assert generated() <= before + 1, f"{generated() - before} registrations left by 20 freed graphs"
    # The live graph's registration is kept: converting it again leaves its casts as they are.
    again = convert(live)
    casts = [n for n in again.graph.nodes if node_info(n).is_cast]
    assert casts and len(casts) == sum(1 for n in live.graph.nodes if node_info(n).is_cast)


def test_input_model_is_left_untouched():
    torch.manual_seed(0)
    model = Block()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = dict(model.named_modules())
    gm = trace(model)
    gm.half()  # a later pass changing parameter dtypes must not reach the model
    with torch.no_grad():
        next(gm.parameters()).zero_()
    assert dict(model.named_modules()) == modules_before
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, before[name]), name
    shared = {id(p) for p in model.parameters()} & {id(p) for p in gm.parameters()}
    assert not shared


class SkipsSomeState(nn.Module):
    """A forward that never calls ``unused``, never reads ``step_count`` and ties ``head`` to ``embed``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.unused = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("step_count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x).relu()


class _WithExtraState(nn.Linear):
    """A module whose state_dict holds a non-tensor entry, `_extra_state`."""

    def get_extra_state(self) -> dict[str, int]:
        return {"version": 2}

    def set_extra_state(self, state: dict[str, int]) -> None:
        assert state == {"version": 2}


class _SkipsAModuleWithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.skipped = _WithExtraState(2, 2), _WithExtraState(2, 2)
        self.register_buffer("never_read", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_state_the_forward_never_reads_is_kept_under_its_name():
    # torch.fx keeps only what the graph reads; a checkpoint must still round-trip strictly.
    model = SkipsSomeState()
    gm = trace(model)
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    SkipsSomeState().load_state_dict(gm.state_dict())
    gm.load_state_dict(SkipsSomeState().state_dict())
    assert gm.head.weight is gm.embed.weight  # still tied
    assert _call_modules(gm) == ["embed"]  # the graph itself is unchanged
    # Copies: nothing of the model's is shared (both hold their tensors, so no id is reused).
    originals = [*model.parameters(), *model.buffers()]
    assert not {id(t) for t in originals} & {id(t) for t in [*gm.parameters(), *gm.buffers()]}
    # Non-tensor state (`_extra_state`) of a module called as a leaf and of a skipped one.
    model = _SkipsAModuleWithExtraState()
    gm = trace(model, leaf_modules=[_WithExtraState])
    assert sorted(gm.state_dict()) == sorted(model.state_dict())


def test_training_mode_is_copied_and_leaf_modules_follow_train_eval():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    gm = trace(model)
    assert gm.training and gm.get_submodule("1").training
    gm.eval()
    assert model.training and model.get_submodule("1").training  # the model has its own modules
    x = torch.randn(8, 4)
    assert torch.equal(gm(x), model.eval()(x))
    assert trace(model).training is False


def test_functional_calls_keep_their_module_hierarchy():
    gm = trace(nn.Sequential(Block()))
    relu = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.relu)
    stack = [path for path, _ in relu.meta["nn_module_stack"].values()]
    assert stack == ["0"]


class TinyGPT(nn.Module):
    """Embedding, a hand-written causal attention block with sdpa, and nn.TransformerEncoderLayer."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(8, dim)
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, batch_first=True, norm_first=True)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        q, k, v = self.qkv(self.ln(x)).split(x.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(self.layer(x))


def test_small_gpt_traces_bit_identically():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    gm = trace(model)
    assert set(_opaque(gm)) == {"layer.self_attn"}
    idx = torch.randint(0, 50, (2, 7))
    assert torch.equal(gm(idx), model(idx))


# torchvision classification models: (constructor kwargs, input side). Cheap ones run by default.
TORCHVISION_MODELS = {
    "resnet18": ({}, 32),
    "resnet50": ({}, 32),
    "resnext50_32x4d": ({}, 32),
    "wide_resnet50_2": ({}, 32),
    "mobilenet_v2": ({}, 32),
    "mobilenet_v3_small": ({}, 32),
    "efficientnet_b0": ({}, 32),
    "efficientnet_v2_s": ({}, 32),
    "regnet_y_400mf": ({}, 32),
    "mnasnet0_5": ({}, 32),
    "shufflenet_v2_x1_0": ({}, 32),
    "squeezenet1_0": ({}, 64),
    "densenet121": ({}, 32),
    "alexnet": ({}, 64),
    "vgg11": ({}, 32),
    "googlenet": ({"aux_logits": False, "init_weights": False}, 32),
    "inception_v3": ({"aux_logits": False, "init_weights": False}, 80),
    "convnext_tiny": ({}, 32),
    "vit_b_16": ({"image_size": 32}, 32),
    "swin_t": ({}, 64),
    "maxvit_t": ({}, 224),
}
CHEAP_MODELS = {"resnet18", "mobilenet_v3_small", "squeezenet1_0", "mnasnet0_5", "efficientnet_b0"}
# Opaque nodes each model must have, by kind: torchvision's fx.wrap'ed functions and MHA leaves.
EXPECTED_OPAQUE = {
    "efficientnet_b0": {"stochastic_depth"},
    "efficientnet_v2_s": {"stochastic_depth"},
    "convnext_tiny": {"stochastic_depth"},
    "vit_b_16": {"MultiheadAttention"},
    "swin_t": {
        "stochastic_depth",
        "shifted_window_attention",
        "_get_relative_position_bias",
        "_patch_merging_pad",
    },
    "maxvit_t": {"stochastic_depth"},
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if name in CHEAP_MODELS else pytest.mark.slow)
        for name in TORCHVISION_MODELS
    ],
)
def test_torchvision_model_traces_bit_identically(name):
    torchvision = pytest.importorskip("torchvision")
    kwargs, side = TORCHVISION_MODELS[name]
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, num_classes=10, **kwargs).eval()
    gm = trace(model)
    kinds = {node_info(n).op for n in gm.graph.nodes if node_info(n).rule is Rule.OPAQUE}
    assert kinds == EXPECTED_OPAQUE.get(name, set())
    assert not any(r.startswith("untraceable") for r in _opaque(gm).values())
    x = torch.randn(1 if side > 100 else 2, 3, side, side)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
