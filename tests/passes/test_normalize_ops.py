"""Tests for `amp_fx.passes.normalize_ops`: one canonical op name per op, whatever the spelling."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.capture.fx import OPAQUE_TORCH_MODULES, trace
from amp_fx.core.node_info import node_info
from amp_fx.core.op_lists import OPAQUE_OP, known_ops
from amp_fx.core.policy import Rule
from amp_fx.passes.normalize_ops import MODULE_OPS, OPERATOR_OPS, canonical_op, normalize_ops


def _ops(gm: torch.fx.GraphModule) -> dict[str, str]:
    """node name -> canonical op, for call nodes."""
    return {n.name: node_info(n).op for n in gm.graph.nodes if n.op.startswith("call")}


def _normalized(fn_or_module) -> torch.fx.GraphModule:
    module = fn_or_module if isinstance(fn_or_module, nn.Module) else _Lambda(fn_or_module)
    return normalize_ops(trace(module)).graph_module


class _Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


class AllSoftmaxes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        return torch.softmax(x, -1), F.softmax(x, -1), x.softmax(-1), self.softmax(x)


def test_softmax_spellings_are_one_op_and_notes_keep_the_spelling():
    gm = _normalized(AllSoftmaxes())
    calls = [n for n in gm.graph.nodes if n.op.startswith("call")]
    assert [node_info(n).op for n in calls] == ["softmax"] * 4
    assert [node_info(n).notes for n in calls] == [
        ["torch.softmax"],
        ["F.softmax"],
        ["Tensor.softmax"],
        ["nn.Softmax"],
    ]


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda x, y: x + y, "add"),
        (lambda x, y: torch.add(x, y), "add"),
        (lambda x, y: x.add(y), "add"),
        (lambda x, y: x.clone().add_(y), "add"),
        (lambda x, y: x @ y, "matmul"),
        (lambda x, y: torch.matmul(x, y), "matmul"),
        (lambda x, y: x.matmul(y), "matmul"),
        (lambda x, y: x / y, "div"),
        (lambda x, y: torch.true_divide(x, y), "div"),
        (lambda x, y: x.div_(y), "div"),
        (lambda x, y: torch.relu(x), "relu"),
        (lambda x, y: F.relu(x, inplace=True), "relu"),
        (lambda x, y: x.relu_(), "relu"),
        (lambda x, y: torch.relu_(x), "relu"),
        (lambda x, y: x.masked_fill_(y > 0, 0.0), "masked_fill"),
        (lambda x, y: F.cross_entropy(x, y), "cross_entropy_loss"),
        (lambda x, y: F.logsigmoid(x), "logsigmoid"),
        (lambda x, y: F.dropout2d(x), "dropout2d"),
        (lambda x, y: torch.concat([x, y]), "cat"),
        (lambda x, y: torch.clip(x, 0, 1), "clamp"),
        (lambda x, y: torch.einsum("ij,jk->ik", x, y), "einsum"),
        (lambda x, y: torch.ops.aten.mul.Tensor(x, y), "mul"),
        (lambda x, y: torch.cumsum(x, 0), "cumsum"),
        (lambda x, y: F.layer_norm(x, x.shape[-1:]), "layer_norm"),
        (lambda x, y: F.scaled_dot_product_attention(x, y, y), "scaled_dot_product_attention"),
    ],
)
def test_function_method_and_inplace_spellings(fn, expected):
    gm = _normalized(fn)
    assert expected in set(_ops(gm).values())
    final = next(n for n in reversed(gm.graph.nodes) if n.op.startswith("call"))
    assert node_info(final).op == expected


def test_operator_inplace_variants_map_like_their_operator():
    # torch.fx records `x += y` on a Proxy as operator.add; a graph built by hand may hold iadd.
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    nodes = [graph.call_function(op, (x, y)) for op in (operator.iadd, operator.imul, operator.imatmul)]
    graph.output(tuple(nodes))
    normalize_ops(torch.fx.GraphModule(nn.Module(), graph))
    assert [node_info(n).op for n in nodes] == ["add", "mul", "matmul"]
    assert node_info(nodes[0]).notes == ["operator.iadd (+=)"]


@pytest.mark.parametrize(
    "method", ["float", "half", "bfloat16", "double", "to", "type", "type_as", "cuda", "cpu"]
)
def test_dtype_and_device_conversions_are_to(method):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_method(method, (x,))
    graph.output(node)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    assert canonical_op(node, gm) == "to"


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.Linear(2, 2), "linear"),
        (nn.Conv1d(2, 2, 1), "conv1d"),
        (nn.Conv2d(2, 2, 1), "conv2d"),
        (nn.ConvTranspose2d(2, 2, 1), "conv_transpose2d"),
        (nn.BatchNorm1d(2), "batch_norm"),
        (nn.BatchNorm2d(2), "batch_norm"),
        (nn.SyncBatchNorm(2), "batch_norm"),
        (nn.InstanceNorm2d(2), "instance_norm"),
        (nn.LayerNorm(2), "layer_norm"),
        (nn.GroupNorm(1, 2), "group_norm"),
        (nn.Embedding(4, 2), "embedding"),
        (nn.ReLU(), "relu"),
        (nn.GELU(), "gelu"),
        (nn.SiLU(), "silu"),
        (nn.Hardswish(), "hardswish"),
        (nn.LogSoftmax(-1), "log_softmax"),
        (nn.Dropout(), "dropout"),
        (nn.MaxPool2d(2), "max_pool2d"),
        (nn.AdaptiveAvgPool2d(1), "adaptive_avg_pool2d"),
        (nn.Flatten(), "flatten"),
        (nn.ZeroPad2d(1), "pad"),
        (nn.CrossEntropyLoss(), "cross_entropy_loss"),
        (nn.MSELoss(), "mse_loss"),
        (nn.Upsample(scale_factor=2, mode="bilinear"), "upsample_bilinear2d"),
        (nn.Upsample(size=(4, 4)), "upsample_nearest2d"),
        (nn.UpsamplingNearest2d(scale_factor=2), "upsample_nearest2d"),
        (nn.Upsample(scale_factor=2), "interpolate"),  # rank unknown until run
    ],
)
def test_module_table(module, expected):
    gm = normalize_ops(trace(nn.Sequential(module))).graph_module
    (call,) = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert node_info(call).op == expected
    assert node_info(call).notes == [f"nn.{type(module).__name__}"]


def test_every_primitive_torch_nn_module_has_a_table_entry():
    composites_and_opaque = {
        "Module", "Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict",
        "Transformer", "TransformerEncoder", "TransformerDecoder", "TransformerEncoderLayer",
        "TransformerDecoderLayer", "AdaptiveLogSoftmaxWithLoss", "DataParallel", "LinearCrossEntropyLoss",
        "Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d",  # named from their mode, tested above
    }  # fmt: skip
    missing = [
        name
        for name, cls in vars(nn).items()
        if isinstance(cls, type)
        and issubclass(cls, nn.Module)
        and not issubclass(cls, OPAQUE_TORCH_MODULES)
        and name not in composites_and_opaque
        and not any(base in MODULE_OPS for base in cls.__mro__)
    ]
    assert missing == []


def test_shape_attribute_is_named_and_other_attributes_are_getattr():
    gm = _normalized(lambda x, y: x.view(x.shape[0], -1) + y.mT.sum())
    ops = _ops(gm)
    assert ops["getattr_1"] == "shape" and ops["getattr_2"] == "getattr"
    assert ops["view"] == "view" and ops["sum_1"] == "sum"


def test_fallback_is_the_name_without_inplace_underscore():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_method("fill_", (x, 0.0)), graph.call_function(torch.lgamma, (x,))]
    graph.output(tuple(nodes))
    normalize_ops(torch.fx.GraphModule(nn.Module(), graph))
    assert [node_info(n).op for n in nodes] == ["fill", "lgamma"]


class Gate(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_opaque_nodes_keep_their_rule_and_get_the_opaque_op():
    model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.MultiheadAttention(4, 1))
    gm = normalize_ops(trace(model)).graph_module
    infos = {n.target: node_info(n) for n in gm.graph.nodes if n.op == "call_module"}
    assert infos["0"].op == "linear" and infos["0"].rule is None
    for target, spelling in (("1", f"{__name__}.Gate"), ("2", "nn.MultiheadAttention")):
        assert infos[target].rule is Rule.OPAQUE
        assert infos[target].op == OPAQUE_OP
        assert infos[target].notes[0] == spelling


def test_graph_is_not_rewritten_and_normalizing_twice_changes_nothing():
    gm = trace(AllSoftmaxes())
    code = gm.code
    assert normalize_ops(gm).modified is False
    first = {n.name: (node_info(n).op, list(node_info(n).notes)) for n in gm.graph.nodes}
    assert normalize_ops(gm).modified is False
    assert gm.code == code
    assert {n.name: (node_info(n).op, node_info(n).notes) for n in gm.graph.nodes} == first


def test_canonical_names_are_known_to_the_policy():
    produced = set(MODULE_OPS.values()) | {name for name, _ in OPERATOR_OPS.values()}
    torchvision = pytest.importorskip("torchvision")
    models = [
        torchvision.models.resnet18(num_classes=4),
        torchvision.models.mobilenet_v3_small(num_classes=4),
        torchvision.models.efficientnet_b0(num_classes=4),
        nn.Sequential(nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1)),
    ]
    for model in models:
        produced |= {op for op in _ops(normalize_ops(trace(model.eval())).graph_module).values()}
    assert produced <= known_ops(), sorted(produced - known_ops())
