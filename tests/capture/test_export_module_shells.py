"""O2 keeps norm parameters FP32 when the model converted is an exported program's module.

``torch.export.export(model, args).module()`` holds each submodule's parameters in a plain
``nn.Module`` (no forward, no type naming a norm), so the module tree cannot say which parameters
a LayerNorm reads. They stay FP32 at convert (a BatchNorm's running statistics too) and the first
capture's graph decides them, as for parameters a composite module holds
(`amp_fx/capture/storage.py`): a norm reading one keeps it FP32, a Linear reading one stores it
low. The result computes as the original model converted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import amp_fx
import amp_fx.capture.captured_model
from amp_fx.core.node_info import node_info
from amp_fx.optim import FusedAdam
from amp_fx.optim.model_load_hooks import MASTER_KEY
from amp_fx.testing import assert_equivalent, forward_backward, with_autocast

FP32 = torch.float32
NORMS = [nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d] + ([nn.RMSNorm] if hasattr(nn, "RMSNorm") else [])


class _Net(nn.Module):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.norm = norm(4, 16) if norm is nn.GroupNorm else norm(16)
        self.down = nn.Linear(16, 4)
        with torch.no_grad():  # away from the identity, so a rounded norm weight would show
            for param in self.norm.parameters():
                param.add_(torch.randn_like(param) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


def _shell_model(norm: type[nn.Module]) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, x = _Net(norm), torch.randn(3, 8)
    shells = torch.export.export(model, (x,)).module()
    assert type(shells.norm) is nn.Module  # the type that named the norm is gone
    return model, shells, x


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _casts_of(model: nn.Module, names: set[str]) -> list[str]:
    return [
        node.target
        for gm in amp_fx.captured_graphs(model)
        for node in gm.graph.nodes
        if node.op == "get_attr" and node.target in names and any(node_info(u).is_cast for u in node.users)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", NORMS)
def test_norm_parameters_of_an_exported_module_stay_fp32(norm: type[nn.Module], dtype: torch.dtype) -> None:
    model, shells, x = _shell_model(norm)
    reference = amp_fx.convert(model, "O2", dtype=dtype, device_type="cpu", front_end="export")
    converted = amp_fx.convert(shells, "O2", dtype=dtype, device_type="cpu", front_end="export")
    expected = forward_backward(reference, (x,))
    actual = forward_backward(converted, (x,))
    norm_names = {name for name, _ in converted.named_parameters() if name.startswith("norm.")}
    dtypes = {name: t.dtype for name, t in _tensors(converted)}
    assert dtypes == {name: t.dtype for name, t in _tensors(reference)}
    assert {dtypes[name] for name in norm_names} == {FP32}
    assert {dtypes["up.weight"], dtypes["down.bias"]} == {dtype}
    assert _casts_of(converted, norm_names) == []
    for got, want in zip(actual.outputs, expected.outputs, strict=True):
        assert type(got) is torch.Tensor and torch.equal(got, want)
    assert actual.param_grads.keys() == expected.param_grads.keys()
    for name, grad in actual.param_grads.items():
        assert torch.equal(grad, expected.param_grads[name]), name
    assert_equivalent(with_autocast(model, "cpu", dtype), converted, (x,), dtype=dtype, measure="fixed")


def test_a_failed_first_call_leaves_the_shells_parameters_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    model, shells, x = _shell_model(nn.LayerNorm)
    converted = amp_fx.convert(shells, "O2", dtype=torch.bfloat16, device_type="cpu", front_end="export")
    optimizer = FusedAdam(converted.parameters(), lr=1e-2)
    rewrite = amp_fx.capture.captured_model.rewrite_graph

    def rewrite_then_raise(*args: Any) -> None:
        rewrite(*args)  # the passes have stored the Linears' parameters low by now
        raise RuntimeError("a pass failed")

    monkeypatch.setattr(amp_fx.capture.captured_model, "rewrite_graph", rewrite_then_raise)
    with pytest.raises(RuntimeError, match="a pass failed"):
        converted(x)
    for name, param in converted.named_parameters():
        assert param.dtype == FP32 and torch.equal(param, model.get_parameter(name)), name
        assert MASTER_KEY not in optimizer.state[param]
    monkeypatch.undo()
    converted(x).sum().backward()
    weight = converted.up.weight
    assert weight.dtype == torch.bfloat16 and converted.norm.weight.dtype == FP32
    # The optimizer built before the first call keeps the FP32 value as master, not the rounded one.
    assert torch.equal(optimizer.state[weight][MASTER_KEY], model.up.weight)
