"""Tests for `amp_fx.convert`: the API, its errors, and the properties every conversion keeps.

References: the original model (O0 bit for bit), ``torch.autocast("cpu")`` (O1 bit for bit), the
FP32 model within `amp_fx.testing`'s tolerances (O2/O3), and a `torch.fx.Interpreter` that
records the dtypes each node receives.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.capture.fx import TraceError
from amp_fx.convert import convert
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule, preset
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.ops.cross_entropy import fp32_cross_entropy, linear_cross_entropy
from amp_fx.testing import assert_equivalent, rounding_tolerances, tolerances

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LOW = [BF16, F16]


# ------------------------------------------------------------------------------------------
# Small hand-written models covering the op families of real ones.
# ------------------------------------------------------------------------------------------
class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect")
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = h + self.bn2(self.conv2(h))
        h = torch.cat([F.max_pool2d(h, 2), F.avg_pool2d(h, 2)], dim=1)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class Block(nn.Module):
    """A GPT block written by hand: LayerNorm, attention with matmul/softmax, MLP, residuals."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class GptLoss(nn.Module):
    """The loss inside the model (as nanoGPT and Hugging Face models do): integer ids and targets in."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = Gpt()

    def forward(self, ids, targets):
        logits = self.gpt(ids)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Opaque(nn.Module):
    """MultiheadAttention (an opaque leaf), einsum (a CPU autocast composite), an SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        a = self.attn(x, x, x, need_weights=False)[0]
        s = torch.einsum("btd,bsd->bts", self.fc(a), x)
        return F.scaled_dot_product_attention(x, x, x) + s.softmax(-1) @ x


