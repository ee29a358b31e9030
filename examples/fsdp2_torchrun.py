"""Sharded mixed-precision training with amp_fx and FSDP2 (``fully_shard``), launched by torchrun.

    torchrun --standalone --nproc_per_node=2 examples/fsdp2_torchrun.py           # GPUs: NCCL; CPUs: gloo
    torchrun --standalone --nproc_per_node=8 examples/fsdp2_torchrun.py --dtype bf16 --steps 500
    torchrun --standalone --nproc_per_node=2 examples/fsdp2_torchrun.py --checkpoint ckpt  # save, then resume

Run without torchrun (``python examples/fsdp2_torchrun.py``) it stops and prints the torchrun
command: each process needs RANK, WORLD_SIZE and a rendezvous address, which torchrun provides.

The recipe, in the order that matters (docs/DESIGN.md, "FSDP2"):

1. ``amp_fx.convert`` the plain model on the rank's device, at O1 or O2.
2. ``amp_fx.training.fsdp.fully_shard_converted(model)``: each rank keeps 1/world_size of every parameter,
   in FP32. These shards are the master weights. FSDP2 all-gathers them in the dtype the graph
   reads (fp16/bf16 for matmuls, FP32 for the norms O2 keeps FP32), and reduce-scatters the
   gradients in FP32.
3. ``amp_fx.optim.FusedAdam`` updates the FP32 shards in place (no second FP32 copy);
   ``amp_fx.LossScaler`` scales the loss and all-reduces its overflow flag, so every rank skips
   the same steps; ``amp_fx.clip_grad_norm_`` clips by the norm over all shards.
4. ``amp_fx.training.fsdp.save_checkpoint`` / ``load_checkpoint`` write and read the sharded state with
   torch.distributed.checkpoint; a checkpoint resumes on any number of ranks.

The data is synthetic (a random teacher labels random inputs), so the program runs anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import amp_fx
from amp_fx.training.fsdp import fully_shard_converted, load_checkpoint, save_checkpoint

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class ResidualMLP(nn.Module):
    """A small classifier: pre-LayerNorm residual MLP blocks."""

    def __init__(self, features: int, hidden: int, classes: int, blocks: int) -> None:
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


def synthetic_dataset(samples: int, features: int, classes: int) -> TensorDataset:
    """Inputs labelled by a fixed random network: learnable, and the same on every rank."""
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, classes, generator=generator)
    return TensorDataset(inputs, (inputs @ teacher).argmax(dim=1))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch-size", type=int, default=256, help="summed over all ranks")
    parser.add_argument("--opt-level", default="O2", choices=["O1", "O2"])
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    parser.add_argument(
        "--checkpoint", default=None, help="a directory: resume from it if it exists, save to it at the end"
    )
    return parser.parse_args()


def setup(device_kind: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; pick this rank's device."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "fsdp2_torchrun.py is launched by torchrun, which sets RANK, WORLD_SIZE and the rendezvous "
            "address for each process:\n"
            "    torchrun --standalone --nproc_per_node=2 examples/fsdp2_torchrun.py"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(minutes=5),
        device_id=device if device.type == "cuda" else None,
    )
    return rank, world_size, device


def main() -> None:
    args = parse_args()
    device_kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world_size, device = setup(device_kind)
    if args.global_batch_size % world_size:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} is not divisible by {world_size} ranks"
        )
    dtype = DTYPES[args.dtype]

    torch.manual_seed(0)  # the same initial weights on every rank: each keeps its shard of them
    model = ResidualMLP(features=64, hidden=128, classes=10, blocks=4).to(device)
    model = fully_shard_converted(amp_fx.convert(model, args.opt_level, dtype=dtype))
    optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16)  # bf16 has fp32's range: no scaling
    if args.checkpoint and Path(args.checkpoint).exists():
        load_checkpoint(args.checkpoint, model, optimizer, scaler)
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {int(optimizer.param_groups[0]['step'].item())}")

    dataset = synthetic_dataset(samples=64 * args.global_batch_size, features=64, classes=10)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(
        dataset, batch_size=args.global_batch_size // world_size, sampler=sampler, drop_last=True
    )

    step, epoch = 0, 0
    running_loss = torch.zeros((), device=device)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs), labels)
            scaler.scale(loss).backward()  # FSDP2 reduce-scatters the grads onto the FP32 shards
            # Overflow flag all-reduced (one decision for all ranks); the norm over all shards.
            amp_fx.clip_grad_norm_(optimizer, args.max_grad_norm)
            scaler.step(optimizer)
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

    held = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"rank 0 holds {held} of {total} FP32 parameters (sharded over {world_size} ranks)", flush=True)
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, optimizer, scaler)
        if rank == 0:
            print(f"saved {args.checkpoint}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
