"""The converted models: disable_casts and FP32 checkpoints (amp_fx/amp/_model.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_fx import amp
from amp_fx.amp._model import convert_level
from amp_fx.amp._properties import resolve_properties


class WithUntraceable(nn.Module):
    """A model whose `gate` has data-dependent control flow: an opaque node, an autocast island."""

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(10, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            return y if y.sum() > 0 else -y

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.gate = self.Gate()
        self.fc2 = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.softmax(self.gate(self.fc1(x)), dim=-1))


def _mlp(norm: type[nn.Module] = nn.ReLU) -> nn.Module:
    return nn.Sequential(nn.Linear(10, 10), norm(10) if norm is nn.BatchNorm1d else norm(), nn.Linear(10, 2))


@pytest.mark.parametrize("make", [_mlp, WithUntraceable])
def test_disable_casts_runs_an_o1_model_as_the_original(make):
    torch.manual_seed(0)
    original = make()
    model = amp.initialize(copy.deepcopy(original), opt_level="O1", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(4, 10)
    assert model(x).dtype == torch.bfloat16
    with amp.disable_casts():
        output = model(x)
    assert output.dtype == torch.float32 and torch.equal(output, original(x))
    assert model(x).dtype == torch.bfloat16  # only inside the block


@pytest.mark.parametrize("make", [lambda: _mlp(nn.BatchNorm1d), WithUntraceable])
def test_disable_casts_runs_an_o2_model_in_fp32_on_its_weights(make):
    torch.manual_seed(0)
    source = make().eval()
    model = amp.initialize(copy.deepcopy(source), opt_level="O2", verbosity=0).eval()
    # The reference: the original FP32 model holding the O2 model's (rounded) weights.
    reference = copy.deepcopy(source)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    reference.load_state_dict({name: t.float() for name, t in tensors}, strict=False)
    x = torch.randn(4, 10)
    with amp.disable_casts():
        output = model(x)
    torch.testing.assert_close(output, reference(x), rtol=1e-6, atol=1e-6)


def test_disable_casts_passes_grads_to_the_low_precision_weights():
    torch.manual_seed(0)
    model = amp.initialize(_mlp(), opt_level="O2", verbosity=0)
    with amp.disable_casts():
        model(torch.randn(4, 10)).sum().backward()
    weight = getattr(model, "0").weight
    assert weight.dtype == torch.float16 and weight.grad is not None and weight.grad.dtype == torch.float16


def test_convert_level_follows_the_properties():
    assert convert_level(resolve_properties("O1")) == "O1"
    assert convert_level(resolve_properties("O1", patch_torch_functions=False)) == "O0"
    assert convert_level(resolve_properties("O2")) == "O2"
    assert convert_level(resolve_properties("O3")) == "O3"
    assert convert_level(resolve_properties("O0", cast_model_type=torch.float16)) == "O3"
    assert convert_level(resolve_properties("O2", cast_model_type=torch.float32)) == "O0"


def test_o1_checkpoints_are_the_plain_state_dict(tiny_net):
    source = tiny_net()
    model = amp.initialize(copy.deepcopy(source), opt_level="O1", verbosity=0)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in source.state_dict().items())


def test_o3_checkpoints_upcast_weights_and_buffers(tiny_net, make_batch):
    source = tiny_net(batch_norm=True)
    model = amp.initialize(copy.deepcopy(source), opt_level="O3", verbosity=0)
    model.train()
    model(make_batch(0)[0])  # moves the fp16 running statistics
    assert model.bn.running_mean.dtype == torch.float16
    state = model.state_dict()
    assert state["bn.running_mean"].dtype == torch.float32
    assert torch.equal(state["bn.running_mean"], model.bn.running_mean.float())
    assert state["bn.num_batches_tracked"].dtype == torch.int64
    F.cross_entropy(source(make_batch(0)[0]), make_batch(0)[1])  # the original still runs
    source.load_state_dict(state)
