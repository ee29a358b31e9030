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
   the same steps; ``amp_fx.clip_grad_norm_`` clips by the norm over all shards (the loop:
   ``torchrun_common.train``).
4. ``amp_fx.training.fsdp.save_checkpoint`` / ``load_checkpoint`` write and read the sharded state with
   torch.distributed.checkpoint; a checkpoint resumes on any number of ranks.

The process group, the synthetic data (a random teacher labels random inputs, so the program
runs anywhere) and the training loop are the ones ``ddp_torchrun.py`` uses too, in
``torchrun_common.py`` next to this file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torchrun_common import DTYPES, ResidualMLP, argument_parser, join_process_group, sharded_loader, train

import amp_fx
from amp_fx.training.fsdp import fully_shard_converted, load_checkpoint, save_checkpoint

LAUNCH = "torchrun --standalone --nproc_per_node=2 examples/fsdp2_torchrun.py"


def main() -> None:
    parser = argument_parser(
        __doc__,
        ["O1", "O2"],
        checkpoint_help="a directory: resume from it if it exists, save to it at the end",
    )
    args = parser.parse_args()
    rank, world_size, device = join_process_group(args.device, LAUNCH)
    loader = sharded_loader(args.global_batch_size, rank, world_size)
    dtype = DTYPES[args.dtype]

    torch.manual_seed(0)  # the same initial weights on every rank: each keeps its shard of them
    model = fully_shard_converted(amp_fx.convert(ResidualMLP().to(device), args.opt_level, dtype=dtype))
    optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16)  # bf16 has fp32's range: no scaling
    if args.checkpoint and Path(args.checkpoint).exists():
        load_checkpoint(args.checkpoint, model, optimizer, scaler)
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {int(optimizer.param_groups[0]['step'].item())}")

    train(model, optimizer, scaler, loader, args, device)

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
