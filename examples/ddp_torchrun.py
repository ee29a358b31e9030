"""Data-parallel mixed-precision training with amp_fx and DistributedDataParallel, launched by torchrun.

    torchrun --nproc_per_node=2 examples/ddp_torchrun.py              # GPUs with NCCL, or CPUs with gloo
    torchrun --nproc_per_node=8 examples/ddp_torchrun.py --dtype bf16 --steps 500

The recipe, in the order that matters:

1. ``amp_fx.convert`` the plain model first (convert refuses a model already wrapped in DDP), on
   the rank's device: O2 stores the weights in fp16/bf16, so DDP all-reduces half-size gradients.
2. Wrap the converted ``GraphModule`` in ``DistributedDataParallel``.
3. ``amp_fx.optim.FusedAdam`` keeps the FP32 master weights; ``amp_fx.LossScaler`` scales the loss.
   DDP's all-reduce spreads an inf/NaN in any rank's gradients to every rank, so every rank
   skips the same overflowing steps and the replicas stay identical, with no extra communication.
4. Clip with ``amp_fx.clip_grad_norm_(optimizer, ...)``, without ``scaler.unscale_``: the grads stay
   scaled, and the optimizer unscales and clips them in its kernel.

The data is synthetic (a random teacher network labels random inputs), so the program runs
anywhere; a ``DistributedSampler`` gives each rank its share of the global batch. Nothing in the
loop reads a device value except the loss logged every ``--log-every`` steps. At the end every
rank checks that its weights equal rank 0's, and rank 0 can save a checkpoint.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import amp_fx
from amp_fx.optim import master_params

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
    parser.add_argument("--opt-level", default="O2", choices=["O1", "O2", "O3"])
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    parser.add_argument(
        "--checkpoint", default=None, help="rank 0 saves model/optimizer/scaler here at the end"
    )
    return parser.parse_args()


def setup(device_kind: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; pick this rank's device."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "ddp_torchrun.py is launched by torchrun, which sets RANK and WORLD_SIZE for each process:\n"
            "    torchrun --nproc_per_node=2 examples/ddp_torchrun.py"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # device_id binds NCCL to this rank's GPU eagerly (and silences a warning); gloo ignores it.
    dist.init_process_group(
        backend, timeout=datetime.timedelta(minutes=5), device_id=device if device.type == "cuda" else None
    )
    return rank, world_size, device


def replicas_identical(optimizer: torch.optim.Optimizer) -> bool:
    """True when every rank's FP32 masters equal rank 0's (one broadcast per tensor)."""
    mismatch = torch.zeros(1, device=optimizer.param_groups[0]["params"][0].device)
    for master in master_params(optimizer):
        theirs = master.detach().clone()
        dist.broadcast(theirs, src=0)
        mismatch += (theirs != master).sum()
    dist.all_reduce(mismatch)
    return mismatch.item() == 0


def main() -> None:
    args = parse_args()
    device_kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world_size, device = setup(device_kind)
    if args.global_batch_size % world_size:
        raise SystemExit(
            f"--global-batch-size {args.global_batch_size} is not divisible by {world_size} ranks"
        )
    dtype = DTYPES[args.dtype]

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = ResidualMLP(features=64, hidden=128, classes=10, blocks=4).to(device)
    model = amp_fx.convert(model, args.opt_level, dtype=dtype)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = amp_fx.optim.FusedAdam(ddp_model.parameters(), lr=args.lr, weight_decay=0.01)
    # bf16 has fp32's range: no loss scaling. O3 trains without one, as Apex's O3 does.
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16 and args.opt_level != "O3")

    dataset = synthetic_dataset(samples=64 * args.global_batch_size, features=64, classes=10)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(
        dataset, batch_size=args.global_batch_size // world_size, sampler=sampler, drop_last=True
    )

    step, epoch = 0, 0
    running_loss = torch.zeros((), device=device)
    while step < args.steps:
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        for inputs, labels in loader:
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp_model(inputs), labels)
            scaler.scale(loss).backward()  # DDP all-reduces the (scaled, fp16) grads here
            amp_fx.clip_grad_norm_(optimizer, args.max_grad_norm)  # overflow checked, agreed by all ranks
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

    identical = replicas_identical(optimizer)
    if rank == 0:
        print(f"weights identical on {world_size} ranks: {identical}", flush=True)
        if args.checkpoint:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                },
                args.checkpoint,
            )
            print(f"saved {args.checkpoint}")
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("the replicas diverged")


if __name__ == "__main__":
    main()