class Gate(nn.Module):
    """Data-dependent control flow: untraceable, becomes an opaque node of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.norm(self.gate(x)))


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


MODELS = {
    "mlp": (Mlp, lambda: (torch.randn(4, 8),)),
    "convnet": (ConvNet, lambda: (torch.randn(2, 3, 8, 8),)),
    "block": (Block, lambda: (torch.randn(2, 5, 16),)),
    "gpt": (Gpt, lambda: (torch.randint(0, 32, (2, 6)),)),
    "gpt_loss": (GptLoss, lambda: (torch.randint(0, 32, (2, 6)), torch.randint(0, 32, (2, 6)))),
    "opaque": (Opaque, lambda: (torch.randn(2, 5, 16),)),
    "with_gate": (WithGate, lambda: (torch.randn(2, 5, 16),)),
}


def _model_and_inputs(name: str):
    cls, make_inputs = MODELS[name]
    model = _seeded(cls)
    torch.manual_seed(1)
    return model, make_inputs()


def _casts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if node_info(n).is_cast]


def _assert_same_gradients(gm: nn.Module, out: torch.Tensor, model: nn.Module, ref: torch.Tensor) -> None:
    # Parameters matched by name: a GraphModule orders its submodules as the graph uses them.
    names = [name for name, _ in model.named_parameters()]
    grads = torch.autograd.grad(out.float().sum(), [gm.get_parameter(name) for name in names])
    ref_grads = torch.autograd.grad(ref.float().sum(), [model.get_parameter(name) for name in names])
    for name, a, b in zip(names, grads, ref_grads, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def _leaves(out):
    return torch.utils._pytree.tree_leaves(out)


# ------------------------------------------------------------------------------------------
# API
# ------------------------------------------------------------------------------------------
def test_convert_returns_a_graph_module_and_leaves_the_model_untouched():
    model, inputs = _model_and_inputs("convnet")
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    assert isinstance(gm, torch.fx.GraphModule)
    assert gm.training
    after = model.state_dict()
    assert all(before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]) for k in before)
    assert isinstance(gm.meta["amp_fx_policy"], amp_fx.Policy) and gm.meta["amp_fx_policy"].opt_level == "O2"
    original = gm.meta["amp_fx_original_code"]
    assert isinstance(original, str) and "self.conv1(" in original and "bfloat16" not in original
    assert "bfloat16" in gm.code
    assert sorted(gm.state_dict()) == sorted(model.state_dict())


def test_device_type_defaults_to_the_parameters_device():
    gm = convert(_seeded(Mlp), "O1", dtype=BF16)
    assert gm.meta["amp_fx_policy"].device_type == "cpu"
    empty = convert(nn.Sequential(nn.ReLU()), "O1", dtype=BF16)
    assert empty.meta["amp_fx_policy"].device_type == "cpu"


def test_policy_overrides_the_preset():
    model, inputs = _model_and_inputs("mlp")
    policy = preset("O2", BF16, "cpu").set_module_name("fc2", Rule.FP32)
    gm = convert(model, "O2", policy=policy)
    assert gm.meta["amp_fx_policy"] is policy
    assert gm.get_submodule("fc2").weight.dtype == F32 and gm.get_submodule("fc1").weight.dtype == BF16
    assert gm(*inputs).dtype == F32


# ------------------------------------------------------------------------------------------
# Errors: clear, naming the fix, raised before anything changes
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", ["o2", "02", "O4", "", "O2 "])
def test_unknown_opt_level(opt_level):
    with pytest.raises(ValueError, match="opt_level"):
        convert(_seeded(Mlp), opt_level)


def test_lowercase_opt_level_suggests_the_fix():
    with pytest.raises(ValueError, match="did you mean 'O2'"):
        convert(_seeded(Mlp), "o2")


def test_dtype_must_be_low_precision():
    with pytest.raises(ValueError, match="torch.float16 or torch.bfloat16"):
        convert(_seeded(Mlp), "O2", dtype=torch.float32)


def test_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        convert(lambda x: x * 2, "O1")


def test_data_parallel_wrappers_name_the_fix():
    with pytest.raises(TypeError, match=r"convert model.module, then wrap the result in DataParallel"):
        convert(nn.DataParallel(_seeded(Mlp)), "O2")
    # DDP needs a process group to construct; isinstance is all convert looks at.
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    with pytest.raises(
        TypeError, match=r"convert model.module, then wrap the result in DistributedDataParallel"
    ):
        convert(ddp, "O2")


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def test_untraceable_top_level_forward_names_the_line_and_concrete_args():
    # The torch.fx front end alone; "auto" turns to torch.export (tests/capture/test_export_front_end.py).
    with pytest.raises(TraceError, match="concrete_args") as error:
        convert(Untraceable(), "O1", front_end="fx")
    assert "if x.sum() > 0" in str(error.value)
    assert isinstance(error.value, TypeError)


def test_arguments_are_validated_before_tracing():
    # A bad opt level is reported even though the model could not be traced either.
    with pytest.raises(ValueError, match="opt_level"):
        convert(Untraceable(), "O5")
    with pytest.raises(TypeError, match="example_inputs"):
        convert(Untraceable(), "O1", example_inputs=torch.randn(4))


def test_policy_naming_an_unknown_op():
    with pytest.raises(ValueError, match="unknown op 'sofmax'.*'softmax'"):
        convert(_seeded(Mlp), "O1", policy=preset("O1", BF16, "cpu").set_op("sofmax", Rule.FP32))


@pytest.mark.parametrize("bad", [torch.randn(4, 8), {"x": torch.randn(4, 8)}, 3])
def test_example_inputs_of_the_wrong_type(bad):
    with pytest.raises(TypeError, match=r"example_inputs=\(x,\)"):
        convert(_seeded(Mlp), "O1", example_inputs=bad)


def test_example_inputs_of_the_wrong_length():
    with pytest.raises(ValueError, match="one example per forward argument"):
        convert(_seeded(Mlp), "O1", example_inputs=(torch.randn(4, 8), torch.randn(4, 8)))


def test_policy_of_the_wrong_type_or_contradicting_the_arguments():
    with pytest.raises(TypeError, match="amp_fx.Policy"):
        convert(_seeded(Mlp), "O2", policy={"opt_level": "O2"})
    with pytest.raises(ValueError, match="disagree.*opt_level 'O1'"):
        convert(_seeded(Mlp), "O1", policy=preset("O2", BF16, "cpu"))
    with pytest.raises(ValueError, match="disagree.*device_type"):
        convert(_seeded(Mlp), "O2", device_type="cuda", policy=preset("O2", BF16, "cpu"))


# ------------------------------------------------------------------------------------------
# O0: the identity
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_o0_is_bit_identical(name):
    model, inputs = _model_and_inputs(name)
    gm = convert(model, "O0")
    assert _casts(gm) == [] and not any(isinstance(m, AutocastIsland) for m in gm.modules())
    floating = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out, ref = gm(*floating), model(*floating)
    assert torch.equal(out, ref)
    _assert_same_gradients(gm, out, model, ref)


# ------------------------------------------------------------------------------------------
# O1 on CPU: an oracle, torch.autocast itself
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_o1_cpu_is_bit_identical_to_autocast(name, dtype):
    model, inputs = _model_and_inputs(name)
    gm = convert(model, "O1", dtype=dtype, device_type="cpu")
    floating = [x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
    out = gm(*floating)
    with torch.autocast("cpu", dtype=dtype):
        ref = model(*floating)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    # Gradients too: the casts are the same ops autocast records.
    _assert_same_gradients(gm, out, model, ref)
    assert all(p.dtype == F32 for p in gm.parameters())


def test_o1_untraceable_submodule_is_captured_and_leaf_modules_run_in_islands():
    """An untraceable child is captured by torch.export; a leaf module the user names stays an island."""
    from amp_fx.capture.captured_model import CapturedModel

    model, inputs = _model_and_inputs("with_gate")
    gm = convert(model, "O1", dtype=BF16, device_type="cpu", leaf_modules=(nn.LayerNorm,))
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    islands = sorted(name for name in calls if isinstance(gm.get_submodule(name), AutocastIsland))
    assert islands == ["norm_autocast"] and isinstance(gm.get_submodule("gate"), CapturedModel)
    with torch.autocast("cpu", dtype=BF16):
        assert torch.equal(gm(*inputs), model(*inputs))


# ------------------------------------------------------------------------------------------
# O2 / O3: storage dtypes, outputs, equivalence with FP32
# ------------------------------------------------------------------------------------------
def _param_dtypes(gm):
    return {name: t.dtype for name, t in [*gm.named_parameters(), *gm.named_buffers()]}


def test_o2_keeps_batchnorm_fp32_and_o3_does_not():
    model, _ = _model_and_inputs("convnet")
    o2 = _param_dtypes(convert(model, "O2", dtype=F16, device_type="cpu"))
    assert o2["conv1.weight"] == F16 and o2["fc.weight"] == F16
    assert o2["bn1.weight"] == F32 and o2["bn1.running_var"] == F32
    assert o2["bn1.num_batches_tracked"] == torch.int64
    o3 = _param_dtypes(convert(model, "O3", dtype=F16, device_type="cpu"))
    assert o3["bn1.weight"] == F16 and o3["bn1.running_mean"] == F16
    kept = _param_dtypes(convert(model, "O3", dtype=F16, device_type="cpu", keep_batchnorm_fp32=True))
    assert kept["bn1.weight"] == F32 and kept["conv1.weight"] == F16
    not_kept = _param_dtypes(convert(model, "O2", dtype=F16, device_type="cpu", keep_batchnorm_fp32=False))
    assert not_kept["bn1.weight"] == F16


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_outputs_follow_cast_model_outputs(opt_level):
    model, inputs = _model_and_inputs("block")
    assert convert(model, opt_level, dtype=BF16, device_type="cpu")(*inputs).dtype == F32
    low = convert(model, opt_level, dtype=BF16, device_type="cpu", cast_model_outputs=BF16)
    assert low(*inputs).dtype == BF16
    mlp, mlp_inputs = _model_and_inputs("mlp")
    assert convert(mlp, "O1", dtype=BF16, device_type="cpu")(*mlp_inputs).dtype == BF16


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["convnet", "gpt", "opaque", "with_gate"])
def test_outputs_and_gradients_agree_with_fp32(name, opt_level):
    model, inputs = _model_and_inputs(name)
    gm = convert(model, opt_level, dtype=BF16, device_type="cpu")
    assert_equivalent(model, gm, inputs)


def test_o2_trains_low_precision_parameters_in_train_and_eval_mode():
    model, inputs = _model_and_inputs("convnet")
    gm = convert(model.train(), "O2", dtype=BF16, device_type="cpu")
    running = gm.get_submodule("bn1").running_mean.clone()
    gm(*inputs).sum().backward()
    assert gm.get_submodule("conv1").weight.grad.dtype == BF16
    assert not torch.equal(running, gm.get_submodule("bn1").running_mean)  # train mode updates stats
    gm.eval()
    running = gm.get_submodule("bn1").running_mean.clone()
    gm(*inputs)
    assert torch.equal(running, gm.get_submodule("bn1").running_mean)


# ------------------------------------------------------------------------------------------
# Properties: idempotence, dtypes every node receives, no cast is a no-op
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_converting_twice_inserts_nothing(name, opt_level):
    model, inputs = _model_and_inputs(name)
    once = convert(model, opt_level, dtype=F16, device_type="cpu")
    twice = convert(once, opt_level, dtype=F16, device_type="cpu")
    assert len(_casts(twice)) == len(_casts(once))
    assert twice.code == once.code
    with torch.no_grad():
        assert all(
            torch.equal(a, b) for a, b in zip(_leaves(twice(*inputs)), _leaves(once(*inputs)), strict=True)
        )


class DtypeRecorder(torch.fx.Interpreter):
    """Runs a converted graph and records, per node, the dtypes of the tensors it receives."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.received: dict[torch.fx.Node, list[torch.dtype]] = {}
        self.produced: dict[torch.fx.Node, object] = {}

    def run_node(self, node: torch.fx.Node):
        values = [self.env[a] for a in node.all_input_nodes]
        self.received[node] = [v.dtype for v in values if isinstance(v, torch.Tensor)]
        out = super().run_node(node)
        self.produced[node] = out
        return out


