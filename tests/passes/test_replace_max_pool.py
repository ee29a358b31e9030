"""replace_max_pool: 2-D max-pool calls through amp_fx.ops.max_pool.max_pool2d at O2.

Reference: the same conversion with ``fused_max_pool=False`` (torch's max-pool): the outputs are
identical (a maximum is one of the inputs) and the gradients agree to one rounding of the low
dtype (torch's CPU backward sums fp16/bf16 gradients of overlapping windows in their own dtype,
amp_fx's in fp32).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Policy, preset
from amp_fx.ops import max_pool as pooling
from amp_fx.ops.max_pool import max_pool2d
from amp_fx.passes.replace_max_pool import replace_max_pool
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.testing import rounding_tolerances


@pytest.fixture(autouse=True)
def fuse_every_size(monkeypatch):
    """This file's small inputs take the fused path (by default only large ones do)."""
    monkeypatch.setattr(pooling, "MIN_FUSED_ELEMENTS", 0)


class Pools(nn.Module):
    """Every spelling of a 2-D max-pool, and the calls the pass must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.pool_ceil = nn.MaxPool2d((2, 3), ceil_mode=True, dilation=(1, 1))
        self.pool_with_indices = nn.MaxPool2d(2, return_indices=True)
        self.pool_1d = nn.MaxPool1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        a = self.pool(h)
        b = self.pool_ceil(h)
        c = F.max_pool2d(h, 2, padding=1)
        d = torch.max_pool2d(h, [2, 2], [1, 1])
        e, indices = F.max_pool2d(h, 2, return_indices=True)
        f, _ = self.pool_with_indices(h)
        g = self.pool_1d(h.flatten(2))
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + f.sum() + g.sum() + indices.sum()


def _images(batch: int = 2, size: int = 9, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=generator).to(memory_format=torch.channels_last)


def _convert(
    model: nn.Module, level: str = "O2", fused: bool | None = True, **kwargs
) -> torch.fx.GraphModule:
    policy = preset(level, device_type="cpu", fused_max_pool=fused, **kwargs)
    return amp_fx.convert(model, level, policy=policy).to(memory_format=torch.channels_last)


def _replaced(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is max_pool2d]


def test_o2_replaces_every_2d_max_pool_without_indices() -> None:
    gm = _convert(Pools())
    replaced = _replaced(gm)
    assert [n.name for n in replaced] == ["pool", "pool_ceil", "max_pool2d", "max_pool2d_1"]
    for node in replaced:
        info = node_info(node)
        assert info.op == "max_pool2d" and info.in_dtypes == (torch.float16,)
        assert any("amp_fx.ops.max_pool.max_pool2d" in note for note in info.notes)
    pool, pool_ceil, functional, builtin = replaced
    assert pool.args[1:] == (3,) and pool.kwargs == {
        "stride": 2,
        "padding": 1,
        "dilation": 1,
        "ceil_mode": False,
    }
    assert pool_ceil.args[1:] == ((2, 3),) and pool_ceil.kwargs["ceil_mode"] is True
    assert pool_ceil.kwargs["stride"] == (2, 3)  # nn.MaxPool2d's default stride: the kernel size
    assert functional.kwargs == {"stride": None, "padding": 1, "dilation": 1, "ceil_mode": False}
    assert builtin.args[1:] == ([2, 2],) and builtin.kwargs == {"stride": [1, 1]}
    # Left alone: calls that return indices and the 1-D pool.
    targets = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert {"pool_with_indices", "pool_1d"} <= targets
    assert any(n.target is F.max_pool2d_with_indices for n in gm.graph.nodes)
    assert amp_fx.report(gm).to_dict()["policy"]["fused_max_pool"] is True


def test_max_pool_modules_with_hooks_stay_modules() -> None:
    model = Pools()
    calls: list[str] = []
    model.pool.register_forward_hook(lambda m, i, o: calls.append("pool"))
    gm = _convert(model)
    assert [n.name for n in _replaced(gm)] == ["pool_ceil", "max_pool2d", "max_pool2d_1"]
    gm(_images())
    assert calls == ["pool"]


def test_outputs_match_torch_max_pool() -> None:
    torch.manual_seed(0)
    model = Pools()
    x = _images()
    assert torch.equal(_convert(model)(x), _convert(model, fused=False)(x))


@pytest.mark.parametrize("level", ["O0", "O1", "O3"])
def test_only_o2_on_cuda_by_default(level: str) -> None:
    assert not _replaced(_convert(Pools(), level, fused=None))
    assert not preset(level).fused_max_pool
    assert preset("O2", device_type="cuda").fused_max_pool
    # On other devices the kernels would run their pure-torch reference, slower than torch's.
    assert not preset("O2", device_type="cpu").fused_max_pool
    assert not _replaced(_convert(Pools(), "O2", fused=None))


def test_the_flag_decides() -> None:
    assert not _replaced(_convert(Pools(), "O2", fused=False))
    assert len(_replaced(_convert(Pools(), "O3", fused=True))) == 4
    gm = _convert(Pools(), "O2", fused=False)
    assert not _replaced(gm)
    result = replace_max_pool(gm, Conversion(preset("O2", device_type="cpu", fused_max_pool=True)))
    assert result.modified is True and len(_replaced(result.graph_module)) == 4


def test_converting_a_converted_graph_again_changes_nothing() -> None:
    gm = _convert(Pools())
    again = amp_fx.convert(gm, "O2", policy=gm.meta["amp_fx_policy"])
    assert [n.name for n in _replaced(again)] == [n.name for n in _replaced(gm)]
    assert all(node_info(n).op == "max_pool2d" for n in _replaced(again))
    x = _images()
    assert torch.equal(again(x), gm(x))


def test_policy_flag_round_trips_and_is_checked() -> None:
    policy = preset("O2", device_type="cuda")
    data = json.loads(json.dumps(policy.to_dict()))
    assert data["fused_max_pool"] is True
    assert Policy.from_dict(data) == policy
    del data["fused_max_pool"]
    assert Policy.from_dict(data).fused_max_pool is False
    assert "fused_max_pool=True" in str(policy)
    with pytest.raises(TypeError, match="fused_max_pool must be True or False"):
        preset("O2", fused_max_pool="yes")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_resnet18_outputs_and_gradients_match_torch_max_pool(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    x = _images(batch=2, size=32, seed=1)
    results = []
    for fused in (True, False):
        gm = _convert(model, fused=fused, dtype=dtype)
        assert len(_replaced(gm)) == (1 if fused else 0)
        out = gm(x)
        out.float().square().sum().backward()
        results.append((out.detach(), {name: p.grad for name, p in gm.named_parameters()}))
    (fused_out, fused_grads), (torch_out, torch_grads) = results
    assert torch.equal(fused_out, torch_out)
    # The max-pool's input gradient differs by roundings (fp32 sums here, fp16/bf16 sums in torch's
    # CPU backward); the BatchNorm backwards before it subtract means, so elements of the earlier
    # gradients can differ relatively more, but each gradient as a whole stays within one rounding.
    rtol, _ = rounding_tolerances(dtype)
    for name, grad in torch_grads.items():
        difference = (fused_grads[name].float() - grad.float()).norm() / grad.float().norm()
        assert difference <= rtol, (name, difference)
    # Layers after the max-pool see identical values: their gradients are bit-identical.
    assert torch.equal(fused_grads["fc.weight"], torch_grads["fc.weight"])
