"""fuse_norms: RMSNorm / LayerNorm chains, as models write them, become one fused call at O2, on
both front ends; chains that differ from a norm in any way stay as they are.

Fused or not, a converted model must compute what the unfused conversion computed (the same fp32
math, rounded where the chain rounded) and still match torch.autocast within the O2 tolerances;
O1 stays bit-identical to autocast (nothing is fused there).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.passes.fuse_norms import FUSED_NORM_FUNCTIONS
from amp_fx.passes.shared.module_regions import module_paths
from amp_fx.testing import assert_close_normwise, grad_tolerances, tolerances
from tests.bit_equality import bits_equal
from tests.models.hf import MODELS

BF16 = torch.bfloat16
EPS = 1e-6
WIDTH = 24


# RMSNorm as models write it out: (h, w) -> normalized h times w.
def llama(h, w):
    dtype = h.dtype
    x = h.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + EPS)
    return w * x.to(dtype)


def square_and_reciprocal_root(h, w):
    x = h.float()
    variance = (x * x).mean(dim=-1, keepdim=True)
    return (x * (1 / torch.sqrt(variance + EPS))).to(h.dtype) * w


def divide_by_root(h, w):
    x = h.float()
    variance = torch.mean(x**2, -1, keepdim=True)
    return w * (x / torch.sqrt(EPS + variance)).type_as(h)


def gemma(h, w):
    x = h.float()
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    out = out * (1.0 + w.float())
    return out.type_as(h)


def t5(h, w):
    variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return w * (h * torch.rsqrt(variance + EPS))


def layer_norm_function(h, w):
    return F.layer_norm(h, (WIDTH,), w, None, 1e-5)


def rms_norm_function(h, w):  # no eps: aten's default, float32's epsilon on fp32 input
    return F.rms_norm(h, (WIDTH,), w)


def torch_rms_norm(h, w):
    return torch.rms_norm(h, [WIDTH], w, EPS)


# LayerNorm written out in fp32 (no bias): Cohere's two subtractions of the mean, or one shared.
def layer_norm_written_out(h, w):
    x = h.to(torch.float32)
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    x = (x - mean) * torch.rsqrt(variance + EPS)
    return (w.to(torch.float32) * x).to(h.dtype)


def layer_norm_centered_once(h, w):
    x = h.float()
    centered = x - x.mean(dim=-1, keepdim=True)
    return w * (centered / torch.sqrt((centered * centered).mean(-1, keepdim=True) + EPS))


# Near misses: one step differs from a norm.
def eps_outside_the_root(h, w):
    x = h.float()
    return w * (x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + EPS)).to(h.dtype)


def numerator_other_than_one(h, w):
    x = h.float()
    return w * (x * (2 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS))).to(h.dtype)


def mean_over_another_dim(h, w):
    x = h.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + EPS)).to(h.dtype)


def mean_without_keepdim(h, w):
    x = h.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1) + EPS).unsqueeze(-1)).to(h.dtype)


def variance_read_elsewhere(h, w):
    x = h.float()
    variance = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(variance + EPS)).to(h.dtype) + variance


def squares_in_place(h, w):
    x = h.float()
    x.pow_(2)  # x now holds the squares: not a norm of h
    return w * (x * torch.rsqrt(x.mean(-1, keepdim=True) + EPS)).to(h.dtype)


def rms_norm_over_two_dims(h, w):  # the kernels normalize the last dimension only
    halves = (2, WIDTH // 2)
    return w * F.rms_norm(h.unflatten(-1, halves), halves, eps=EPS).flatten(-2)


def centered_over_another_dim(h, w):  # the mean subtracted is over dim 1, the variance's over -1
    x = h.float()
    mean = x.mean(1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return w * ((x - mean) * torch.rsqrt(variance + EPS))


def centered_on_another_value(h, w):  # x - mean(x) squared, but h.exp() - mean(x) normalized
    x = h.float()
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return w * ((x.exp() - mean) * torch.rsqrt(variance + EPS))


class Stream(nn.Module):
    """A residual stream: linear, residual add, the norm, linear."""

    def __init__(self, norm) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(WIDTH))
        self.norm = norm

    def forward(self, x):
        h = x + self.a(x)
        return self.b(self.norm(h, self.weight))


class LayerNormStream(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.ln, self.b = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.b(self.ln(x + self.a(x)))


def fused_calls(model: nn.Module) -> list[torch.fx.Node]:
    graphs = amp_fx.report(model).graphs.values()
    return [
        n
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in FUSED_NORM_FUNCTIONS
    ]


def convert(model: nn.Module, level: str = "O2", front_end: str = "fx", **flags) -> nn.Module:
    # These streams start at the model input: cast at the entry, as a transformer's stream leaves
    # its embedding low (fx cannot fuse an add whose input's dtype it only assumes).
    flags.setdefault("cast_inputs_at_entry", True)
    policy = amp_fx.preset(level, BF16, "cpu", **flags)
    return amp_fx.convert(copy.deepcopy(model), policy=policy, front_end=front_end)


def graph_codes(model: nn.Module) -> list[str]:
    """The code of every graph the model captured (the export front end captures on a call)."""
    return [gm.code for gm in amp_fx.report(model).graphs.values()]


def loss_and_grads(model: nn.Module, *args, **kwargs):
    torch.manual_seed(0)
    out = model(*args, **kwargs)
    out = out if isinstance(out, torch.Tensor) else out.loss
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    loss = (out.float() * weights).sum()
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_close_to(ours, expected) -> None:
    """Loss and parameter gradients within the O2 tolerances (norm-wise, as the suite compares)."""
    (loss, grads), (expected_loss, expected_grads) = ours, expected
    rtol, atol = tolerances(BF16)
    assert_close_normwise(loss, expected_loss, rtol=rtol, atol=atol, name="loss")
    assert set(grads) == set(expected_grads)
    scale = torch.cat([g.flatten() for g in expected_grads.values()]).pow(2).mean().sqrt().item()
    rtol, atol = grad_tolerances(BF16)
    for name, grad in grads.items():
        assert_close_normwise(grad, expected_grads[name], rtol=rtol, atol=atol, scale=scale, name=name)


def assert_matches_unfused_and_autocast(model: nn.Module, ours, front_end: str, *args) -> None:
    """``ours`` (`loss_and_grads` of the fused conversion) is close to the unfused conversion's and
    to torch.autocast's."""
    unfused = convert(model, front_end=front_end, fused_norms=False)
    assert_close_to(ours, loss_and_grads(unfused, *args))
    assert_close_to(ours, loss_and_grads(amp_fx.testing.with_autocast(model, "cpu", BF16), *args))