def _check_received_dtypes(gm: torch.fx.GraphModule, inputs, *, strict_casts: bool) -> None:
    """LOWER ops receive the low dtype, FP32 ops float32; with `strict_casts`, no cast is a no-op
    (where the dtypes are known: example_inputs, and no untraced code fake tensors cannot run)."""
    policy = gm.meta["amp_fx_policy"]
    recorder = DtypeRecorder(gm)
    with torch.no_grad():
        recorder.run(*inputs)
    for node, received in recorder.received.items():
        info = node_info(node)
        floating = [d for d in received if d.is_floating_point and d != torch.float64]
        if info.rule is Rule.LOWER:
            assert all(d == policy.dtype for d in floating), (node.name, received)
        elif node.target is fp32_cross_entropy:  # an FP32 loss that reads the low-precision logits
            assert received[0] == policy.dtype, (node.name, received)
        elif node.target is linear_cross_entropy:  # the head's input, weight and bias stay low
            assert all(d == policy.dtype for d in floating), (node.name, received)
        elif info.rule is Rule.FP32 and not any(isinstance(a, torch.dtype) for a in node.args):
            assert all(d == F32 for d in floating), (node.name, received)
        if info.is_cast and strict_casts:
            source = recorder.produced[node.args[0]]
            assert not isinstance(source, torch.Tensor) or source.dtype != recorder.produced[node].dtype, (
                f"{node.name} is a no-op cast"
            )


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_op_receives_its_rules_dtype_and_no_cast_is_a_no_op(name, opt_level):
    model, inputs = _model_and_inputs(name)
    for device_type in ("cpu", "cuda"):  # the CUDA lists have FP32 ops (softmax, layer_norm)
        exact = convert(model, opt_level, dtype=F16, device_type=device_type, example_inputs=inputs)
        if device_type == "cpu" or not any(isinstance(m, AutocastIsland) for m in exact.modules()):
            strict = device_type == "cpu" and name != "with_gate"  # Gate branches on data: unknown
            _check_received_dtypes(exact, inputs, strict_casts=strict)
        static = convert(model, opt_level, dtype=F16, device_type="cpu")
        _check_received_dtypes(static, inputs, strict_casts=False)


