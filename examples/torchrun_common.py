"""What the two torchrun examples share: the process group, the model and data, the arguments, the loop.

``ddp_torchrun.py`` and ``fsdp2_torchrun.py`` differ only in how they wrap the converted model
(DistributedDataParallel or FSDP2's ``fully_shard``) and in what they check and save at the end;
this module is the rest, imported by both (it is not a program of its own).

The data is synthetic (a random teacher network labels random inputs), so the programs run
anywhere; a ``DistributedSampler`` gives each rank its share of the global batch. Nothing in the
loop reads a device value except the loss logged every ``--log-every`` steps.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import amp_fx

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FEATURES, CLASSES = 64, 10


class ResidualMLP(nn.Module):
    """A small classifier: pre-LayerNorm residual MLP blocks."""

    def __init__(
        self, features: int = FEATURES, hidden: int = 128, classes: int = CLASSES, blocks: int = 4
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(blocks))
        self.fc1 = nn.ModuleList(nn.Linear(hidden, 4 * hidden) for _ in range(blocks))
        self.fc2 = nn.ModuleList(nn.Linear(4 * hidden, hidden) for _ in range(blocks))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for norm, fc1, fc2 in zip(self.norms, self.fc1, self.fc2, strict=True):
            x = x + fc2(F.gelu(fc1(norm(x))))
        return self.head(x)


def synthetic_dataset(samples: int, features: int = FEATURES, classes: int = CLASSES) -> TensorDataset:
    """Inputs labelled by a fixed random network: learnable, and the same on every rank."""
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def argument_parser(description: str, opt_levels: list[str], checkpoint_help: str) -> argparse.ArgumentParser:
    """The arguments of both examples; each names the opt levels it trains at and what --checkpoint does."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=256, help="summed over all ranks")
    parser.add_argument("--opt-level", default="O2", choices=opt_levels)
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    parser.add_argument("--checkpoint", default=None, help=checkpoint_help)
    return parser


def join_process_group(device_kind: str | None, launch_command: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; pick this rank's device
    (``device_kind`` "cuda" or "cpu"; None: cuda if available). Returns (rank, world size, device).
    Run without torchrun, stop and print ``launch_command``, the way to run it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        script = os.path.basename(launch_command.split()[-1])
        raise SystemExit(
            f"{script} is launched by torchrun, which sets RANK, WORLD_SIZE and the rendezvous address "
            f"for each process:\n    {launch_command}"
        )
    device_kind = device_kind or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # device_id binds NCCL to this rank's GPU eagerly (and silences a warning); gloo ignores it.
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(minutes=5),
        device_id=device if device.type == "cuda" else None,
    )
    return rank, world_size, device


def sharded_loader(global_batch_size: int, rank: int, world_size: int) -> DataLoader:
    """This rank's share of each global batch of the synthetic data (64 global batches an epoch)."""
    if global_batch_size % world_size:
        raise SystemExit(f"--global-batch-size {global_batch_size} is not divisible by {world_size} ranks")
    dataset = synthetic_dataset(samples=64 * global_batch_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=global_batch_size // world_size, sampler=sampler, drop_last=True)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: amp_fx.LossScaler,
    loader: DataLoader,
    args: argparse.Namespace,
    device: torch.device,
) -> None:
    """``args.steps`` steps of the amp_fx loop; rank 0 prints the loss averaged over all ranks every
    ``args.log_every`` steps. ``model`` is wrapped for data parallelism (DDP or FSDP2)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    step, epoch = 0, 0
    running_loss = torch.zeros((), device=device)
    while step < args.steps:
        loader.sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        for inputs, labels in loader:
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), labels)
            # DDP all-reduces the (scaled, fp16) grads here; FSDP2 reduce-scatters them onto the FP32 shards.
            scaler.scale(loss).backward()
            # No scaler.unscale_: the optimizer unscales and clips in its kernel. The overflow flag is
            # agreed by all ranks, and under FSDP2 the norm is the one over all shards.
            amp_fx.clip_grad_norm_(optimizer, args.max_grad_norm)
            scaler.step(optimizer)  # skipped on the device, on every rank alike, after an overflow
            scaler.update()
            running_loss += loss.detach()
            step += 1
            if step % args.log_every == 0 or step == args.steps:
                dist.all_reduce(running_loss)  # the only host syncs of the loop: logging
                steps_logged = args.log_every if step % args.log_every == 0 else step % args.log_every
                mean = running_loss.item() / (world_size * steps_logged)
                if rank == 0:
                    print(f"step {step:5d}  loss {mean:.4f}  loss scale {scaler.get_scale():g}", flush=True)
                running_loss.zero_()
            if step == args.steps:
                break
        epoch += 1