@pytest.mark.parametrize(
    "norm",
    [
        llama,
        square_and_reciprocal_root,
        divide_by_root,
        gemma,
        t5,
        layer_norm_function,
        rms_norm_function,
        torch_rms_norm,
        layer_norm_written_out,
        layer_norm_centered_once,
    ],
)
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_spellings_fuse_on_both_front_ends(norm, front_end) -> None:
    torch.manual_seed(0)
    model, x = Stream(norm), torch.randn(3, 5, WIDTH)
    fused, unfused = (
        convert(model, front_end=front_end),
        convert(model, front_end=front_end, fused_norms=False),
    )
    assert_close_to(loss_and_grads(fused, x), loss_and_grads(unfused, x))
    (call,) = fused_calls(fused)
    assert call.target.__name__.startswith("add_")  # the residual add went in too
    norm_ops = ("mean", "pow", "rsqrt", "sqrt", "layer_norm", "rms_norm")
    nodes = [n for gm in amp_fx.report(fused).graphs.values() for n in gm.graph.nodes]
    assert not [n for n in nodes if node_info(n).op in norm_ops]
    assert "replaced" in node_info(call).notes[-1]


@pytest.mark.parametrize(
    "norm",
    [
        eps_outside_the_root,
        numerator_other_than_one,
        mean_over_another_dim,
        mean_without_keepdim,
        variance_read_elsewhere,
        squares_in_place,
        rms_norm_over_two_dims,
        centered_over_another_dim,
        centered_on_another_value,
    ],
)
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_near_misses_are_left_alone(norm, front_end) -> None:
    torch.manual_seed(0)
    model, x = Stream(norm), torch.randn(3, 5, WIDTH)
    fused, unfused = (
        convert(model, front_end=front_end),
        convert(model, front_end=front_end, fused_norms=False),
    )
    fused(x), unfused(x)  # the export front end captures on the first call
    assert not fused_calls(fused)
    assert graph_codes(fused) == graph_codes(unfused) != []


def test_layer_norm_module_with_the_residual_add() -> None:
    torch.manual_seed(0)
    model, x = LayerNormStream(), torch.randn(4, WIDTH)
    fused = convert(model)
    (call,) = fused_calls(fused)
    assert call.target.__name__ == "add_layer_norm_fp32"
    # The LayerNorm's parameters stay float32 and are read where they are.
    assert fused.get_parameter("ln.weight").dtype == torch.float32
    assert_close_to(loss_and_grads(fused, x), loss_and_grads(convert(model, fused_norms=False), x))
    # A hook on the LayerNorm would no longer fire: such a LayerNorm is not fused.
    model.ln.register_forward_hook(lambda *args: None)
    assert not fused_calls(convert(model))