def test_exact_dtypes_leave_integer_inputs_uncast():
    model, inputs = _model_and_inputs("gpt")
    gm = convert(model, "O2", dtype=F16, device_type="cpu", example_inputs=inputs)
    (ids,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert not any(node_info(user).is_cast for user in ids.users)
    assert gm(*inputs).dtype == F32


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["convnet", "gpt", "gpt_loss", "opaque"])
def test_converted_graph_survives_torch_save_and_load(tmp_path, name: str, opt_level: str) -> None:
    model, inputs = _model_and_inputs(name)
    gm = convert(model.eval(), opt_level, dtype=BF16, device_type="cpu")
    torch.save(gm, tmp_path / "gm.pt")
    loaded = torch.load(tmp_path / "gm.pt", weights_only=False)
    assert torch.equal(loaded(*inputs), gm(*inputs))


# ------------------------------------------------------------------------------------------
# A policy alone decides; without a device type it takes the model's
# ------------------------------------------------------------------------------------------
def test_convert_with_only_a_policy_equals_convert_with_the_opt_level():
    model, inputs = _model_and_inputs("mlp")
    by_policy = convert(model, policy=preset("O2", BF16, "cpu"))
    by_level = convert(model, "O2", dtype=BF16)
    assert by_policy.meta["amp_fx_policy"] == by_level.meta["amp_fx_policy"]
    assert by_policy.code == by_level.code
    assert torch.equal(by_policy(*inputs), by_level(*inputs))


