"""Tests for `amp_fx.passes.insert_casts`: casts as named nodes, functional forms, autocast islands.

The reference is torch.autocast itself: on CPU the O1 graph must compute bit for bit what the
model computes under ``torch.autocast("cpu", dtype)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.capture.fx import trace
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule, preset
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.ops.casts import cast_if_floating
from amp_fx.passes.cast_parameters import cast_parameters
from amp_fx.passes.classify import classify
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.propagate_dtypes import propagate_dtypes
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.decisions import plan_parameters

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _inserted_in_context(
    gm: torch.fx.GraphModule, policy, example_inputs=None
) -> tuple[torch.fx.GraphModule, Conversion]:
    """``gm`` through the passes up to `insert_casts`, and the context they ran in."""
    gm = classify(normalize_ops(gm).graph_module, Conversion(policy)).graph_module
    context = plan_parameters(gm, Conversion(policy, example_inputs))
    propagate_dtypes(gm, context)
    insert_casts(gm, context)
    gm.graph.lint()
    gm.recompile()
    return gm, context


def _inserted(model: nn.Module, policy, example_inputs=None) -> torch.fx.GraphModule:
    return _inserted_in_context(trace(model), policy, example_inputs)[0]


def _casts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if node_info(n).is_cast]


def _assert_matches_autocast(model: nn.Module, gm: torch.fx.GraphModule, inputs, dtype) -> None:
    with torch.no_grad():
        expected = model(*inputs) if dtype is None else None
        if dtype is not None:
            with torch.autocast("cpu", dtype=dtype):
                expected = model(*inputs)
        actual = gm(*inputs)
    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.fc1(x).sum()


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_o1_linear_becomes_functional_with_named_weight_casts(dtype):
    model = TwoLayers()
    gm = _inserted(model, preset("O1", dtype, "cpu"))
    name = str(dtype).removeprefix("torch.")
    code = gm.code
    assert f"fc1_weight_to_{name} = fc1_weight.to(torch.{name})" in code
    assert "torch._C._nn.linear" in code and "self.fc1(" not in code
    fc1_calls = [n for n in gm.graph.nodes if n.target is F.linear and "fc1" in n.name]
    assert len(fc1_calls) == 2
    # One cast of x and one of each weight serve both calls of fc1, as autocast caches weight casts.
    weight_casts = [n for n in _casts(gm) if n.name.startswith("fc1_weight")]
    assert len(weight_casts) == 1
    assert [n.name for n in _casts(gm)].count(f"x_to_{name}") == 1
    for cast in _casts(gm):
        assert node_info(cast).cast_reason and node_info(cast).rule is Rule.PASSTHROUGH
    # Parameters keep their names: the module is still where it was.
    assert dict(gm.named_parameters()).keys() == dict(model.named_parameters()).keys()
    _assert_matches_autocast(model, gm, (torch.randn(3, 8),), dtype)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
def test_o1_conv_functional_form_keeps_the_modules_semantics(padding_mode):
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=1, groups=1, padding_mode=padding_mode),
        nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1),
        nn.PReLU(2),
    )
    gm = _inserted(model, preset("O1", BF16, "cpu"))
    assert not any(n.op == "call_module" and n.target in ("0", "1", "2") for n in gm.graph.nodes)
    _assert_matches_autocast(model, gm, (torch.randn(2, 3, 9, 9),), BF16)


def test_o1_conv1d_and_conv3d_with_string_padding():
    model = nn.Sequential(nn.Conv1d(4, 4, 3, padding="same", groups=2), nn.Conv1d(4, 2, 2, padding="valid"))
    gm = _inserted(model, preset("O1", F16, "cpu"))
    _assert_matches_autocast(model, gm, (torch.randn(2, 4, 7),), F16)
    model3 = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1, padding_mode="circular"))
    _assert_matches_autocast(
        model3, _inserted(model3, preset("O1", F16, "cpu")), (torch.randn(1, 2, 4, 4, 4),), F16
    )


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        out = self.attn(x, x, x, need_weights=False)[0]
        return torch.einsum("bij,bkj->bik", self.norm(out), x)


def test_o1_opaque_module_and_composite_op_run_in_autocast_islands():
    model = Attention()
    gm = _inserted(model, preset("O1", BF16, "cpu"))
    islands = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    islands = {name: m for name, m in islands.items() if isinstance(m, AutocastIsland)}
    assert set(islands) == {"attn_autocast", "einsum_autocast"}
    assert islands["attn_autocast"].wrapped is gm.get_submodule("attn")
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in repr(islands["attn_autocast"])
    assert "self.attn_autocast(" in gm.code
    # The island refers to the module: its parameters are not duplicated or renamed.
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    _assert_matches_autocast(model, gm, (torch.randn(2, 3, 8),), BF16)


def test_o3_opaque_module_runs_without_autocast_on_low_inputs():
    model = Attention()
    gm = _inserted(model, preset("O3", BF16, "cpu"))
    assert not any(isinstance(m, AutocastIsland) for m in gm.modules())
    attn = next(n for n in gm.graph.nodes if n.name == "attn")
    assert node_info(attn.args[0]).is_cast and attn.args[0].args[1] == BF16


def test_o2_fp32_island_casts_up_and_the_next_lower_op_casts_down():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.fc2(torch.softmax(self.fc1(x), -1))

    gm = _inserted(Net(), preset("O2", F16, "cpu"))
    code = gm.code
    assert "fc1_to_float32 = fc1.to(torch.float32)" in code
    assert "softmax_to_float16 = softmax.to(torch.float16)" in code
    # At O2 the weights are cast in storage (cast_parameters), not in the graph.
    assert "self.fc1(" in code and "weight" not in code


def test_model_input_casts_are_guarded_and_leave_integer_inputs_alone():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    # O3: the embedding takes the entry cast (O2 runs embeddings FP32 and needs none).
    gm = _inserted(model, preset("O3", F16, "cpu"))
    entry = next(n for n in gm.graph.nodes if n.op == "placeholder")
    (cast,) = entry.users
    assert cast.target is cast_if_floating and cast.meta.get("is_wrapped")
    # The graph calls the runtime op in amp_fx.ops, not a function of the passes.
    assert f"{cast.name} = amp_fx_ops_casts_cast_if_floating({entry.name}, torch.float16)" in gm.code
    gm.get_submodule("0").half()
    gm.get_submodule("1").half()
    assert gm(torch.tensor([[1, 2]])).dtype == F16  # the ids went through unchanged
    # With example inputs the dtype is known: an int64 input gets no cast at all, a float32 one
    # a plain x.to(dtype).
    exact = _inserted(model, preset("O3", F16, "cpu"), (torch.tensor([[1, 2]]),))
    assert not _casts(exact) or all(n.args[0].op != "placeholder" for n in _casts(exact))
    floating = _inserted(nn.Sequential(nn.Linear(4, 2)), preset("O2", F16, "cpu"), (torch.randn(2, 4),))
    assert "input_1_to_float16 = input_1.to(torch.float16)" in floating.code


def test_cast_if_floating_follows_autocast_eligibility():
    assert cast_if_floating(torch.ones(2), F16).dtype == F16
    assert cast_if_floating(torch.ones(2, dtype=torch.float64), F16).dtype == torch.float64
    assert cast_if_floating(torch.ones(2, dtype=torch.int32), F16).dtype == torch.int32
    assert cast_if_floating(None, F16) is None
    assert cast_if_floating(3, F16) == 3


def test_inplace_op_is_not_cast():
    class InPlace(nn.Module):
        def forward(self, x):
            y = x * 2
            y.exp_()
            return y

    gm = _inserted(InPlace(), preset("O2", F16, "cpu"))
    exp_ = next(n for n in gm.graph.nodes if n.target == "exp_")
    assert exp_.args[0].target is not cast_if_floating and not node_info(exp_.args[0]).is_cast


def test_converting_again_inserts_nothing():
    model = Attention()
    policy = preset("O1", BF16, "cpu")
    gm = _inserted(model, policy)
    before = len(_casts(gm))
    again, _ = _inserted_in_context(gm, policy)
    assert len(_casts(again)) == before


def test_lower_module_without_a_functional_form_runs_in_an_island():
    class Upsample(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1)

        def forward(self, x):
            return self.up(x, output_size=[8, 8])  # output_size: not in the functional form

    model = Upsample()
    gm = _inserted(model, preset("O1", BF16, "cpu"))
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert isinstance(gm.get_submodule(call.target), AutocastIsland) and node_info(call).rule is Rule.OPAQUE
    _assert_matches_autocast(model, gm, (torch.randn(1, 2, 4, 4),), BF16)


def test_opaque_method_call_runs_the_tensor_method_in_an_island():
    class MatMul(nn.Module):
        def forward(self, x, w):
            return x.matmul(w)

    policy = preset("O1", BF16, "cpu").set_op("matmul", Rule.OPAQUE)
    gm = _inserted(MatMul(), policy)
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    island = gm.get_submodule(call.target)
    assert island.wrapped is torch.Tensor.matmul and "Tensor.matmul" in repr(island)
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    with torch.autocast("cpu", dtype=BF16):
        expected = x.matmul(w)
    assert torch.equal(gm(x, w), expected)


class IslandIntoNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.gamma = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.conv(x)
        h = self.norm(h * torch.softmax(h, 1))  # an FP32 island's output into a low GroupNorm
        return F.layer_norm(torch.softmax(h.mean((2, 3)), -1), (4,), self.gamma)


@pytest.mark.parametrize("example", [False, True])
def test_o2_norm_with_low_parameters_gets_its_float32_input_cast_down(example):
    model = IslandIntoNorms()
    x = torch.randn(2, 1, 4, 4)
    # O2 keeps norms FP32; as passthrough ops they keep low parameters.
    policy = (
        preset("O2", BF16, "cpu")
        .set_op("group_norm", Rule.PASSTHROUGH)
        .set_op("layer_norm", Rule.PASSTHROUGH)
    )
    gm = cast_parameters(*_inserted_in_context(trace(model), policy, (x,) if example else None)).graph_module
    casts = {n.name: node_info(n).cast_reason for n in _casts(gm)}
    assert "runs in its parameters' dtype" in casts["mul_to_bfloat16"]
    assert "runs in its parameters' dtype" in casts["softmax_1_to_bfloat16"]
    assert gm(x).dtype == BF16  # runs: no "mixed dtype" error