class WrittenLayerNorm(nn.Module):
    """A LayerNorm written out in fp32 as Cohere's is (weight, and here a bias), over the last
    dimension with parameters of ``shape``: (WIDTH,), or per head (2, WIDTH // 2) as Cohere's QK
    norm, which broadcasts per head and is no LayerNorm call."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(shape))
        self.bias = nn.Parameter(0.1 * torch.randn(shape))

    def forward(self, h):
        x = h.to(torch.float32)
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + EPS)
        return (self.weight.to(torch.float32) * x + self.bias).to(h.dtype)


class WrittenLayerNormStream(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.norm = WrittenLayerNorm((WIDTH,) if heads == 1 else (heads, WIDTH // heads))

    def forward(self, x):
        h = x + self.a(x)
        if self.heads > 1:
            return self.b(self.norm(h.unflatten(-1, (self.heads, -1))).flatten(-2))
        return self.b(self.norm(h))


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_written_out_layer_norm_fuses_on_both_front_ends(front_end: str) -> None:
    torch.manual_seed(0)
    model, x = WrittenLayerNormStream(heads=1), torch.randn(3, 5, WIDTH)
    fused = convert(model, front_end=front_end)
    ours = loss_and_grads(fused, x)
    (call,) = fused_calls(fused)
    assert call.target.__name__ == "add_layer_norm_fp32" and call.kwargs["out_dtype"] == BF16
    graph = next(iter(amp_fx.report(fused).graphs.values())).graph
    assert not [n for n in graph.nodes if node_info(n).op in ("mean", "sub", "pow", "rsqrt")]
    assert "fused the residual add and LayerNorm" in node_info(call).notes[-1]
    assert_matches_unfused_and_autocast(model, ours, front_end, x)


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_written_out_layer_norm_with_per_head_weights_is_left_alone(front_end: str) -> None:
    torch.manual_seed(0)
    model, x = WrittenLayerNormStream(heads=2), torch.randn(3, 5, WIDTH)
    fused = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16, device_type="cpu", front_end=front_end)
    fused(x)  # the torch.export front end captures at the first call
    assert not fused_calls(fused)


class RMSNormDecoder(nn.Module):
    """A pre-norm residual network written with nn.RMSNorm: per block ``h = h + mlp(norm(h))``, then
    a final norm (torch's default eps) and a head."""

    def __init__(self, vocab: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.norms = nn.ModuleList(nn.RMSNorm(WIDTH, eps=EPS) for _ in range(blocks))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.SiLU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(blocks)
        )
        self.final = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            h = h + mlp(norm(h))
        return self.head(self.final(h))


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_rms_norm_modules_fuse_on_both_front_ends(front_end: str) -> None:
    torch.manual_seed(0)
    model, ids = RMSNormDecoder(), torch.randint(0, 32, (3, 7))
    fused = convert(model, front_end=front_end)
    ours = loss_and_grads(fused, ids)  # the torch.export front end captures at the first call
    calls = fused_calls(fused)
    # The first norm reads the embedding; the second and the final one, the residual adds before them.
    names = [call.target.__name__ for call in calls]
    assert names == ["rms_norm_fp32", "add_rms_norm_fp32", "add_rms_norm_fp32"]
    assert [call.args[-1] for call in calls] == [EPS, EPS, torch.finfo(torch.float32).eps]
    assert all(call.kwargs["out_dtype"] == BF16 for call in calls)  # written once, low, for the linears
    rows = [row for row in amp_fx.report(fused).rows if row.op == "add_rms_norm_fp32"]
    assert len(rows) == 2 and all("fused the residual add and RMSNorm" in row.notes[-1] for row in rows)
    assert_matches_unfused_and_autocast(model, ours, front_end, ids)


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_rms_norm_default_eps_is_float32_epsilon(front_end: str) -> None:
    # Rows of mean square 1e-8: an eps of bfloat16's epsilon (7.8e-3, what nn.RMSNorm's docstring
    # suggests for bf16 input) would scale them ~1000x less than torch does.
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.RMSNorm(WIDTH)), 1e-4 * torch.randn(4, WIDTH)
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(WIDTH))
        model[0].bias.zero_()
    fused = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16, device_type="cpu", front_end=front_end)
    out = fused(x)
    (call,) = fused_calls(fused)
    assert call.target.__name__ == "rms_norm_fp32"
    expected = amp_fx.testing.with_autocast(model, "cpu", BF16)(x)
    rtol, atol = tolerances(BF16)
    assert_close_normwise(out, expected, rtol=rtol, atol=atol, name="out")