def test_preset_without_device_type_takes_the_cpu_models_op_lists():
    model, inputs = _model_and_inputs("mlp")
    undecided = preset("O1", BF16).set_module_name("fc2", Rule.FP32)
    gm = convert(model, policy=undecided)
    resolved = gm.meta["amp_fx_policy"]
    assert resolved == preset("O1", BF16, "cpu").set_module_name("fc2", Rule.FP32)
    assert resolved.op_rules["linear"].reason == "autocast cpu lower_precision_fp list"
    assert undecided.device_type is None  # the user's policy is left as it was
    # O2's GPU-only kernels stay off for a CPU model, as with convert(model, "O2").
    o2 = convert(model, policy=preset("O2", BF16)).meta["amp_fx_policy"]
    assert o2 == preset("O2", BF16, "cpu") and not o2.fused_max_pool and not o2.fused_batch_norm
    # The device_type argument fills in what the policy leaves open; it is no conflict.
    cuda = convert(model, device_type="cuda", policy=preset("O1", BF16)).meta["amp_fx_policy"]
    assert cuda.device_type == "cuda" and cuda == preset("O1", BF16, "cuda")


def test_conflicting_opt_level_with_a_policy_is_refused_before_any_work():
    disagree = r"disagree \(opt_level 'O3' vs the policy's 'O2'\).*pass only the policy"
    with pytest.raises(ValueError, match=disagree):
        convert(Untraceable(), "O3", policy=preset("O2", BF16))
    with pytest.raises(ValueError, match="did you mean 'O2'"):
        convert(Untraceable(), "o2", policy=preset("O2", BF16))


def test_neither_opt_level_nor_policy():
    with pytest.raises(TypeError, match=r"needs an opt_level .* or a policy"):
        convert(_seeded(Mlp))


