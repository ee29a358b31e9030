"""fuse_batch_norm: BatchNorm2d -> [residual add] -> ReLU as one FusedBatchNormAct call at O2.

Reference: the same conversion with ``fused_batch_norm=False`` (cuDNN/ATen BatchNorm, add, ReLU):
outputs and gradients agree to the low dtype's tolerances, running statistics to float32's, and
in eval mode the fused module computes exactly the unfused ops.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import Bottleneck, ResNet

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import preset
from amp_fx.ops import batch_norm as fused_batch_norm
from amp_fx.ops.batch_norm import FusedBatchNormAct
from amp_fx.passes.fuse_batch_norm import fuse_batch_norm
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.testing import grad_tolerances, tolerances

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    # Every pattern of ResNet-50: stem bn+relu, bottleneck bn+relu, bn3 + identity + relu, and a
    # downsample BatchNorm whose output is the residual (not fused itself).
    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=16)


def _images(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 64, 64, generator=generator).to(memory_format=torch.channels_last)


def _convert(model: nn.Module, fused: bool, dtype: torch.dtype = F16) -> torch.fx.GraphModule:
    policy = preset("O2", dtype=dtype, device_type="cpu", fused_batch_norm=fused)
    return amp_fx.convert(model, "O2", policy=policy).to(memory_format=torch.channels_last)


def _fused_modules(gm: nn.Module) -> list[FusedBatchNormAct]:
    return [m for m in gm.modules() if isinstance(m, FusedBatchNormAct)]


def test_resnet_patterns_are_fused_and_the_state_dict_is_unchanged():
    model = _resnet()
    gm = _convert(model, fused=True)
    fused = _fused_modules(gm)
    # stem 1 + per block bn1, bn2 (+relu) and bn3 (+identity+relu): 1 + 4 * 3.
    assert len(fused) == 13
    assert sum(m.relu for m in fused) == 13
    assert sorted(gm.state_dict()) == sorted(model.state_dict())
    assert all(m.batch_norm.weight.dtype == F32 for m in fused)  # keep_batchnorm_fp32
    relus = [n for n in gm.graph.nodes if node_info(n).op == "relu"]
    assert not relus
    notes = [note for n in gm.graph.nodes for note in node_info(n).notes if note.startswith("fused with")]
    assert len(notes) == 13 and sum("residual add" in note for note in notes) == 4


@pytest.fixture
def fuse_every_size(monkeypatch):
    """Fused calls at this file's sizes too (by default only large ones)."""
    monkeypatch.setattr(fused_batch_norm, "MIN_FUSED_ELEMENTS", 0)


@pytest.fixture
def fused_calls(monkeypatch) -> list[bool]:
    """Records each batch_norm_act call the fused modules make: whether it had a residual."""
    from amp_fx.ops import batch_norm as norms

    calls: list[bool] = []
    original = norms.batch_norm_act

    def recorded(*args):
        calls.append(args[7] is not None)
        return original(*args)

    monkeypatch.setattr(norms, "batch_norm_act", recorded)
    return calls


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_training_is_as_accurate_as_the_unfused_ops(dtype, fuse_every_size):
    # Against the float32 model: every gradient of the fused model within twice the unfused
    # model's error, and running statistics too (a tiny ResNet's last stages normalize over few
    # values, where the low dtype's rounding is amplified in both).
    images, labels = _images(), torch.tensor([1, 2, 3, 4])
    reference = _resnet().to(memory_format=torch.channels_last)
    F.cross_entropy(reference(images), labels).backward()
    results = []
    for fused in (True, False):
        gm = _convert(_resnet(), fused, dtype)
        loss = F.cross_entropy(gm(images), labels)
        loss.backward()
        results.append((loss, gm))
    (loss, fused), (ref_loss, unfused) = results
    rtol, atol = tolerances(dtype)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    _, grad_atol = grad_tolerances(dtype)
    for name, param in fused.named_parameters():
        exact = reference.get_parameter(name).grad
        error = (param.grad.float() - exact).abs().max()
        unfused_error = (unfused.get_parameter(name).grad.float() - exact).abs().max()
        assert error <= 2 * unfused_error + grad_atol, (name, error.item(), unfused_error.item())
    for name, exact in reference.state_dict().items():
        if "running" in name:
            error = (fused.get_buffer(name) - exact).abs().max()
            unfused_error = (unfused.get_buffer(name) - exact).abs().max()
            assert error <= 2 * unfused_error + atol, (name, error.item(), unfused_error.item())
        elif "num_batches" in name:
            assert torch.equal(fused.get_buffer(name), exact), name


