"""FSDP2 over models of the torch.export front end (Hugging Face GPT-2, Llama, T5), gloo, two ranks.

Each model is converted at O2 (bf16), sharded with `fully_shard_converted` (one group per block,
found from ``_no_split_modules``; the norms kept FP32, all blocks', one group of their own) and
trained with FusedAdam and LossScaler on halves of a global batch, called as Hugging Face documents
(``model(input_ids=ids, labels=ids)``). One spawn of two processes runs every scenario:

- the gathered FP32 shards equal one process's masters after training on the whole batch;
- the FP32 shards are the masters: per rank, half the optimizer state of one process;
- parameters are gathered per block: at every group's forward pre-hook the gathered parameter
  bytes are at most the root group's plus one block's plus all FP32 norms' (one group, gathered
  for the whole step: tiny), less than the whole model's;
- an inf written into rank 0's local grad shard after training skips the step on both ranks;
- a DCP checkpoint: resuming on two ranks is bit-identical to not stopping.

GPT-2's training and overflow run in a spawn of its own on every test run; Llama, T5 and the
resume share a second spawn, marked slow (a minute and more on a busy CPU).

The halves and the whole batch must see the same function: a model holding dropout runs in eval
mode, one without (Llama) in training mode, as training captures it (its untied head fused with
its loss, the head an FSDP2 group of its own).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import amp_fx
from amp_fx.capture.sharding import sharded_modules
from amp_fx.capture.state import capture_states
from amp_fx.ops.module_call import ModuleCall
from amp_fx.optim import master_params
from amp_fx.testing import assert_close_normwise, tolerances
from amp_fx.training.distributed import local_tensor
from amp_fx.training.fsdp import (
    fully_shard_converted,
    gathered_parameter_bytes,
    load_checkpoint,
    mixed_precision_policies,
    save_checkpoint,
)
from amp_fx.training.fsdp_groups import block_names, shard_units
from tests.training.distributed_launch import file_store_process_group, run_ranks, save_rank_result
from tests.training.test_fsdp import full_weights, make_scaler, state_bytes

pytest.importorskip("transformers")

WORLD_SIZE = 2
SLOW_MODELS = ("llama", "t5")
# GPT-2 (training, overflow) on every run; Llama, T5 (encoder-decoder) and resume in a slow spawn.
MODELS = [
    "gpt2",
    *[pytest.param(name, marks=pytest.mark.slow) for name in SLOW_MODELS],
]
STEPS = 3
BATCH, LENGTH = 4, 8
TIMEOUT_S = 240


def make_model(name: str) -> torch.nn.Module:
    from tests.models.hf import MODELS as BUILDERS  # noqa: N811

    torch.manual_seed(0)
    model, _ = BUILDERS[name]()
    random = any(isinstance(module, nn.Dropout) and module.p > 0 for module in model.modules())
    return amp_fx.convert(model.train(not random), "O2", dtype=torch.bfloat16)


def batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (BATCH, LENGTH), generator=generator) for _ in range(steps)]


def train(model, optimizer, scaler, ids_list, rank: int | None) -> None:
    for ids in ids_list:
        if rank is not None:
            ids = ids.chunk(WORLD_SIZE)[rank]
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        assert type(loss) is torch.Tensor
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


def sharded(name: str):
    model = fully_shard_converted(make_model(name))
    return model, amp_fx.optim.FusedAdam(model.parameters(), lr=1e-2), make_scaler()


def count_gathered_bytes(model) -> list[int]:
    """Gathered parameter bytes at each group's forward pre-hook (after FSDP2's, which gathers)."""
    seen: list[int] = []
    for group in sharded_modules(model).values():
        group.register_forward_pre_hook(lambda *_: seen.append(gathered_parameter_bytes(model)))
    return seen


def region_calls(model: nn.Module) -> list[str]:
    """Names of the modules the regions of ``model``'s graph call, nested regions included."""
    names = {id(module): name for name, module in model.named_modules()}
    (graph,) = capture_states(model)[0][1].graphs
    return [names[id(m.__dict__["target"])] for m in graph.modules() if isinstance(m, ModuleCall)]


