"""FSDP2 over a causal LM of the torch.export front end whose head is not tied to its embedding.

At O2 in training the head and its loss are one fused op (`fuse_chunked_linear_loss`), and the
untied head is an FSDP2 group of its own (stored bf16 next to the root's FP32 embedding and
norm), so the fused op must run inside the head's call, where FSDP2 gathers the head's weight.
Two gloo ranks train on halves of a batch and are compared with one process on the whole batch:
the gathered FP32 shards, the head's included, equal the single process's masters. The model is
a tiny one of plain torch modules (its loss written as Hugging Face's ``ForCausalLMLoss``), so
the spawned ranks import no transformers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.capture.state import capture_states
from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy
from amp_fx.ops.module_call import ModuleCall
from amp_fx.optim import master_params
from amp_fx.testing import assert_close_normwise, tolerances
from amp_fx.training.fsdp import fully_shard_converted
from tests.training.distributed_launch import file_store_process_group, run_ranks, save_rank_result
from tests.training.test_fsdp import full_weights

WORLD_SIZE = 2
VOCAB, WIDTH, BATCH, LENGTH = 64, 16, 4, 8
STEPS = 2
TIMEOUT_S = 120


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x))


class UntiedLm(nn.Module):
    """Embedding, two blocks, a final norm and a head of its own; the loss as Hugging Face's:
    labels shifted with -100, the logits upcast and viewed as rows of VOCAB classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)[:, 0:, :])  # the positions kept, as Hugging Face's heads read
        targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        return loss, logits


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return amp_fx.convert(UntiedLm().train(), "O2", dtype=torch.bfloat16, front_end="export")


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator) for _ in range(STEPS)]


def train(model: nn.Module, rank: int | None) -> torch.optim.Optimizer:
    optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-2)
    for ids in batches():
        if rank is not None:
            ids = ids.chunk(WORLD_SIZE)[rank]
        optimizer.zero_grad(set_to_none=True)
        loss, logits = model(ids, ids)
        assert type(loss) is torch.Tensor and logits is None  # the head was fused with its loss
        loss.backward()
        optimizer.step()
    return optimizer


def region_functions(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(module name, the functions its region calls) of each region of the captured graph."""
    names = {id(module): name for name, module in model.named_modules()}
    (graph,) = capture_states(model)[0][1].graphs
    return [
        (
            names[id(call.__dict__["target"])],
            [
                getattr(n.target, "__name__", str(n.target))
                for n in call.region.graph.nodes
                if n.op == "call_function"
            ],
        )
        for call in graph.modules()
        if isinstance(call, ModuleCall)
    ]


def worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    with file_store_process_group("gloo", rank, WORLD_SIZE, out_dir):
        model = fully_shard_converted(make_model())
        train(model, rank)
        result = {"weights": full_weights(model), "regions": region_functions(model)}
        save_rank_result(result, out_dir, rank)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(worker, tmp_path_factory.mktemp("fsdp_head"), world_size=WORLD_SIZE, timeout_s=TIMEOUT_S)


def test_the_fused_head_and_loss_run_in_the_heads_call(results: list[dict]) -> None:
    fused = chunked_linear_cross_entropy.__name__
    for result in results:
        # The untied head is a group of its own, called once (one gather), computing the fused op.
        (head,) = [functions for name, functions in result["regions"] if name == "head"]
        assert fused in head
        assert not [name for name, functions in result["regions"] if name != "head" and fused in functions]


def test_sharded_training_of_an_untied_head_matches_one_process(results: list[dict]) -> None:
    model = make_model()
    names = [name for name, _ in model.named_parameters()]
    optimizer = train(model, rank=None)
    rtol, atol = tolerances(torch.bfloat16)
    for result in results:
        pairs = zip(names, result["weights"], master_params(optimizer), strict=True)
        for name, actual, expected in pairs:
            assert actual.dtype == torch.float32
            assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name=name)
