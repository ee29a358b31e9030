"""Fused optimizers pickled or deep-copied before per-parameter step offsets existed step on as
torch.optim does.

Such an object holds moments but no ``state[p]["step_offset"]``; every parameter then counts the
group's steps (offset 0), the semantics of that version. A restored copy must not take its next step
for a first one (an SGD momentum buffer reset to the grad, Adam's bias correction back at t = 1).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch

from amp_fx.optim import FusedAdam, FusedSGD
from amp_fx.testing import rounding_tolerances

SHAPES = ((5, 7), (3,), (2, 3, 4))
STEPS_BEFORE_COPY = 3
STEPS_AFTER_COPY = 3

OPTIMIZERS = {
    "adam": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=True),
    ),
    "sgd": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3),
        lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.3),
    ),
}

COPIES: dict[str, Callable[[torch.optim.Optimizer], torch.optim.Optimizer]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda optimizer: pickle.loads(pickle.dumps(optimizer)),
}


def _params() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]


def _step(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> None:
    for param, grad in zip(optimizer.param_groups[0]["params"], grads, strict=True):
        param.grad = grad.clone()
    optimizer.step()


@pytest.mark.parametrize("copy_name", COPIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_copy_without_step_offsets_steps_like_torch(name: str, copy_name: str, kernels: str) -> None:
    make_torch, make_fused = OPTIMIZERS[name]
    fused, reference = make_fused(_params()), make_torch(_params())
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS_BEFORE_COPY):
        grads = [torch.randn(s, generator=generator) for s in SHAPES]
        _step(fused, grads)
        _step(reference, grads)
    # The object as the version without per-parameter counts left it, then pickled or deep-copied.
    for state in fused.state.values():
        del state["step_offset"]
    restored = COPIES[copy_name](fused)

    group_step = restored.param_groups[0]["step"].reshape(())
    for param in restored.param_groups[0]["params"]:
        offset = restored.state[param]["step_offset"]
        assert offset.dtype == torch.float32 and offset.shape == () and offset.device == group_step.device
        assert float(offset) == 0.0
    rtol, atol = rounding_tolerances(torch.float32)
    for step in range(STEPS_AFTER_COPY):
        grads = [torch.randn(s, generator=generator) for s in SHAPES]
        _step(restored, grads)
        _step(reference, grads)
        # Within fp32 rounding (torch.optim fuses multiply-adds); a restarted count is far outside it.
        for i, (got, want) in enumerate(
            zip(restored.param_groups[0]["params"], reference.param_groups[0]["params"], strict=True)
        ):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"step {step}, param {i}")
