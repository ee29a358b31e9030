"""Checkpoints written before amp_fx's modules moved into rooms (capture/, training/, inspect/) still
load with ``torch.load(..., weights_only=True)``: state dicts hold tensors and plain values, never a
class of ours, so a move of a module cannot break them.

``data/checkpoint_before_rooms.pt`` was written by `write` (``python -m
tests.training.test_checkpoint_before_rooms``) on the commit before the move.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import amp_fx

CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_before_rooms.pt"


def _training_objects() -> tuple[nn.Module, amp_fx.optim.FusedAdam, amp_fx.LossScaler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 4))
    converted = amp_fx.convert(model, "O2", device_type="cpu")
    return (
        converted,
        amp_fx.optim.FusedAdam(converted.parameters(), lr=1e-2),
        amp_fx.LossScaler(init_scale=256.0),
    )


def _train(
    model: nn.Module, optimizer: amp_fx.optim.FusedAdam, scaler: amp_fx.LossScaler, steps: int
) -> None:
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x).float().square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def write(path: Path = CHECKPOINT) -> None:
    model, optimizer, scaler = _training_objects()
    _train(model, optimizer, scaler, steps=3)
    torch.save(
        {
            "masters": amp_fx.master_state_dict(model),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
        },
        path,
    )


def test_a_checkpoint_of_the_previous_layout_loads_weights_only():
    saved = torch.load(CHECKPOINT, weights_only=True)
    model, optimizer, scaler = _training_objects()
    model.load_state_dict(saved["masters"])
    optimizer.load_state_dict(saved["optimizer"])
    scaler.load_state_dict(saved["scaler"])

    assert scaler.state_dict() == saved["scaler"]
    restored = amp_fx.master_state_dict(model)
    assert restored.keys() == saved["masters"].keys()
    for name, value in saved["masters"].items():
        assert type(restored[name]) is torch.Tensor
        torch.testing.assert_close(restored[name], value, rtol=0, atol=0)
    assert [int(group["step"]) for group in optimizer.state_dict()["param_groups"]] == [3]

    # Training goes on from the loaded state.
    _train(model, optimizer, scaler, steps=1)
    assert [int(group["step"]) for group in optimizer.state_dict()["param_groups"]] == [4]
    assert scaler.state_dict()["_growth_tracker"] == saved["scaler"]["_growth_tracker"] + 1


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else CHECKPOINT)
