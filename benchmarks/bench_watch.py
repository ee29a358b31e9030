"""The cost of `amp_fx.watch`: a training step of an amp_fx-converted model, watched and not.

The model (benchmarks/models.py) is converted at O2 with its loss, and trains with amp_fx's
FusedAdam/FusedSGD and a LossScaler (fp16). The same model object alternates between unwatched
and watched rounds (``amp_fx.watch`` before a round, ``remove()`` after it), so drift of the
machine hits both alike. Each step is timed alone, from before the forward to after the optimizer
step (``torch.cuda.synchronize`` on both ends on CUDA). Prints the median step of each, the ratio,
and, as a check that the watch recorded, the number of nodes it watched and the largest magnitude
it saw. The small model runs on the CPU in seconds (recording uses the kernels' torch reference
there); the benchmark sizes need a GPU::

    python benchmarks/bench_watch.py                          # small GPT, CPU or GPU
    python benchmarks/bench_watch.py --full --model gpt       # GPT-2 small, 16 x 1024, GPU
    python benchmarks/bench_watch.py --full --every 4         # record every 4th step
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from models import BUILDERS, build_workload, with_loss
from reporting import environment, publish

import amp_fx
import amp_fx.optim
from amp_fx.inspect.ranges import DEFAULT_EVERY


def _step(model, inputs, targets, optimizer, scaler) -> None:
    loss = model(inputs, targets)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def _timed_steps(device: torch.device, steps: int, run) -> list[float]:
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt", choices=sorted(BUILDERS))
    parser.add_argument("--full", action="store_true", help="the benchmark size (GPU); default: small")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY, help="watch(every=)")
    parser.add_argument("--nodes", default="low", choices=["low", "all"], help="watch(nodes=)")
    parser.add_argument("--rounds", type=int, default=4, help="unwatched/watched round pairs")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (10; 5 small)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each round")
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    steps = args.steps or (10 if args.full else 5)
    work = build_workload(args.model, device, small=not args.full)
    policy = amp_fx.preset("O2", dtype, device.type)
    if work.loss_fn is None:
        model = with_loss(amp_fx.convert(work.model, policy=policy), None)
        watched = model.model
    else:
        model = watched = amp_fx.convert(with_loss(work.model, work.loss_fn), policy=policy)
    params = [p for p in model.parameters() if p.requires_grad]
    if work.optimizer == "adamw":
        optimizer = amp_fx.optim.FusedAdam(params, lr=work.lr, adam_w_mode=True, master_weights=True)
    else:
        optimizer = amp_fx.optim.FusedSGD(params, lr=work.lr, momentum=0.9, master_weights=True)
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16)

    def run() -> None:
        _step(model, work.inputs, work.targets, optimizer, scaler)

    times: dict[str, list[float]] = {"unwatched": [], "watched": []}
    watch = None
    for _ in range(args.rounds):
        for name in times:
            if name == "watched":
                watch = amp_fx.watch(watched, every=args.every, nodes=args.nodes)
            _timed_steps(device, args.warmup, run)
            times[name] += _timed_steps(device, steps, run)
            if watch is not None:
                ranges = watch.ranges()
                watch.remove()
                watch = None
    medians = {name: 1e3 * statistics.median(values) for name, values in times.items()}
    largest = max((r.forward.amax for r in ranges if r.forward.recorded), default=0.0)
    size = "full" if args.full else "small"
    table = (
        f"amp_fx.watch cost, {args.model} ({size}), O2 {args.dtype}, every={args.every}, "
        f"nodes={args.nodes}; {environment(device)}\n\n"
        "| model | unwatched ms | watched ms | ratio | watched nodes | largest forward magnitude |\n"
        "|---|---|---|---|---|---|\n"
        f"| {args.model} | {medians['unwatched']:.2f} | {medians['watched']:.2f} | "
        f"{medians['watched'] / medians['unwatched']:.3f} | {len(ranges)} | {largest:.3g} |\n"
    )
    publish(table, args.markdown)


if __name__ == "__main__":
    main()
