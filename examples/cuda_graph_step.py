"""A whole O2 training step in one CUDA graph: forward, loss, scaled backward, optimizer, scaler.

A small model's training step is hundreds of short kernels; the host spends longer launching
them than the GPU spends running them. amp_fx's step never syncs with the host (the loss scaler
and the fused optimizer decide about overflows on the device), so `amp_fx.CudaGraphStep`
can capture the whole step once and replay it with one launch per step::

    step = CudaGraphStep(loss_fn, optimizer, scaler, max_grad_norm=1.0, enabled=args.cuda_graph)
    for inputs, targets in batches:
        loss = step(inputs, targets)     # warm-up, then capture, then replay

Run it (the model is examples/gpt.py's, on the standard library's source)::

    python examples/cuda_graph_step.py --cuda-graph            # on a GPU
    python examples/cuda_graph_step.py --cuda-graph --compare  # eager vs graph: ms/step, same weights?

Without a GPU it says so and runs the same step eagerly.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from gpt import GPT, VOCAB_SIZE, Batches, stdlib_corpus  # examples/gpt.py, beside this file

import amp_fx
from amp_fx.optim import master_params
from amp_fx.training.cuda_graph_step import CudaGraphStep


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cuda-graph", action="store_true", help="capture the step in a CUDA graph (needs a GPU)"
    )
    parser.add_argument("--compare", action="store_true", help="train eagerly and with a graph; compare both")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=3, help="eager steps before the capture")
    parser.add_argument("--opt-level", default="O2", choices=["O1", "O2", "O3"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp16", "bf16"], help="auto: fp16 on GPU")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--corpus-bytes", type=int, default=500_000)
    return parser.parse_args(argv)


def train(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, graph: bool
) -> dict[str, object]:
    """Train from a fixed initialization; return the time per step and the final FP32 weights."""
    torch.manual_seed(0)
    model = amp_fx.convert(
        GPT(n_layer=args.n_layer, block_size=args.block_size).to(device), args.opt_level, dtype=dtype
    )
    optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16 and args.opt_level != "O3")

    def loss_fn(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs).reshape(-1, VOCAB_SIZE), targets.reshape(-1))

    step = CudaGraphStep(
        loss_fn, optimizer, scaler, warmup_steps=args.warmup_steps, max_grad_norm=1.0, enabled=graph
    )
    # Batches made up front, on the device: the loop then measures the training step alone.
    batches = Batches(stdlib_corpus(args.corpus_bytes), args.block_size, args.batch_size, device, seed=0)
    data = [batches.get("train") for _ in range(args.steps)]

    timed_from = args.warmup_steps + 1  # warm-up and capture are not steady state
    start = 0.0
    for i, (inputs, targets) in enumerate(data):
        if i == timed_from:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        loss = step(inputs, targets)
        if i % args.log_every == 0 or i == args.steps - 1:
            print(f"  step {i:4d}  loss {loss.item():.4f}  loss scale {scaler.get_scale():g}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    timed_steps = max(args.steps - timed_from, 1)
    return {
        "ms_per_step": (time.perf_counter() - start) * 1e3 / timed_steps,
        "masters": [m.detach().clone() for m in master_params(optimizer)],
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, object]]:
    """Train as the flags say; return {"eager" and/or "cuda_graph": {"ms_per_step", "masters"}}."""
    args = parse_args(argv)
    if args.steps <= args.warmup_steps + 1:
        raise SystemExit(f"--steps must exceed --warmup-steps + 1 = {args.warmup_steps + 1}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
        args.dtype, torch.float16 if device.type == "cuda" else torch.bfloat16
    )
    use_graph = args.cuda_graph or args.compare
    if use_graph and device.type != "cuda":
        print("CUDA graphs need a CUDA GPU and none is available: running the same step eagerly.")
        use_graph = False
    shape = f"batch {args.batch_size}x{args.block_size}"
    print(f"{args.opt_level} {dtype}, {args.n_layer}-layer GPT, {shape}, {device}")

    modes = [False, True] if args.compare and use_graph else [use_graph]
    results = {}
    for graph in modes:
        name = "cuda_graph" if graph else "eager"
        print(f"{name}:")
        results[name] = train(args, device, dtype, graph)
        print(f"  {results[name]['ms_per_step']:.2f} ms/step")
    if len(results) == 2:
        eager, graphed = results["eager"], results["cuda_graph"]
        difference = max(
            (a - b).abs().max().item() for a, b in zip(eager["masters"], graphed["masters"], strict=True)
        )
        speedup = eager["ms_per_step"] / graphed["ms_per_step"]
        print(
            f"graph vs eager: {speedup:.2f}x faster; largest FP32 master weight difference {difference:.3g}"
        )
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
