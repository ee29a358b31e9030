"""AmpPrecision under Lightning's ``ddp`` strategy: two gloo processes on CPU.

Each rank trains an O2 fp16 LightningModule on its half of every batch; the reference is one
process training on the whole batches. An overflow in rank 1's loss alone skips the step on both
ranks. The ranks end bit-identical to each other, and equal the single process within fp16's
tolerances."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import amp_fx
from amp_fx.integrations.lightning import AmpPrecision
from amp_fx.testing import assert_close_normwise, tolerances
from tests.training.distributed_launch import file_store_process_group, run_ranks, save_rank_result

WORLD_SIZE, GLOBAL_BATCH, STEPS, OVERFLOW_STEP = 2, 16, 4, 2
TIMEOUT_S = 120


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        # An overflow on the last rank only (on the whole batch in one process).
        if self.global_step == OVERFLOW_STEP and self.global_rank == self.trainer.world_size - 1:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run(rank: int, world_size: int, **trainer_kwargs: Any) -> dict[str, Any]:
    """Train STEPS steps on this rank's share of each global batch (every world_size-th sample, as
    an unshuffled DistributedSampler deals them); return what the ranks must agree on."""
    warnings.filterwarnings("ignore", module="lightning")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * GLOBAL_BATCH, 8, generator=generator)
    share = Subset(TensorDataset(x, x.sum(1, keepdim=True)), range(rank, len(x), world_size))
    data = DataLoader(share, batch_size=GLOBAL_BATCH // world_size)
    plugin = AmpPrecision("O2", dtype=torch.float16, loss_scaler=amp_fx.LossScaler(init_scale=1024.0))
    module = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        plugins=[plugin],
        max_steps=STEPS,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        **trainer_kwargs,
    )
    trainer.fit(module, train_dataloaders=data)
    return {
        "weights": {k: v.clone() for k, v in module.state_dict().items()},  # the FP32 masters
        "skipped": plugin.skipped_steps.item(),
        "scale": plugin.loss_scaler.get_scale(),
    }


def worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    # Lightning takes ranks launched by someone else from these variables (its LightningEnvironment).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD_SIZE))
    with file_store_process_group("gloo", rank, WORLD_SIZE, out_dir):
        strategy = DDPStrategy(process_group_backend="gloo")
        result = run(rank, WORLD_SIZE, devices=WORLD_SIZE, strategy=strategy)
    save_rank_result(result, out_dir, rank)


def test_ddp_ranks_agree_skip_together_and_match_one_process(tmp_path: Path) -> None:
    ranks = run_ranks(worker, tmp_path, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S)
    single = run(0, 1, devices=1)
    rtol, atol = tolerances(torch.float16)
    for key, value in ranks[0]["weights"].items():
        assert value.dtype == torch.float32
        assert torch.equal(ranks[1]["weights"][key], value)
        assert_close_normwise(value, single["weights"][key], rtol=rtol, atol=atol)
    assert [r["skipped"] for r in ranks] == [1, 1] and single["skipped"] == 1
    assert [r["scale"] for r in ranks] == [512.0, 512.0] == [single["scale"]] * 2
