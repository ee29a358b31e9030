"""FSDP2 (fully_shard) over a converted model: sharded FP32 masters, fused optimizers, LossScaler.

Two gloo processes train on halves of a global batch and are compared with one process training
the ordinary (unsharded) recipe on the whole batch: convert, FusedAdam/FusedSGD with FP32 masters,
LossScaler, amp_fx.clip_grad_norm_. Scenarios, all in one spawn of two processes (starting Python
and torch dominates the cost):

- O1 and O2, fp16 and bf16, FusedAdam and FusedSGD: the gathered FP32 shards equal the single
  process's masters within tolerance, the clip norms its norms, the step counts and scales agree
  (an inf in rank 1's half at OVERFLOW_STEP skips that step, as in the single process);
- an inf written into rank 0's local grad shard after backward (after the reduce-scatter, seen by
  rank 0 only) skips the step on both ranks: LossScaler all-reduces its overflow flags;
- a checkpoint through torch.distributed.checkpoint: resuming on two ranks is bit-identical to
  not stopping; resuming on one rank (a process group of rank 0 alone) matches within tolerance;
- the optimizer state per rank (FP32 shards + moments) is half of what each DDP rank holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import amp_fx
from amp_fx.optim import master_params
from amp_fx.testing import assert_close_normwise, tolerances
from amp_fx.training.distributed import local_tensor
from amp_fx.training.fsdp import (
    fully_shard_converted,
    load_checkpoint,
    mixed_precision_policies,
    save_checkpoint,
)
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
STEPS = 5
OVERFLOW_STEP = 2  # rank 1's half of this batch holds an inf
MAX_NORM = 0.5  # below the first steps' norms: clipping is active
RESUME_STEPS = 2
TIMEOUT_S = 150
# (opt level, dtype, optimizer): both levels, both dtypes, both fused optimizers.
CASES = [
    ("O2", torch.float16, "FusedAdam"),
    ("O2", torch.bfloat16, "FusedSGD"),
    ("O1", torch.float16, "FusedSGD"),
    ("O1", torch.bfloat16, "FusedAdam"),
]


def case_name(case: tuple[str, torch.dtype, str]) -> str:
    level, dtype, optimizer = case
    return f"{level}-{str(dtype).removeprefix('torch.')}-{optimizer}"


def make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "FusedAdam":
        return amp_fx.optim.FusedAdam(params, lr=1e-2, weight_decay=0.01)
    return amp_fx.optim.FusedSGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def make_scaler(process_group: object = None) -> amp_fx.LossScaler:
    return amp_fx.LossScaler(init_scale=2.0**10, growth_interval=2, process_group=process_group)


def global_batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        inputs = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=generator)
        targets = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator)
        if step == OVERFLOW_STEP and seed == 1:
            inputs[GLOBAL_BATCH - 1, 0] = float("inf")
        batches.append((inputs, targets))
    return batches


def train(model, optimizer, scaler, batches, rank: int | None, world_size: int = WORLD_SIZE) -> list[float]:
    """The recipe's loop on ``batches`` (rank None: the whole batch); the clip norms per step."""
    norms = []
    for inputs, targets in batches:
        if rank is not None:
            inputs, targets = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(model(inputs), targets)).backward()
        scaler.unscale_(optimizer)
        norms.append(amp_fx.clip_grad_norm_(optimizer, MAX_NORM).item())
        scaler.step(optimizer)
        scaler.update()
    return norms


def sharded_training(case, mesh=None, process_group=None):
    level, dtype, optimizer_name = case
    model = fully_shard_converted(amp_fx.convert(make_model(), level, dtype=dtype), mesh=mesh)
    return model, make_optimizer(optimizer_name, model.parameters()), make_scaler(process_group)


