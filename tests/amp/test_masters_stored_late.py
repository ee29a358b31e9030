"""amp.initialize at O2 gives an FP32 master to a parameter the torch.export front end stores low
only at the model's first call (amp_fx/capture/storage.py), for any optimizer, as Apex's O2 gives
one to every low-precision parameter: the optimizer steps the master, the model holds it rounded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from amp_fx import amp
from amp_fx.capture.captured_model import CapturedModel
from amp_fx.optim import FusedAdam
from amp_fx.testing import tolerances

BF16 = torch.bfloat16
FP32 = torch.float32

OPTIMIZERS = {  # name -> (the optimizer under test, torch.optim's on FP32 copies)
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2)),
    "sgd": (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ),
    "fused_adam": (
        lambda p: FusedAdam(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
    ),
}


class _Attention(nn.Module):
    """Parameters of its own beside a child's (Swin V2's attention): stored at the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 8, bias=False)
        self.q_bias = nn.Parameter(torch.randn(4) / 3)  # concatenated into the matmul's bias: low
        self.v_bias = nn.Parameter(torch.randn(4) / 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.7))  # only exp reads it: FP32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.cat([self.q_bias, self.v_bias])
        return nn.functional.linear(x, self.qkv.weight, bias) * self.logit_scale.exp()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != 8:  # stops torch.fx: amp.initialize takes the torch.export front end
            raise ValueError("x must have 8 features")
        y = self.attention(x)
        return self.head(y if scale is None else y * scale)


def _initialize(name: str, seed: int = 0) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Net()
    optimizer = OPTIMIZERS[name][0](model.parameters())
    converted, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=BF16, verbosity=0)
    assert isinstance(converted, CapturedModel)
    assert converted.attention.q_bias.dtype == FP32  # not stored before the first call
    return model, converted, optimizer


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
    return model(x).float().square().mean()


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> list[torch.Tensor]:
    """One amp step; returns the loss's unscaled FP32 gradients, per parameter."""
    loss = _loss(model, step)
    grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return [grad.float() for grad in grads]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_parameter_stored_low_at_the_first_call_steps_on_an_fp32_master(name: str) -> None:
    original, model, optimizer = _initialize(name)
    reference = [p.detach().clone().requires_grad_() for p in original.parameters()]
    reference_optimizer = OPTIMIZERS[name][1](reference)
    rtol, atol = tolerances(FP32)
    for step in range(3):
        grads = _train_step(model, optimizer, step)
        for ref, grad in zip(reference, grads, strict=True):
            ref.grad = grad
        reference_optimizer.step()
        stepped = dict(zip(map(id, model.parameters()), amp.master_params(optimizer), strict=True))
        for (param_name, param), ref in zip(model.named_parameters(), reference, strict=True):
            master = stepped[id(param)]
            assert master.dtype == FP32, param_name  # the optimizer steps FP32, whatever the param's dtype
            torch.testing.assert_close(master.detach(), ref.detach(), rtol=rtol, atol=atol, msg=param_name)
            assert torch.equal(param.detach(), master.detach().to(param.dtype)), param_name
    assert model.attention.q_bias.dtype == BF16 and model.attention.logit_scale.dtype == FP32
    # The FP32 checkpoint holds the masters, not the rounded parameters.
    checkpoint = model.state_dict()
    for (param_name, _), master in zip(model.named_parameters(), amp.master_params(optimizer), strict=True):
        assert torch.equal(checkpoint[param_name], master.detach()), param_name


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Per stepped tensor, in param-group order: its identity and clones of its state."""
    return [
        (id(p), {k: v.clone() for k, v in optimizer.state.get(p, {}).items()})
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def _same_snapshot(a: list, b: list) -> bool:
    return [key for key, _ in a] == [key for key, _ in b] and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for (_, x), (_, y) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("name", ["adamw", "fused_adam"])
def test_a_checkpoint_resumes_before_the_first_call_and_a_failed_call_changes_nothing(name: str) -> None:
    _, model, optimizer = _initialize(name)
    _train_step(model, optimizer, 0)
    saved_optimizer, saved_model = copy.deepcopy(optimizer.state_dict()), model.state_dict()
    masters = dict(zip(map(id, model.parameters()), amp.master_params(optimizer), strict=True))
    q_bias_master = masters[id(model.attention.q_bias)].detach().clone()

    _, resumed, resumed_optimizer = _initialize(name, seed=1)  # other weights: the loads must set them
    resumed_optimizer.load_state_dict(saved_optimizer)
    # Still FP32 before its first call, q_bias is its own master: the saved one loads into it.
    assert resumed.attention.q_bias.dtype == FP32 and torch.equal(resumed.attention.q_bias, q_bias_master)
    resumed.load_state_dict(saved_model)
    before = _optimizer_snapshot(resumed_optimizer)
    dtypes = [p.dtype for p in resumed.parameters()]
    # The model's own code raises after the attention (captured on its own) stored q_bias low.
    with pytest.raises(RuntimeError):
        resumed(torch.randn(3, 8), torch.ones(3))
    assert _same_snapshot(before, _optimizer_snapshot(resumed_optimizer))
    assert [p.dtype for p in resumed.parameters()] == dtypes
    assert torch.equal(resumed.attention.q_bias, q_bias_master)

    for step in (1, 2):  # bit for bit the run that was not interrupted
        _train_step(model, optimizer, step)
        _train_step(resumed, resumed_optimizer, step)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(amp.master_params(optimizer), amp.master_params(resumed_optimizer), strict=True):
        assert a.dtype == FP32 and torch.equal(a, b)


class _RootWeights(nn.Module):
    """Every parameter stored at the first call: the root holds them beside a child's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)  # a matmul reads it: low
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 8:  # stops torch.fx
            raise ValueError("x must have 8 features")
        return self.norm(x @ self.weight)


def test_the_fp32_checkpoint_holds_the_master_of_a_model_with_nothing_low_before_its_first_call() -> None:
    torch.manual_seed(0)
    original = _RootWeights()
    model, optimizer = amp.initialize(
        original, torch.optim.SGD(original.parameters(), lr=0.1), opt_level="O2", dtype=BF16, verbosity=0
    )
    assert all(p.dtype == FP32 for p in model.parameters())
    model(torch.randn(2, 8))
    assert model.weight.dtype == BF16
    checkpoint = model.state_dict()
    assert checkpoint["weight"].dtype == FP32 and torch.equal(checkpoint["weight"], original.weight)
