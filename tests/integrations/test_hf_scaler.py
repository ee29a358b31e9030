"""AcceleratorScaler (AmpTrainer's scaler in accelerate's place) counts each overflowing step once,
whichever of ``unscale_`` (accelerate's clipping, user code) and ``defer_unscale_`` (AmpTrainer's
clipping) ran before the step, in either order, or neither. Reference: the steps made to overflow,
and LossScaler's own scale, which backs off once per overflowing step."""

from __future__ import annotations

import math

import pytest
import torch

import amp_fx
from amp_fx.integrations._hf_scaler import AcceleratorScaler
from amp_fx.optim import FusedAdam, FusedSGD

STEPS, OVERFLOW_AT, INIT_SCALE = 5, {1, 3}, 1024.0
SEQUENCES = [
    (),
    ("defer_unscale_",),
    ("unscale_",),
    ("defer_unscale_", "unscale_"),
    ("unscale_", "defer_unscale_"),
    ("defer_unscale_", "defer_unscale_"),
]


@pytest.mark.parametrize("optimizer_type", [FusedSGD, FusedAdam])
@pytest.mark.parametrize("sequence", SEQUENCES, ids=lambda s: "+".join(s) or "step_only")
def test_an_overflow_is_counted_once_per_step_whatever_unscaled(sequence, optimizer_type):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).half()
    optimizer = optimizer_type(model.parameters(), lr=1e-3)
    scaler = AcceleratorScaler(amp_fx.LossScaler(init_scale=INIT_SCALE, growth_interval=100))
    x = torch.randn(8, 4, dtype=torch.float16)
    counts = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = model(x).float().square().mean()
        scaler.scale(loss * math.inf if step in OVERFLOW_AT else loss).backward()
        for name in sequence:
            getattr(scaler, name)(optimizer)
        scaler.step(optimizer)
        scaler.update()
        counts.append(scaler.skipped_steps)
    expected = [sum(s in OVERFLOW_AT for s in range(step + 1)) for step in range(STEPS)]
    assert counts == expected
    assert scaler.get_scale() == INIT_SCALE / 2 ** len(OVERFLOW_AT)
    assert scaler.state_dict()["skipped_steps"] == len(OVERFLOW_AT)