def step_with_an_inf_in_rank_0s_shard(model, optimizer, scaler, rank: int) -> dict:
    """One step whose backward is finite but rank 0 then writes an inf into its local grad shard
    (after FSDP2's reduce-scatter): every rank must skip it and back off the same scale."""
    ids = batches(1, seed=3)[0].chunk(WORLD_SIZE)[rank]
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(model(input_ids=ids, labels=ids).loss).backward()
    before, scale = full_weights(model), scaler.get_scale()
    if rank == 0:
        with torch.no_grad():
            local_tensor(next(iter(model.parameters())).grad).view(-1)[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(a, b) for a, b in zip(full_weights(model), before, strict=True))
    return {"injected_unchanged": unchanged, "scale_before": scale, "injected_scale": scaler.get_scale()}


def sharded_training_results(name: str, rank: int) -> dict:
    model, optimizer, scaler = sharded(name)
    seen = count_gathered_bytes(model)
    first, *rest = batches(STEPS)
    train(model, optimizer, scaler, [first], rank)
    seen.clear()  # the first call's capture ran the hooks on fake tensors
    train(model, optimizer, scaler, rest, rank)
    results = {
        "weights": full_weights(model),
        "scale": scaler.get_scale(),
        "state_bytes": state_bytes(optimizer),
        "peak_gathered": max(seen),
        "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "islands": [name for name, state in capture_states(model) if state.islands],
        "region_calls": region_calls(model),
        "groups": sorted(sharded_modules(model)),
        "fsdp_states": len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)}),
    }
    return results | step_with_an_inf_in_rank_0s_shard(model, optimizer, scaler, rank)


def overflow_and_resume(rank: int, out_dir: str, out: dict) -> None:
    model, optimizer, scaler = sharded("gpt2")
    # A skipped step first: the checkpoint then holds a backed-off scale.
    step_with_an_inf_in_rank_0s_shard(model, optimizer, scaler, rank)
    train(model, optimizer, scaler, batches(2), rank)
    checkpoint = Path(out_dir, "checkpoint")
    save_checkpoint(checkpoint, model, optimizer, scaler)
    train(model, optimizer, scaler, batches(2, seed=2), rank)
    uninterrupted = [local_tensor(p).detach().clone() for p in model.parameters()]
    model, optimizer, scaler = sharded("gpt2")
    load_checkpoint(checkpoint, model, optimizer, scaler)
    train(model, optimizer, scaler, batches(2, seed=2), rank)
    resumed = [local_tensor(p).detach() for p in model.parameters()]
    out["resumed_bit_identical"] = all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))
    out["uninterrupted"] = full_weights(model)

    # Rank 0 alone resumes the two-rank checkpoint: DCP re-cuts the shards (every rank makes the group).
    alone = dist.new_group([0])
    if rank == 0:
        model = fully_shard_converted(make_model("gpt2"), mesh=DeviceMesh.from_group(alone, "cpu"))
        optimizer, scaler = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-2), make_scaler(alone)
        load_checkpoint(checkpoint, model, optimizer, scaler, process_group=alone)
        train(model, optimizer, scaler, batches(2, seed=2), rank=None)
        out["resumed_on_one_rank"] = [local_tensor(p).detach().clone() for p in model.parameters()]
    dist.barrier()


def worker(rank: int, models: tuple[str, ...], overflow_resume: bool, out_dir: str) -> None:
    torch.set_num_threads(1)
    with file_store_process_group("gloo", rank, WORLD_SIZE, out_dir):
        out: dict[str, object] = {name: sharded_training_results(name, rank) for name in models}
        if overflow_resume:
            overflow_and_resume(rank, out_dir, out)
        save_rank_result(out, out_dir, rank)


@pytest.fixture(scope="module")
def gpt2_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("fsdp_export_gpt2")
    return run_ranks(worker, out_dir, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S, args=(("gpt2",), False))


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("fsdp_export_more")
    return run_ranks(worker, out_dir, world_size=WORLD_SIZE, timeout_s=TIMEOUT_S, args=(SLOW_MODELS, True))


@pytest.fixture
def results(request: pytest.FixtureRequest, name: str) -> list[dict]:
    return request.getfixturevalue("gpt2_results" if name == "gpt2" else "slow_results")


