"""A converted model in DistributedDataParallel with the fused optimizer and the LossScaler.

Two processes (gloo on CPU; NCCL on two GPUs in the `gpu` test) train an O2 fp16 model on halves
of a global batch and are compared with one process training on the whole batch:

- the ranks end bit-identical to each other and equal the single-process run within tolerance;
- an overflow in one rank's batch (inf in its inputs, so in its local grads) skips the step on
  every rank: DDP's all-reduce sums the grads, and inf/NaN on one rank makes the sum inf/NaN on all;
- an inf written into one rank's grads *after* backward (after DDP's all-reduce, e.g. by a grad
  hook or a post-processing bug) is seen by that rank only; LossScaler all-reduces its found_inf
  across the process group, so every rank skips that step and the ranks stay equal.

All scenarios run in one spawn of two processes (starting Python and torch dominates the cost).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import amp_fx
from amp_fx.optim import master_params
from amp_fx.testing import assert_close_normwise, tolerances
from tests.training.distributed_launch import (
    CLASSES,
    IN_FEATURES,
    file_store_process_group,
    make_model,
    run_ranks,
    save_rank_result,
)

WORLD_SIZE = 2
GLOBAL_BATCH = 8
STEPS = 6
OVERFLOW_STEP = 3  # the step at which rank 1's inputs carry an inf
DTYPE = torch.float16
TIMEOUT_S = 120
REPO_ROOT = Path(__file__).resolve().parents[2]


def global_batches(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches in every process; at OVERFLOW_STEP the half that rank 1 gets holds an inf."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for step in range(STEPS):
        inputs = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator)
        targets = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator)
        if step == OVERFLOW_STEP:
            inputs[GLOBAL_BATCH - 1, 0] = float("inf")
        batches.append((inputs.to(device), targets.to(device)))
    return batches


def local_half(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor.chunk(WORLD_SIZE)[rank]


def make_training(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, amp_fx.LossScaler]:
    model = amp_fx.convert(make_model().to(device), "O2", dtype=DTYPE)
    optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optimizer, amp_fx.LossScaler(init_scale=2.0**10, growth_interval=2)


def training_state(optimizer: torch.optim.Optimizer, scaler: amp_fx.LossScaler) -> dict[str, object]:
    return {
        "masters": [m.detach().cpu().clone() for m in master_params(optimizer)],
        "params": [p.detach().cpu().clone() for g in optimizer.param_groups for p in g["params"]],
        "step": optimizer.param_groups[0]["step"].item(),
        "scale": scaler.get_scale(),
    }


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: amp_fx.LossScaler,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int | None,
) -> list[float]:
    """Train on ``batches`` (rank None: the whole batch; else that rank's half); the losses per step."""
    losses = []
    for inputs, targets in batches:
        if rank is not None:
            inputs, targets = local_half(inputs, rank), local_half(targets, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses


def inject_inf_after_backward(rank: int, device: torch.device, out: dict[str, object]) -> None:
    """One clean step, but rank 0 writes an inf into one grad after DDP's all-reduce."""
    model, optimizer, scaler = make_training(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    inputs, targets = global_batches(device)[0]
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(ddp(local_half(inputs, rank)), local_half(targets, rank))
    scaler.scale(loss).backward()  # DDP's all-reduce has run when backward returns
    if rank == 0:
        with torch.no_grad():
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    out["after_backward"] = training_state(optimizer, scaler)


def worker(rank: int, backend: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with file_store_process_group(backend, rank, WORLD_SIZE, out_dir):
        out: dict[str, object] = {}
        model, optimizer, scaler = make_training(device)
        ddp = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
        out["losses"] = train(ddp, optimizer, scaler, global_batches(device), rank)
        out["trained"] = training_state(optimizer, scaler)
        inject_inf_after_backward(rank, device, out)
        save_rank_result(out, out_dir, rank)


def run_workers(backend: str, out_dir: Path) -> list[dict[str, object]]:
    """Each rank's results of `worker` on ``backend``."""
    return run_ranks(worker, out_dir, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S, args=(backend,))


def single_process_reference(device: torch.device) -> tuple[list[float], dict[str, object]]:
    model, optimizer, scaler = make_training(device)
    losses = train(model, optimizer, scaler, global_batches(device), rank=None)
    return losses, training_state(optimizer, scaler)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return run_workers("gloo", tmp_path_factory.mktemp("ddp_gloo"))


def check_ranks_agree_and_match_one_process(results: list[dict[str, object]], device: torch.device) -> None:
    reference_losses, reference = single_process_reference(device)
    first = results[0]["trained"]
    for rank, result in enumerate(results[1:], start=1):
        state = result["trained"]
        assert state["step"] == first["step"] and state["scale"] == first["scale"], rank
        for a, b in zip(state["masters"], first["masters"], strict=True):
            assert torch.equal(a, b), f"rank {rank}'s masters differ from rank 0's"
        for a, b in zip(state["params"], first["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}'s weights differ from rank 0's"
    # The overflow in rank 1's half skipped that step everywhere, as in the one-process run.
    assert first["step"] == reference["step"] == STEPS - 1
    assert first["scale"] == reference["scale"]
    rtol, atol = tolerances(DTYPE)
    for i, (actual, expected) in enumerate(zip(first["masters"], reference["masters"], strict=True)):
        assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name=f"master {i}")
    # The global loss is the mean of the ranks' losses (equal halves), except at the overflow.
    for step, expected in enumerate(reference_losses):
        mean = sum(r["losses"][step] for r in results) / WORLD_SIZE
        if step == OVERFLOW_STEP:
            assert not torch.isfinite(torch.tensor(mean)) and not torch.isfinite(torch.tensor(expected))
        else:
            assert mean == pytest.approx(expected, rel=rtol, abs=atol), step


def test_ddp_ranks_agree_and_match_a_single_process(gloo_results: list[dict[str, object]]) -> None:
    check_ranks_agree_and_match_one_process(gloo_results, torch.device("cpu"))


def test_inf_injected_after_backward_is_seen_by_its_rank(gloo_results: list[dict[str, object]]) -> None:
    assert gloo_results[0]["after_backward"]["step"] == 0, "rank 0 saw its own inf and must have skipped"


def test_inf_injected_after_backward_on_one_rank_skips_on_all(gloo_results: list[dict[str, object]]) -> None:
    states = [result["after_backward"] for result in gloo_results]
    assert [s["step"] for s in states] == [0] * WORLD_SIZE
    assert len({s["scale"] for s in states}) == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason="needs 2 CUDA devices")
def test_ddp_nccl_ranks_agree_and_match_a_single_process(tmp_path: Path) -> None:
    results = run_workers("nccl", tmp_path)
    check_ranks_agree_and_match_one_process(results, torch.device("cuda:0"))


@pytest.mark.slow
def test_torchrun_example_trains_on_two_cpu_processes(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",  # torchrun binds its rendezvous port itself: no free port to guess
        str(REPO_ROOT / "examples" / "ddp_torchrun.py"),
        "--steps",
        "4",
        "--device",
        "cpu",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "weights identical on 2 ranks" in done.stdout
