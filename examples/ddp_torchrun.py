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
4. In the loop (``torchrun_common.train``), clip with ``amp_fx.clip_grad_norm_(optimizer, ...)``,
   without ``scaler.unscale_``: the grads stay scaled, and the optimizer unscales and clips them in
   its kernel.

The process group, the synthetic data and the training loop are the ones ``fsdp2_torchrun.py``
uses too, in ``torchrun_common.py`` next to this file. At the end every rank checks that its
weights equal rank 0's, and rank 0 can save a checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchrun_common import DTYPES, ResidualMLP, argument_parser, join_process_group, sharded_loader, train

import amp_fx
from amp_fx.optim import master_params

LAUNCH = "torchrun --nproc_per_node=2 examples/ddp_torchrun.py"


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
    parser = argument_parser(
        __doc__, ["O1", "O2", "O3"], checkpoint_help="rank 0 saves model/optimizer/scaler here at the end"
    )
    args = parser.parse_args()
    rank, world_size, device = join_process_group(args.device, LAUNCH)
    loader = sharded_loader(args.global_batch_size, rank, world_size)
    dtype = DTYPES[args.dtype]

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = amp_fx.convert(ResidualMLP().to(device), args.opt_level, dtype=dtype)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = amp_fx.optim.FusedAdam(ddp_model.parameters(), lr=args.lr, weight_decay=0.01)
    # bf16 has fp32's range: no loss scaling. O3 trains without one, as Apex's O3 does.
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16 and args.opt_level != "O3")

    train(ddp_model, optimizer, scaler, loader, args, device)

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
