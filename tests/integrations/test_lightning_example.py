"""examples/train_lightning.py runs on CPU: trains, reloads its FP32 checkpoint without amp_fx, resumes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lightning.py"


def test_train_lightning_example(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("amp_fx_example_train_lightning", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--epochs", "2", "--samples", "512", "--checkpoint-dir", str(tmp_path)]
    results = example.main(args)
    assert results["weights_dtypes"] == {torch.float32}
    assert results["reloaded_accuracy"] > 50.0  # chance is 25% (4 classes)
    assert abs(results["reloaded_accuracy"] - results["trained_accuracy"]) < 5.0  # fp16 vs its masters
    assert results["resumed_steps"] == 512 // 64  # one more epoch from the checkpoint
    out = capsys.readouterr().out
    assert "optimizer: FusedAdam, masters ['torch.float32']" in out and "loss scale" in out