@functools.cache
def single_process(name: str):
    model = make_model(name)
    optimizer, scaler = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-2), make_scaler()
    train(model, optimizer, scaler, batches(STEPS), rank=None)
    return model, optimizer, scaler


@pytest.mark.parametrize("name", MODELS)
def test_sharded_training_matches_one_process(results: list[dict], name: str) -> None:
    _, optimizer, scaler = single_process(name)
    rtol, atol = tolerances(torch.bfloat16)
    for rank_result in (r[name] for r in results):
        assert rank_result["all_dtensors"] and rank_result["scale"] == scaler.get_scale()
        for i, (actual, expected) in enumerate(
            zip(rank_result["weights"], master_params(optimizer), strict=True)
        ):
            assert actual.dtype == torch.float32
            assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name=f"{name} parameter {i}")


@pytest.mark.parametrize("name", MODELS)
def test_the_captured_graph_calls_each_group_once(results: list[dict], name: str) -> None:
    for rank_result in (r[name] for r in results):
        assert rank_result["islands"] == []  # the whole call ran rewritten graphs
        assert sorted(rank_result["region_calls"]) == rank_result["groups"]


@pytest.mark.parametrize("name", MODELS)
def test_fp32_shards_are_the_masters_half_the_state_per_rank(results: list[dict], name: str) -> None:
    _, optimizer, _ = single_process(name)
    per_rank = [r[name]["state_bytes"] for r in results]
    assert sum(per_rank) == state_bytes(optimizer)  # nothing held twice: no second FP32 copy
    for held in per_rank:
        assert held / state_bytes(optimizer) == pytest.approx(1 / WORLD_SIZE, abs=0.03)


def _gathered_sizes(name: str) -> tuple[int, int, int, int]:
    """(root group, largest block, all FP32 norms, whole model) bytes in the gather dtypes."""
    model = make_model(name)  # O2-stored: each parameter in the dtype FSDP2 gathers it in
    blocks = block_names(model)
    policies = mixed_precision_policies(model)
    split_off = [g for g, p in policies.items() if g and g not in blocks and p.param_dtype is None]
    sizes = {g: sum(p.nbytes for p in model.get_submodule(g).parameters()) for g in blocks}
    norms = sum(p.nbytes for g in split_off for p in model.get_submodule(g).parameters())
    whole = sum(p.nbytes for p in model.parameters())
    return whole - sum(sizes.values()), max(sizes.values()), norms, whole


@pytest.mark.parametrize("name", MODELS)
def test_forward_gathers_one_block_at_a_time(results: list[dict], name: str) -> None:
    root, block, norms, whole = _gathered_sizes(name)
    assert norms < block / 10  # the FP32 norms' group, gathered for the whole step, is tiny
    for rank_result in (r[name] for r in results):
        assert rank_result["peak_gathered"] <= root + block + norms
        assert rank_result["peak_gathered"] < whole


@pytest.mark.parametrize("name", MODELS)
def test_the_fp32_norms_of_all_blocks_are_one_group(results: list[dict], name: str) -> None:
    model = make_model(name)
    blocks, units = block_names(model), shard_units(model)
    norms = units[0]  # the parts split off in FP32: every block's norms (and perhaps the final one)
    assert all(mixed_precision_policies(model)[n].param_dtype is None for n in norms)
    assert all(any(n.startswith(f"{block}.") for n in norms) for block in blocks)
    assert [unit for unit in units if len(unit) > 1] == [norms]
    for rank_result in (r[name] for r in results):
        # One FSDP2 state per call: the norms', each block's, the root's (and an untied head's).
        assert rank_result["fsdp_states"] == len(units) < len(rank_result["groups"]) + 1


@pytest.mark.parametrize("name", MODELS)
def test_an_inf_in_one_ranks_shard_skips_the_step_on_all_ranks(results: list[dict], name: str) -> None:
    assert [r[name]["injected_unchanged"] for r in results] == [True] * WORLD_SIZE
    assert [r[name]["injected_scale"] for r in results] == [r[name]["scale_before"] / 2 for r in results]
    assert len({r[name]["injected_scale"] for r in results}) == 1


@pytest.mark.slow
def test_resume_is_bit_identical(slow_results: list[dict]) -> None:
    assert [r["resumed_bit_identical"] for r in slow_results] == [True, True]