def test_timm_rms_norm_model_fuses() -> None:
    # timm's RmsNorm calls F.rms_norm: traced through, every norm of the ViT becomes one call.
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=WIDTH,
        num_heads=2, num_classes=10, norm_layer=timm.layers.RmsNorm,
    )  # fmt: skip
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    fused = convert(model)
    ours = loss_and_grads(fused, x)
    calls = [call.target.__name__ for call in fused_calls(fused)]
    assert calls == ["rms_norm_fp32"] + ["add_rms_norm_fp32"] * 4
    assert_close_to(ours, loss_and_grads(amp_fx.testing.with_autocast(model, "cpu", BF16), x))


class NormModule(nn.Module):
    def __init__(self, norm) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(WIDTH))
        self.norm = norm

    def forward(self, h):
        return self.norm(h, self.weight)


class ModuleStream(nn.Module):
    """Linear, residual add, a norm module, linear: the next linear casts the norm's output."""

    def __init__(self, norm) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(WIDTH, WIDTH), NormModule(norm), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.b(self.norm(x + self.a(x)))


@pytest.mark.parametrize("norm", [llama, t5])
def test_the_fused_call_is_the_norm_modules_op(norm) -> None:
    # shard_regions runs it in the norm's call, where FSDP2 gathers the norm's weight; T5's
    # norm ends in FP32, so its last node is the cast the passes add for the next linear.
    torch.manual_seed(0)
    model = amp_fx.convert(ModuleStream(norm), "O2", dtype=BF16, front_end="export")
    model(torch.randn(4, WIDTH))
    (call,) = fused_calls(model)
    for node in (call, *call.users):
        assert module_paths(node)[-1] == "norm"


def test_only_o2_fuses_by_default() -> None:
    model = Stream(llama)
    assert fused_calls(convert(model, "O2"))
    for level in ("O0", "O1", "O3"):
        assert not fused_calls(convert(model, level))


@pytest.mark.parametrize(("name", "expected"), [("llama", 5), ("gpt2", 5)])
def test_hugging_face_models_on_the_export_front_end(name: str, expected: int) -> None:
    # Per model of two layers: the first layer's norm, then every norm after a residual add
    # (the attention's, the MLP's, the final norm's) with the add in it.
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    kwargs = inputs(2, 8)
    converted = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16)
    ours = loss_and_grads(converted, **kwargs)
    calls = fused_calls(converted)
    assert len(calls) == expected
    assert sum(call.target.__name__.startswith("add_") for call in calls) == expected - 1
    reference = amp_fx.testing.with_autocast(model, "cpu", BF16)
    assert_close_to(ours, loss_and_grads(reference, **kwargs))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_o1_stays_bit_identical_to_autocast(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    kwargs = inputs(2, 8)
    converted = amp_fx.convert(copy.deepcopy(model), "O1", dtype=BF16)
    loss, grads = loss_and_grads(converted, **kwargs)
    assert not fused_calls(converted)
    expected_loss, expected_grads = loss_and_grads(amp_fx.testing.with_autocast(model, "cpu", BF16), **kwargs)
    assert bits_equal(loss, expected_loss)
    assert all(bits_equal(grads[name], expected_grads[name]) for name in expected_grads)


@pytest.mark.gpu
def test_llama_on_gpu_runs_the_triton_kernels_and_matches_autocast() -> None:
    torch.manual_seed(0)
    model, inputs = MODELS["llama"]()
    model = model.cuda().eval()
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs(4, 64).items()}
    converted = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16)
    ours = loss_and_grads(converted, **kwargs)
    assert len(fused_calls(converted)) == 5
    reference = amp_fx.testing.with_autocast(model, "cuda", BF16)
    assert_close_to(ours, loss_and_grads(reference, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_rms_norm_modules_on_gpu_fuse_and_match_autocast(front_end: str) -> None:
    # On CUDA, eager rms_norm runs aten's _fused_rms_norm; torch.export must still record
    # aten.rms_norm for the pass to see it.
    torch.manual_seed(0)
    model, ids = RMSNormDecoder().cuda(), torch.randint(0, 32, (4, 64), device="cuda")
    fused = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16, front_end=front_end)
    ours = loss_and_grads(fused, ids)
    assert len(fused_calls(fused)) == 3
    assert_close_to(ours, loss_and_grads(amp_fx.testing.with_autocast(model, "cuda", BF16), ids))
