"""Shared by the optimizer tests: random problems with FP32 twins, and bit-exact snapshots."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.bit_equality import bits_equal

# Odd sizes, a single element, and a 3-d tensor; small, so the tests stay fast on CPU.
SHAPES = ((5, 7), (3,), (1,), (2, 3, 4))


class Problem:
    """Parameters in the given dtypes, FP32 copies for torch.optim, and a seeded stream of grads.

    ``next_grads(scale)`` draws one grad per parameter in the parameter's dtype, gives the FP32
    copies the same values (upcast) and the parameters those values times ``scale`` (as a loss
    scaler would see them; exact for power-of-two scales that do not overflow).
    """

    def __init__(self, dtypes: torch.dtype | Sequence[torch.dtype], seed: int = 0, shapes=SHAPES) -> None:
        generator = torch.Generator().manual_seed(seed)
        if isinstance(dtypes, torch.dtype):
            dtypes = [dtypes] * len(shapes)
        self.params = [
            torch.nn.Parameter(torch.randn(s, generator=generator).to(d))
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        self.fp32 = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._generator = torch.Generator().manual_seed(seed + 1000)

    def next_grads(self, scale: float = 1.0) -> list[torch.Tensor]:
        grads = [torch.randn(p.shape, generator=self._generator).to(p.dtype) for p in self.params]
        for param, copy, grad in zip(self.params, self.fp32, grads, strict=True):
            copy.grad = grad.float().clone()
            param.grad = (grad.float() * scale).to(param.dtype)
        return grads


# The state tensors the fused optimizers create at a parameter's first step.
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Clones of every param, state tensor and group entry, to compare bit for bit later."""
    groups = []
    for group in optimizer.param_groups:
        entries = {
            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"
        }
        params = [p.detach().clone() for p in group["params"]]
        states = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in group["params"]]
        groups.append({"entries": entries, "params": params, "states": states})
    return {"groups": groups}


def assert_snapshots_equal(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert len(before["groups"]) == len(after["groups"])
    for old, new in zip(before["groups"], after["groups"], strict=True):
        assert old["entries"].keys() == new["entries"].keys()
        for key, value in old["entries"].items():
            if isinstance(value, torch.Tensor):
                assert bits_equal(value, new["entries"][key]), key
            else:
                assert value == new["entries"][key], key
        for p_old, p_new in zip(old["params"], new["params"], strict=True):
            assert bits_equal(p_old, p_new)
        for s_old, s_new in zip(old["states"], new["states"], strict=True):
            # A parameter's first step creates its moments before the device knows whether the step
            # overflows (knowing would take a host sync); a skipped first step leaves them at zero,
            # the state of moments that were never updated, with the step offset that makes the next
            # step its first (the group's count, which the skip kept). Anything else must stay as it was.
            for key in s_new.keys() - s_old.keys():
                if key == "step_offset":
                    assert bits_equal(s_new[key], new["entries"]["step"].reshape(())), key
                else:
                    assert key in MOMENT_KEYS and not s_new[key].any(), key
            assert s_old.keys() <= s_new.keys()
            for key in s_old:
                assert bits_equal(s_old[key], s_new[key]), key


@pytest.fixture
def problem() -> type[Problem]:
    return Problem


@pytest.fixture
def optimizer_snapshot():
    """(snapshot, assert_snapshots_equal): take a snapshot, later assert nothing changed."""
    return snapshot, assert_snapshots_equal


@pytest.fixture
def bits_equal_fn():
    return bits_equal