# ---------------------------------------------------------------------------------------------
# In-place updates of inputs and buffers behave as in eager at every level
# ---------------------------------------------------------------------------------------------
class _AddOne(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x


@pytest.mark.parametrize("examples", [False, True])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_forward_updating_its_input_in_place_updates_the_callers_tensor(opt_level, examples):
    expected = _AddOne()(torch.zeros(2))  # eager
    x = torch.zeros(2)
    gm = convert(_AddOne(), opt_level, dtype=BF16, example_inputs=(torch.zeros(2),) if examples else None)
    assert torch.equal(gm(x), expected)
    assert torch.equal(x, expected)  # the caller's tensor, not a low-precision copy of it


class _UpdateThroughViews(nn.Module):
    def forward(self, x):
        x.view(-1)[:2].mul_(3)
        x.t().add_(1)
        return torch.softmax(x, -1)


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_in_place_updates_through_views_reach_the_callers_tensor(opt_level, front_end):
    model = _UpdateThroughViews()
    reference_x = torch.arange(4.0).view(2, 2)
    expected = model(reference_x)
    x = torch.arange(4.0).view(2, 2)
    out = convert(model, opt_level, dtype=BF16, front_end=front_end)(x)
    assert torch.equal(x, reference_x)  # small integers: exact in bfloat16 too
    if opt_level != "O3":  # O3's softmax runs in bfloat16
        assert torch.equal(out, expected)


class _UpdateBetweenUses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        before = self.fc(x)
        x.mul_(2)
        return before, self.fc(x), torch.softmax(x, -1)


def test_users_after_an_in_place_update_see_it_o1_as_autocast():
    model, x = _seeded(_UpdateBetweenUses), torch.arange(6.0).view(2, 3)
    reference_x = x.clone()
    with torch.autocast("cpu", dtype=BF16):
        expected = model(reference_x)
    outputs = convert(model, "O1", dtype=BF16)(x)
    for out, ref in zip(outputs, expected, strict=True):
        assert torch.equal(out, ref)  # no cast of x made before mul_ is reused after it
    assert torch.equal(x, reference_x)


def test_users_after_an_in_place_update_see_it_o2():
    model, x = _seeded(_UpdateBetweenUses), torch.arange(6.0).view(2, 3)
    reference_x = x.clone()
    expected = model(reference_x)
    before, after, probabilities = convert(model, "O2", dtype=BF16)(x)
    assert torch.equal(x, reference_x)  # small integers: exact in bfloat16 too
    # The FP32 softmax reads the updated caller's tensor; the low linear its updated copy.
    torch.testing.assert_close(probabilities, expected[2], rtol=0, atol=0)
    assert not torch.allclose(before, after)
    rtol = rounding_tolerances(BF16)[0]
    torch.testing.assert_close(after, expected[1], rtol=rtol, atol=rtol * 20)


class _FunctionalBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, training=True)


def test_running_statistics_read_through_a_cast_are_updated():
    # LOWER batch_norm at O1 reads the float32 buffers through bfloat16 casts: the update of the
    # statistics lands on those casts and is copied back into the buffers.
    x = torch.arange(12.0).view(4, 3)
    reference = _FunctionalBatchNorm()
    reference(x)
    gm = convert(_FunctionalBatchNorm(), policy=preset("O1", BF16, "cpu").set_op("batch_norm", Rule.LOWER))
    assert any(n.target == "copy_" for n in gm.graph.nodes)
    gm(x)
    for name in ("running_mean", "running_var"):
        assert gm.get_buffer(name).dtype == F32
        torch.testing.assert_close(
            gm.get_buffer(name), reference.get_buffer(name), rtol=rounding_tolerances(BF16)[0], atol=0
        )


# ---------------------------------------------------------------------------------------------
# Optional inputs of unknown dtype
# ---------------------------------------------------------------------------------------------
class _TinyGPT(nn.Module):
    """nanoGPT's forward(idx, targets=None), without the size assert (torch.fx traces it)."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets=None):
        logits = self.lm_head(self.ln_f(self.wte(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_integer_targets_of_an_optional_input_are_never_cast(opt_level):
    gm = convert(_seeded(_TinyGPT), opt_level, dtype=BF16, front_end="fx")
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    logits, loss = gm(idx, idx)
    # The loss in the graph is the loss of the logits it returns, in float32 (O3: in bfloat16); at
    # O2 the fused loss sums in another order, hence float32's rounding tolerance.
    low = BF16 if opt_level == "O3" else F32
    expected = F.cross_entropy(logits.to(low).view(-1, 11), idx.view(-1)).float()
    rtol, atol = tolerances(F32)
    torch.testing.assert_close(loss, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("first", "second"), [("O2", "O0"), ("O2", "O1"), ("O1", "O3")])
def test_converting_a_converted_graph_at_another_level_is_refused(first, second):
    converted = convert(_seeded(Mlp), first, dtype=torch.float16, device_type="cpu")
    state = {k: v.clone() for k, v in converted.state_dict().items()}
    with pytest.raises(ValueError, match=f"already converted at {first}.*convert the original model"):
        convert(converted, second, dtype=torch.float16, device_type="cpu")
    assert all(torch.equal(v, converted.state_dict()[k]) for k, v in state.items())


def test_converting_a_converted_graph_to_another_dtype_is_refused():
    converted = convert(_seeded(Mlp), "O2", dtype=torch.float16, device_type="cpu")
    with pytest.raises(ValueError, match="torch.float16.*torch.bfloat16"):
        convert(converted, "O2", dtype=torch.bfloat16, device_type="cpu")
