"""A model converted by the torch.export front end trains under DistributedDataParallel (gloo, two
CPU processes): both ranks hold the same weights after each step, equal to one process that
trains on the whole global batch, within bf16's rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import amp_fx
from amp_fx.capture.captured_model import CapturedModel
from amp_fx.optim import FusedAdam
from amp_fx.testing import assert_close_normwise, tolerances
from tests.training.distributed_launch import file_store_process_group, run_ranks, save_rank_result

pytest.importorskip("transformers")

WORLD_SIZE = 2
STEPS = 3
TIMEOUT_S = 150


def _training():
    from tests.models.hf import MODELS

    torch.manual_seed(0)
    model, inputs = MODELS["gpt2"]()
    converted = amp_fx.convert(model.eval(), "O2", dtype=torch.bfloat16)
    torch.manual_seed(1)
    batches = [inputs(4, 8) for _ in range(STEPS)]
    return converted, FusedAdam(converted.parameters(), lr=1e-2), batches


def _half(batch: dict, rank: int) -> dict:
    return {k: v[rank * 2 : rank * 2 + 2] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with file_store_process_group("gloo", rank, WORLD_SIZE, out_dir):
        model, optimizer, batches = _training()
        ddp = DistributedDataParallel(model)
        for batch in batches:
            optimizer.zero_grad()
            ddp(**_half(batch, rank)).loss.backward()
            optimizer.step()
        save_rank_result({n: p.detach().float() for n, p in model.named_parameters()}, out_dir, rank)


def test_ddp_ranks_agree_and_match_one_process(tmp_path: Path) -> None:
    ranks = run_ranks(_worker, tmp_path, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S)
    model, optimizer, batches = _training()
    assert isinstance(model, CapturedModel)
    for batch in batches:
        optimizer.zero_grad()
        # DDP averages the two halves' gradients: the mean of the halves' losses here.
        sum(model(**_half(batch, r)).loss for r in range(WORLD_SIZE)).div(WORLD_SIZE).backward()
        optimizer.step()
    rtol, atol = tolerances(torch.bfloat16)
    for name, param in model.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert_close_normwise(ranks[0][name], param.detach().float(), rtol=rtol, atol=atol, name=name)
