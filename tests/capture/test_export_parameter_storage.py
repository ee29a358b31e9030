"""O2 stores the parameters of a torch.export front end model as the fx front end does (issue 25).

A parameter held by a module whose children hold parameters (CLIP's ``logit_scale``, ViT's class
token and position table) is read by code only a graph shows: it stays FP32 at convert and the
first capture that reads it stores it by the graph, with the rule of the fx front end. One kept
FP32 is never rounded, keeps its identity for an optimizer built before the first call and for
later captures, and the report says why; one stored low gets its FP32 master in that optimizer;
a failed call leaves all of it as it was.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import amp_fx
import amp_fx.capture.captured_model
from amp_fx.core.node_info import node_info
from amp_fx.optim import FusedAdam
from amp_fx.optim.model_load_hooks import MASTER_KEY
from amp_fx.passes.shared.decisions import UNLOWERED_PARAMETER_REASON
from amp_fx.testing import RELATIVE_BOUND, error_ratio

BF16 = torch.bfloat16
FP32 = torch.float32


def _reasons(model: nn.Module, name: str) -> list[str]:
    """The report's reason at each read of parameter ``name`` in every graph captured so far."""
    return [
        node_info(node).reason
        for gm in amp_fx.captured_graphs(model)
        for node in gm.graph.nodes
        if node.op == "get_attr" and node.target == name
    ]


def _hf(name: str) -> tuple[nn.Module, Any]:
    pytest.importorskip("transformers")
    from tests.models.hf import MODELS

    torch.manual_seed(0)
    return MODELS[name]()


def test_clip_logit_scale_is_never_rounded_and_trains_in_fp32() -> None:
    model, inputs = _hf("clip")
    kept = ["logit_scale", "vision_model.embeddings.class_embedding"]
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    params = dict(o2.named_parameters())
    optimizer = FusedAdam(o2.parameters(), lr=1e-2)  # after convert, before the first call
    o2(**inputs(2, 8)).loss.backward()
    for name in kept:  # the original's value bit for bit, the tensor the optimizer holds
        assert o2.get_parameter(name) is params[name] and params[name].dtype == FP32, name
        assert torch.equal(params[name], model.get_parameter(name)), name
        assert MASTER_KEY not in optimizer.state[params[name]]  # an FP32 parameter is its own master
        assert _reasons(o2, name) == [UNLOWERED_PARAMETER_REASON], name
    assert o2.visual_projection.weight.dtype == BF16
    # Its step is torch.optim's Adam on an FP32 tensor.
    reference = nn.Parameter(params["logit_scale"].detach().clone())
    reference.grad = params["logit_scale"].grad.clone()
    torch.optim.Adam([reference], lr=1e-2).step()
    optimizer.step()
    assert torch.equal(params["logit_scale"], reference)
    # Captures for a new length and for eval mode keep it, and their reports say why.
    o2.eval()
    o2(**inputs(3, 5))
    assert o2.get_parameter("logit_scale") is params["logit_scale"] and params["logit_scale"].dtype == FP32
    assert _reasons(o2, "logit_scale") == [UNLOWERED_PARAMETER_REASON] * len(amp_fx.captured_graphs(o2)) != []
    assert amp_fx.master_state_dict(o2)["logit_scale"].dtype == FP32


def test_vit_class_token_and_position_table_stay_fp32_within_the_oracles_bound() -> None:
    model, inputs = _hf("vit")
    model.eval()
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    batch = inputs(2, 0)
    measured = error_ratio(model, o2, (), keyword_inputs=batch)
    assert not measured.failures(RELATIVE_BOUND), measured.failures(RELATIVE_BOUND)
    for name in ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings"):
        assert o2.get_parameter(name).dtype == FP32, name
        assert torch.equal(o2.get_parameter(name), model.get_parameter(name)), name
        assert set(_reasons(o2, name)) == {UNLOWERED_PARAMETER_REASON}, name
    assert o2.vit.embeddings.patch_embeddings.projection.weight.dtype == BF16