def full_weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # a collective


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of optimizer state (masters, moments) and of FP32 params (their own masters).

    Not the step offsets: one 4-byte count per parameter that every rank keeps whole, as torch.optim
    keeps ``state[p]["step"]``; sharded state is what must halve."""
    state = [
        t
        for s in optimizer.state.values()
        for key, t in s.items()
        if isinstance(t, torch.Tensor) and key != "step_offset"
    ]
    params = [p for group in optimizer.param_groups for p in group["params"] if p.dtype == torch.float32]
    return sum(local_tensor(t).nbytes for t in state + params)


def checkpoint_scenario(rank: int, out_dir: str, out: dict) -> None:
    case = CASES[0]
    model, optimizer, scaler = sharded_training(case)
    train(model, optimizer, scaler, global_batches(STEPS), rank)
    checkpoint = Path(out_dir, "checkpoint")
    save_checkpoint(checkpoint, model, optimizer, scaler)
    resume_batches = global_batches(RESUME_STEPS, seed=2)
    train(model, optimizer, scaler, resume_batches, rank)
    uninterrupted = [local_tensor(p).detach().clone() for p in model.parameters()]
    out["uninterrupted"] = full_weights(model)
    out["uninterrupted_scale"] = scaler.get_scale()

    model, optimizer, scaler = sharded_training(case)
    load_checkpoint(checkpoint, model, optimizer, scaler)
    train(model, optimizer, scaler, resume_batches, rank)
    resumed = [local_tensor(p).detach() for p in model.parameters()]
    out["resumed_bit_identical"] = all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))
    out["resumed_scale"] = scaler.get_scale()

    # Rank 0 alone resumes the two-rank checkpoint (every rank takes part in creating the group).
    alone = dist.new_group([0])
    if rank == 0:
        mesh = DeviceMesh.from_group(alone, "cpu")
        model, optimizer, scaler = sharded_training(case, mesh=mesh, process_group=alone)
        load_checkpoint(checkpoint, model, optimizer, scaler, process_group=alone)
        train(model, optimizer, scaler, resume_batches, rank=0, world_size=1)
        out["resumed_on_one_rank"] = [local_tensor(p).detach().clone() for p in model.parameters()]
    dist.barrier()


def inject_inf_after_backward(rank: int, out: dict) -> None:
    model, optimizer, scaler = sharded_training(CASES[0])
    inputs, targets = global_batches(1, seed=2)[0]
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs.chunk(WORLD_SIZE)[rank]), targets.chunk(WORLD_SIZE)[rank])
    scaler.scale(loss).backward()  # the reduce-scatter has run: each rank holds its grad shard
    before = full_weights(model)
    if rank == 0:
        with torch.no_grad():
            local_tensor(next(iter(model.parameters())).grad).view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    after = full_weights(model)
    out["injected_unchanged"] = all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    out["injected_scale"] = scaler.get_scale()


def worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with file_store_process_group("gloo", rank, WORLD_SIZE, out_dir):
        out: dict[str, object] = {}
        for case in CASES:
            model, optimizer, scaler = sharded_training(case)
            norms = train(model, optimizer, scaler, global_batches(STEPS), rank)
            out[case_name(case)] = {
                "weights": full_weights(model),
                "norms": norms,
                "scale": scaler.get_scale(),
                "state_bytes": state_bytes(optimizer),
            }
        inject_inf_after_backward(rank, out)
        checkpoint_scenario(rank, out_dir, out)
        save_rank_result(out, out_dir, rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("fsdp_gloo")
    return run_ranks(worker, out_dir, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S)


def single_process(case, batches=None):
    level, dtype, optimizer_name = case
    model = amp_fx.convert(make_model(), level, dtype=dtype)
    optimizer, scaler = make_optimizer(optimizer_name, model.parameters()), make_scaler()
    norms = train(model, optimizer, scaler, batches or global_batches(STEPS), rank=None)
    return model, optimizer, scaler, norms


@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_sharded_training_matches_a_single_process(results: list[dict], case) -> None:
    _, optimizer, scaler, reference_norms = single_process(case)
    rtol, atol = tolerances(case[1])
    sharded = [r[case_name(case)] for r in results]
    assert sharded[0]["scale"] == sharded[1]["scale"] == scaler.get_scale()
    for rank_result in sharded:
        for i, (actual, expected) in enumerate(
            zip(rank_result["weights"], master_params(optimizer), strict=True)
        ):
            assert actual.dtype == torch.float32
            assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name=f"parameter {i}")
    for step, (actual, expected) in enumerate(zip(sharded[0]["norms"], reference_norms, strict=True)):
        if step == OVERFLOW_STEP:
            assert not torch.isfinite(torch.tensor([actual, expected])).any()
        else:
            assert actual == pytest.approx(expected, rel=rtol, abs=atol), f"clip norm at step {step}"
    assert max(reference_norms[:OVERFLOW_STEP]) > MAX_NORM, "the test should exercise clipping"


def test_an_inf_in_one_ranks_shard_skips_the_step_on_all_ranks(results: list[dict]) -> None:
    assert [r["injected_unchanged"] for r in results] == [True, True]
    assert results[0]["injected_scale"] == results[1]["injected_scale"] == 2.0**9


def test_resume_on_the_same_ranks_is_bit_identical(results: list[dict]) -> None:
    assert [r["resumed_bit_identical"] for r in results] == [True, True]
    assert results[0]["resumed_scale"] == results[0]["uninterrupted_scale"]


def test_resume_on_one_rank_matches_two(results: list[dict]) -> None:
    rtol, atol = tolerances(CASES[0][1])
    for i, (actual, expected) in enumerate(
        zip(results[0]["resumed_on_one_rank"], results[0]["uninterrupted"], strict=True)
    ):
        assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name=f"parameter {i}")


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=case_name)
def test_optimizer_state_per_rank_is_half_of_ddps(results: list[dict], case) -> None:
    _, optimizer, _, _ = single_process(case)  # what each DDP rank holds
    per_rank = [r[case_name(case)]["state_bytes"] for r in results]
    assert sum(per_rank) == state_bytes(optimizer)  # nothing held twice
    for held in per_rank:
        assert held / state_bytes(optimizer) == pytest.approx(1 / WORLD_SIZE, abs=0.02)


def test_policies_gather_low_weights_and_keep_norms_fp32() -> None:
    gm = amp_fx.convert(make_model(), "O2", dtype=torch.bfloat16)
    policies = mixed_precision_policies(gm)
    assert {name: p.param_dtype for name, p in policies.items()} == {
        "0": torch.bfloat16,
        "3": torch.bfloat16,
        "5": torch.bfloat16,
        "": None,  # with the LayerNorm's parameters, FP32 at O2: fuse_norms' call reads them
    }
    assert gm.get_parameter("1.weight").dtype == torch.float32
    assert all(p.reduce_dtype == torch.float32 and not p.cast_forward_inputs for p in policies.values())
    o1 = mixed_precision_policies(amp_fx.convert(make_model(), "O1", dtype=torch.float16))
    # O1: the graph casts the Linear weights itself; they are gathered low, the LayerNorm in FP32.
    assert {name: p.param_dtype for name, p in o1.items()} == {"1": None, "": torch.float16}


def test_fully_shard_converted_refuses_a_model_amp_fx_did_not_convert() -> None:
    with pytest.raises(TypeError, match="needs a GraphModule from amp_fx.convert"):
        fully_shard_converted(make_model())
