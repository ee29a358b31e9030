"""Shared pieces of the amp front end's tests: small models, deterministic batches, clean state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_fx.amp._state as amp_state
from amp_fx import amp
from amp_fx.amp import _fp32_functions


class TinyNet(nn.Module):
    """The first seed's Net (two Linears and a ReLU), optionally with a BatchNorm in between."""

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.bn = nn.BatchNorm1d(10) if batch_norm else nn.Identity()
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.bn(self.fc1(x))))


def batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number `step`: the same tensors every time it is asked for."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randn(size, 10, generator=generator)
    return inputs, (inputs.sum(dim=1) > 0).long()


@pytest.fixture(autouse=True)
def clean_amp_state():
    """Each test starts with no amp session, no registered functions and torch's own functions
    (O1 patches them), and leaves none."""
    amp_state._current = None
    amp.clear_registered_functions()
    _fp32_functions.restore()
    yield
    amp_state._current = None
    amp.clear_registered_functions()
    _fp32_functions.restore()


@pytest.fixture
def tiny_net():
    def make(seed: int = 0, batch_norm: bool = False) -> TinyNet:
        torch.manual_seed(seed)
        return TinyNet(batch_norm)

    return make


@pytest.fixture
def make_batch():
    return batch