class _Attention(nn.Module):
    """Parameters of its own beside a child's, as Swin V2's attention holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 8, bias=False)
        self.q_bias = nn.Parameter(torch.randn(4) / 3)  # concatenated into the projection's bias
        self.v_bias = nn.Parameter(torch.randn(4) / 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.7))  # only exp and mul read it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.cat([self.q_bias, self.v_bias])
        return nn.functional.linear(x, self.qkv.weight, bias) * self.logit_scale.exp()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.attention(x)
        return self.head(y if scale is None else y * scale)


def test_storage_follows_the_fx_rule_tells_the_optimizer_and_a_failed_call_undoes_it() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(3, 8)
    fx = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    converted = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu", front_end="export")
    q_bias = converted.attention.q_bias
    assert q_bias.dtype == FP32  # not stored before a graph reads it
    optimizer = FusedAdam(converted.parameters(), lr=1e-2)
    # The head's input does not broadcast with ``scale``: the model's own code raises, after the
    # attention (a captured part, called from the island the failed capture leaves) stored q_bias.
    with pytest.raises(RuntimeError):
        converted(x, torch.ones(3))
    assert q_bias.dtype == FP32 and torch.equal(q_bias, model.attention.q_bias)
    assert MASTER_KEY not in optimizer.state[q_bias]
    copied = copy.deepcopy(converted)  # before the first call: it stores its own at its own
    converted(x).sum().backward()
    assert converted.attention.q_bias is q_bias
    dtypes = {name: param.dtype for name, param in converted.named_parameters()}
    assert dtypes == {name: param.dtype for name, param in fx.named_parameters()}  # the fx front end's
    assert q_bias.dtype == BF16 and converted.attention.logit_scale.dtype == FP32
    # The optimizer built before the store keeps q_bias's FP32 value as its master, not the rounded one.
    assert torch.equal(optimizer.state[q_bias][MASTER_KEY], model.attention.q_bias)
    optimizer.step()
    assert torch.equal(q_bias, optimizer.state[q_bias][MASTER_KEY].to(BF16))
    assert copied.attention.q_bias.dtype == FP32
    copied(x)
    assert copied.attention.q_bias.dtype == BF16 and copied.attention.q_bias is not q_bias
    # O3 stores every parameter low when it converts, as Apex's O3 does.
    o3 = amp_fx.convert(model, "O3", dtype=BF16, device_type="cpu", front_end="export")
    assert all(p.dtype == BF16 for p in o3.parameters())


def test_a_rewrite_that_raises_leaves_the_parameters_unstored(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(3, 8)
    converted = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu", front_end="export")
    rewrite = amp_fx.capture.captured_model.rewrite_graph

    def rewrite_then_raise(*args: Any) -> None:
        rewrite(*args)  # the passes have stored q_bias low by now
        raise RuntimeError("a pass failed")

    monkeypatch.setattr(amp_fx.capture.captured_model, "rewrite_graph", rewrite_then_raise)
    with pytest.raises(RuntimeError, match="a pass failed"):
        converted(x)
    assert converted.attention.q_bias.dtype == FP32
    assert torch.equal(converted.attention.q_bias, model.attention.q_bias)
    monkeypatch.undo()
    converted(x)
    assert converted.attention.q_bias.dtype == BF16


class _MatmulLinear(nn.Linear):
    """A Linear whose forward writes its product out (Falcon's FalconLinear does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class _WrittenOutLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = _MatmulLinear(8, 16), _MatmulLinear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == 8  # keeps torch.fx out: the torch.export front end converts it
        return self.down(torch.relu(self.up(x)))


def test_weights_stored_low_at_convert_stay_low_at_the_first_graph() -> None:
    """A weight stored low at convert (its module is a Linear) is not raised to FP32 by its first
    graph, whatever spelling the product takes there; only a router's weight is (test_moe_o2)."""
    torch.manual_seed(0)
    model = _WrittenOutLinears()
    converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16, front_end="export")
    stored = {name: p.dtype for name, p in converted.named_parameters()}
    assert set(stored.values()) == {torch.bfloat16}
    converted(torch.randn(4, 8)).sum().backward()
    assert {name: p.dtype for name, p in converted.named_parameters()} == stored