def test_calls_below_the_size_threshold_run_torchs_ops(fused_calls, monkeypatch):
    # Training calls are fused from MIN_FUSED_ELEMENTS up, with or without a residual.
    gm = _convert(_resnet(), True)
    sizes: list[tuple[int, bool]] = []
    for module in _fused_modules(gm):
        module.register_forward_pre_hook(lambda m, args: sizes.append((args[0].numel(), len(args) == 2)))
    gm(_images())
    assert not fused_calls  # every activation of this tiny ResNet is below the default threshold
    first = sizes[:]  # one forward's calls: (elements, has a residual)
    threshold = sorted(size for size, _ in first)[len(first) // 2]
    monkeypatch.setattr(fused_batch_norm, "MIN_FUSED_ELEMENTS", threshold)
    gm(_images())
    assert fused_calls == [residual for size, residual in first if size >= threshold]
    assert any(fused_calls) and not all(fused_calls)


def test_new_modules_do_not_replace_the_models_own():
    class OwnsTheName(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.bn_relu = nn.BatchNorm2d(4), nn.Tanh()

        def forward(self, x):
            return self.bn_relu(F.relu(self.bn(x)))

    torch.manual_seed(0)
    model = OwnsTheName()
    gm = _convert(model, fused=True)
    assert isinstance(gm.bn_relu, nn.Tanh) and isinstance(gm.bn_relu_1, FusedBatchNormAct)
    x = torch.randn(2, 4, 5, 5).to(memory_format=torch.channels_last)
    expected = _convert(model, fused=False)(x)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)


def test_hooks_keep_their_modules_unfused_and_fire():
    model = _resnet()
    calls: list[str] = []
    model.bn1.register_forward_hook(lambda m, i, o: calls.append("bn1"))
    gm = _convert(model, True)
    assert "bn1" in dict(gm.named_modules()) and "bn1_relu" not in dict(gm.named_modules())
    fused = _fused_modules(gm)[0]
    fused.batch_norm.register_forward_pre_hook(lambda m, i: calls.append(fused.batch_norm_name))
    fused.batch_norm.train()
    out = gm(_images())
    assert calls == ["bn1", fused.batch_norm_name]
    expected = _convert(_resnet(), False)(_images())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_eval_mode_computes_exactly_the_unfused_ops():
    fused, unfused = _convert(_resnet(), True).eval(), _convert(_resnet(), False).eval()
    with torch.no_grad():
        assert torch.equal(fused(_images()), unfused(_images()))


class Branches(nn.Module):
    """BatchNorms that must stay unfused: output read twice, no ReLU, a residual of another dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.bn_twice, self.bn_tanh, self.bn_mixed = nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        x = x.half()  # low as a convolution's output (O2 casts a model input where it is lowered)
        a = self.bn_twice(x)
        b = torch.tanh(self.bn_tanh(x))
        c = F.relu(self.bn_mixed(x) + x.float().sum())
        return F.relu(a) + a + b + c


def test_patterns_that_are_not_fused():
    gm = _convert(Branches(), fused=True)
    assert not _fused_modules(gm)
    code = gm.code
    assert fuse_batch_norm(gm, Conversion(gm.meta["amp_fx_policy"])) == (gm, False)
    gm.recompile()
    assert gm.code == code and not _fused_modules(gm)  # running it again fuses nothing either


def test_only_o2_on_cuda_fuses_by_default():
    assert preset("O2", device_type="cuda").fused_batch_norm and not preset("O1").fused_batch_norm
    assert not preset("O3").fused_batch_norm
    # On other devices the kernels would run their pure-torch reference, slower than torch's.
    assert not preset("O2", device_type="cpu").fused_batch_norm
    assert not _fused_modules(amp_fx.convert(_resnet(), "O2", device_type="cpu"))
    assert not _fused_modules(amp_fx.convert(_resnet(), "O1", device_type="cpu"))


def test_converting_twice_changes_nothing_and_keeps_batch_norm_fp32():
    gm = _convert(_resnet(), fused=True)
    again = amp_fx.convert(gm, "O2", policy=gm.meta["amp_fx_policy"])
    assert again.code == gm.code
    assert all(m.batch_norm.weight.dtype == F32 for m in _fused_modules(again))


def test_copies_and_checkpoints_keep_one_batch_norm(tmp_path):
    gm = _convert(_resnet(), fused=True)
    path = tmp_path / "gm.pt"
    torch.save(gm, path)
    for copied in (copy.deepcopy(gm), torch.load(path, weights_only=False)):
        for module in _fused_modules(copied):
            assert module.batch_norm is copied.get_submodule(module.batch_norm_name)


def test_fused_module_refuses_other_norms():
    with pytest.raises(TypeError, match="needs an nn.BatchNorm2d"):
        FusedBatchNormAct(nn.SyncBatchNorm(4), "bn")


def test_compiles_without_graph_breaks_and_trains_like_eager():
    # Under torch.compile the fused module runs torch's ops (Inductor fuses BatchNorm, add and
    # ReLU itself), so compiling the converted ResNet breaks nothing and trains the same.
    images, labels = _images(), torch.tensor([1, 2, 3, 4])
    eager, compiled_model = _convert(_resnet(), True), _convert(_resnet(), True)
    explanation = torch._dynamo.explain(compiled_model)(images)
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    losses = [F.cross_entropy(model(images), labels) for model in (eager, compiled)]
    rtol, atol = tolerances(F16)
    torch.testing.assert_close(losses[1], losses[0], rtol=rtol, atol=atol)
