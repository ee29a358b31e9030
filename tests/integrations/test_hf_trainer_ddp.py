"""`AmpTrainer` under DistributedDataParallel: two gloo processes on the CPU, launched as torchrun
would (RANK, WORLD_SIZE, LOCAL_RANK in the environment; the process group made first, from a file
store, which the Trainer's accelerate then uses), against one process on the whole batch.

- both ranks end bit-identical (masters, weights, loss scale, skip count);
- they match one process training on the global batch (2 x 2 = 4 sequences) within fp16's
  tolerance: DDP averages the ranks' gradients, num_items_in_batch counts both ranks' labels.

About 10 s on two idle cores, most of it the two processes importing torch and transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import amp_fx  # noqa: E402
from amp_fx.integrations.transformers import AmpTrainer  # noqa: E402
from amp_fx.optim import master_params  # noqa: E402
from tests.integrations.test_transformers_trainer import sequences, tiny_llama, training_args  # noqa: E402
from tests.training.distributed_launch import file_store_process_group, run_ranks, save_rank_result  # noqa: E402

WORLD_SIZE, PER_RANK, STEPS = 2, 2, 3
TIMEOUT_S = 180


def train(output_dir: Path, batch_size: int, **distributed: str) -> dict[str, object]:
    args = training_args(
        output_dir, fp16=True, max_steps=STEPS, per_device_train_batch_size=batch_size, **distributed
    )
    trainer = AmpTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=sequences(16),
        loss_scaler=amp_fx.LossScaler(init_scale=2.0**10),
    )
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "masters": [m.detach().clone() for m in master_params(optimizer)],
        "params": [p.detach().clone() for g in optimizer.param_groups for p in g["params"]],
        "scale": trainer.loss_scaler.get_scale(),
        "skipped": trainer.skipped_steps,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }


def worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
        OMP_NUM_THREADS="1",
    )
    with file_store_process_group("gloo", rank, WORLD_SIZE, out_dir):
        save_rank_result(
            train(Path(out_dir) / f"rank{rank}_run", PER_RANK, ddp_backend="gloo"), out_dir, rank
        )


def test_two_processes_agree_and_match_one(tmp_path: Path) -> None:
    ranks = run_ranks(worker, tmp_path, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S)
    assert [r["wrapped"] for r in ranks] == ["DistributedDataParallel"] * WORLD_SIZE
    first, second = ranks
    for key in ("masters", "params"):
        for a, b in zip(first[key], second[key], strict=True):
            assert torch.equal(a, b), f"the ranks' {key} differ"
    assert (first["scale"], first["skipped"]) == (second["scale"], second["skipped"])
    single = train(tmp_path / "single", WORLD_SIZE * PER_RANK)
    assert first["scale"] == single["scale"] and first["skipped"] == single["skipped"] == 0
    rtol, atol = amp_fx.testing.tolerances(torch.float16)
    for i, (ddp, one) in enumerate(zip(first["masters"], single["masters"], strict=True)):
        amp_fx.testing.assert_close_normwise(ddp, one, rtol=rtol, atol=atol, name=f"master {i}")
    # Each rank logs the loss averaged over both.
    assert first["losses"] == second["losses"] and first["losses"] == pytest.approx(
        single["losses"], rel=rtol
    )