@pytest.mark.slow
def test_resume_on_one_rank_matches_two(slow_results: list[dict]) -> None:
    rtol, atol = tolerances(torch.bfloat16)
    pairs = zip(slow_results[0]["resumed_on_one_rank"], slow_results[0]["uninterrupted"], strict=True)
    for i, (actual, expected) in enumerate(pairs):
        assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name=f"parameter {i}")


def test_blocks_are_found_and_fp32_norms_are_split_off_them() -> None:
    policies = mixed_precision_policies(make_model("gpt2"))
    blocks = {f"transformer.h.{i}": torch.bfloat16 for i in range(2)}
    norms = {f"transformer.h.{i}.{norm}": None for i in range(2) for norm in ("ln_1", "ln_2")}
    # The root group: embeddings (tied to the head) and the final norm, FP32 at O2.
    assert {name: p.param_dtype for name, p in policies.items()} == {**norms, **blocks, "": None}
    assert all(p.reduce_dtype == torch.float32 and not p.cast_forward_inputs for p in policies.values())


def test_a_model_without_blocks_is_refused_before_anything_changes() -> None:
    model = amp_fx.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)), "O2", front_end="export")
    with pytest.raises(ValueError, match="found no transformer blocks .* block_types="):
        fully_shard_converted(model)
    assert model[0].weight.dtype == torch.float16 and not isinstance(model[0].weight, DTensor)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_gradient_checkpointing_is_refused_before_anything_changes() -> None:
    model = make_model("gpt2")
    model.gradient_checkpointing_enable()
    with pytest.raises(TypeError, match="gradient_checkpointing_disable"):
        fully_shard_converted(model)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


class _Blocks(nn.Module):
    """Two blocks; the graph adds to the first block's output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks[0](x)
        y.add_(1)
        return self.blocks[1](y)


def test_regions_run_through_their_modules_hooks_and_in_place_updates_see_copies() -> None:
    from amp_fx.capture.export import export_graph
    from amp_fx.passes.shard_regions import shard_regions

    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(3, 4)
    gm = shard_regions(
        export_graph(model, (x,), {}), model, {f"blocks.{i}": block for i, block in enumerate(model.blocks)}
    )
    calls = []
    for name, block in model.blocks.named_children():
        block.register_forward_pre_hook(lambda module, args, name=name: calls.append(name))
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    assert calls == ["0", "1", "0", "1"]  # the graph's calls, then the eager model's
    (first_region,) = [m.region for n, m in gm.named_children() if n == "block_0"]
    (output,) = first_region.graph.find_nodes(op="output")
    assert output.args[0].target is torch.ops.aten.clone.default  # updated in place after the call


@pytest.mark.gpu
def test_on_one_gpu_the_sharded_code_path_matches_the_unsharded_model(tmp_path: Path) -> None:
    """A mesh of one on CUDA (NCCL): the gathers are copies, so the sharded model computes the
    unsharded one's losses exactly, and its FP32 shards track the unsharded masters."""
    device = torch.device("cuda", torch.cuda.current_device())  # NCCL asks for an index
    dist.init_process_group(
        "nccl", init_method=Path(tmp_path, "store").as_uri(), rank=0, world_size=1, device_id=device
    )
    try:
        reference = make_model("gpt2").to(device)
        model = fully_shard_converted(make_model("gpt2").to(device))
        losses = {}
        optimizers = {}
        for label, each in (("sharded", model), ("unsharded", reference)):
            optimizer = amp_fx.optim.FusedAdam(each.parameters(), lr=1e-2)
            optimizers[label] = optimizer
            losses[label] = []
            for ids in batches(STEPS):
                ids = ids.to(device)
                optimizer.zero_grad(set_to_none=True)
                loss = each(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                losses[label].append(loss.detach())
        assert torch.equal(losses["sharded"][0], losses["unsharded"][0])
        rtol, atol = tolerances(torch.bfloat16)
        pairs = zip(model.parameters(), master_params(optimizers["unsharded"]), strict=True)
        for i, (actual, expected) in enumerate(pairs):
            assert_close_normwise(actual.full_tensor(), expected, rtol=rtol, atol=atol, name=f"parameter {i}")
    finally:
        dist.destroy_process_group()
