"""Tests for `amp_fx.passes.cast_parameters`: parameter storage dtypes per the policy."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.capture.fx import trace
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule, preset
from amp_fx.passes.cast_parameters import cast_parameters
from amp_fx.passes.classify import classify
from amp_fx.passes.normalize_ops import module_op, normalize_ops
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.decisions import UNLOWERED_PARAMETER_REASON, plan_parameters

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _classified(model: nn.Module, policy) -> tuple[torch.fx.GraphModule, Conversion]:
    """The model's graph through the passes before the parameter plan, and the context with it."""
    gm = classify(normalize_ops(trace(model)).graph_module, Conversion(policy)).graph_module
    return gm, plan_parameters(gm, Conversion(policy))


def _cast(model: nn.Module, policy) -> torch.fx.GraphModule:
    return cast_parameters(*_classified(model, policy)).graph_module


def _dtypes(module: nn.Module) -> dict[str, torch.dtype]:
    return {name: t.dtype for name, t in [*module.named_parameters(), *module.named_buffers()]}


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 2)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("positions", torch.arange(2))

    def forward(self, x):
        h = self.bn(self.conv(x)).mean((2, 3))
        return self.fc(self.norm(h)) * self.scale + self.positions


def test_o2_low_except_batchnorm():
    gm = _cast(ConvNet(), preset("O2", BF16, "cpu"))
    dtypes = _dtypes(gm)
    for name in ("conv.weight", "conv.bias", "fc.weight", "fc.bias"):
        assert dtypes[name] == BF16, name
    # A buffer only a multiplication reads: no lowered op computes with it, it stays FP32.
    assert dtypes["scale"] == F32
    scale = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "scale")
    assert node_info(scale).reason == UNLOWERED_PARAMETER_REASON
    # BatchNorm (keep_batchnorm_fp32) and, as under autocast, LayerNorm keep FP32 parameters.
    for name in ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "norm.weight", "norm.bias"):
        assert dtypes[name] == F32, name
    assert dtypes["bn.num_batches_tracked"] == torch.int64
    assert dtypes["positions"] == torch.int64
    # The report learns where parameters stay float32.
    bn = next(n for n in gm.graph.nodes if n.name == "bn")
    assert "parameters kept float32: bias, running_mean, running_var, weight" in node_info(bn).notes


def test_o3_casts_batchnorm_unless_kept():
    assert _dtypes(_cast(ConvNet(), preset("O3", F16, "cpu")))["bn.weight"] == F16
    assert _dtypes(_cast(ConvNet(), preset("O3", F16, "cpu")))["norm.weight"] == F16
    kept = _dtypes(_cast(ConvNet(), preset("O3", F16, "cpu", keep_batchnorm_fp32=True)))
    assert kept["bn.weight"] == F32 and kept["bn.running_var"] == F32 and kept["conv.weight"] == F16


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_o0_o1_leave_parameters_alone(opt_level):
    model = ConvNet()
    gm, context = _classified(model, preset(opt_level, F16, "cpu"))
    assert context.parameter_plan == {}
    assert cast_parameters(gm, context).modified is False
    assert _dtypes(gm) == _dtypes(model)


def test_the_input_model_is_untouched():
    model = ConvNet()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    _cast(model, preset("O2", F16, "cpu"))
    after = model.state_dict()
    assert all(
        torch.equal(before[name], after[name]) and before[name].dtype == after[name].dtype for name in before
    )


def test_fp32_module_override_keeps_its_parameters_fp32():
    policy = preset("O2", F16, "cpu").set_module_name("fc", Rule.FP32)
    dtypes = _dtypes(_cast(ConvNet(), policy))
    assert dtypes["fc.weight"] == F32 and dtypes["conv.weight"] == F16


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.gamma = nn.Parameter(torch.ones(4))
        self.beta = nn.Parameter(torch.zeros(4))

    def forward(self, ids):
        h = F.layer_norm(self.emb(ids), (4,), None, self.beta) * torch.exp(self.gamma)
        return self.head(h)


def test_tied_weights_stay_tied_and_get_attr_params_follow_their_op():
    gm = _cast(Tied(), preset("O2", BF16, "cpu"))
    assert gm.get_submodule("emb").weight is gm.get_submodule("head").weight
    # The embedding keeps its table FP32 at O2, and float32 wins for the head it is tied to.
    assert gm.get_submodule("emb").weight.dtype == F32
    # gamma is read by exp, an O2 FP32 island; beta by F.layer_norm, which O2 runs FP32 too.
    assert gm.gamma.dtype == F32 and gm.beta.dtype == F32


def test_gradients_flow_to_low_precision_parameters():
    gm = _cast(nn.Sequential(nn.Linear(4, 4)), preset("O3", BF16, "cpu"))
    gm(torch.randn(2, 4, dtype=BF16)).float().sum().backward()
    weight = gm.get_parameter("0.weight")
    assert weight.dtype == BF16 and weight.grad is not None and weight.grad.dtype == BF16


def test_existing_gradients_are_cast_with_their_parameter():
    policy = preset("O2", F16, "cpu")
    gm, context = _classified(nn.Sequential(nn.Linear(4, 4)), policy)
    gm(torch.randn(2, 4)).sum().backward()
    grad = gm.get_parameter("0.weight").grad.clone()
    assert cast_parameters(gm, context).modified is True
    weight = gm.get_parameter("0.weight")
    assert weight.dtype == F16 and weight.grad.dtype == F16
    assert torch.equal(weight.grad, grad.to(F16))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.gn = nn.GroupNorm(2, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.gn(self.ln(self.fc(x))))


class _WithIslands(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.attn = nn.MultiheadAttention(4, 2)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.block(x)
        return self.head(self.attn(h, h, h)[0])


def test_o2_parameters_inside_autocast_islands_follow_each_modules_op():
    torch.manual_seed(0)
    policy = preset("O2", BF16, "cpu")
    gm = amp_fx.convert(_WithIslands(), policy=policy, leaf_modules=[_Block])
    dtypes = _dtypes(gm)
    # As outside islands: norms keep FP32 weights (autocast expects them), matmuls go low.
    for name in ("ln", "gn", "bn"):
        for attribute in ("weight", "bias"):
            expected = policy.decide(module_op(gm.get_submodule(f"block.{name}"))).param_dtype
            assert dtypes[f"block.{name}.{attribute}"] == expected == F32
    for name in ("block.fc.weight", "attn.in_proj_weight", "attn.out_proj.weight", "head.weight"):
        assert dtypes[name] == BF16, name
    x = torch.randn(3, 4)
    assert gm(x).dtype == F32
