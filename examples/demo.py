"""amp_fx end to end in seconds: convert a real model, train it a few steps, print the report.

`make demo` runs this. It converts the small GPT of ``examples/gpt.py`` at O2 (fp16 weights on a
GPU, bf16 on a CPU, with FP32 islands such as softmax and FP32 master weights in the optimizer),
trains it for a few steps on the Python standard library's source with the fused Adam optimizer
and the dynamic loss scaler, and prints what the conversion did: the casts inserted, the ops per
rule, and what stayed FP32 and why (``--full-report`` adds every node's rule and dtypes).
``--model resnet18`` does the same with torchvision's ResNet-18 on synthetic images (slow on a
CPU: CPUs without native bf16 run low-precision convolutions far slower than fp32).

    python examples/demo.py [--model gpt|resnet18] [--opt-level O2] [--steps 20] [--full-report]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import amp_fx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, VOCAB_SIZE, Batches, stdlib_corpus  # noqa: E402  (the example next door)


def gpt_job(device: torch.device, batch_size: int) -> tuple[torch.nn.Module, tuple, object, callable]:
    model = GPT(n_layer=2, n_head=4, n_embd=64, block_size=32).to(device)
    batches = Batches(stdlib_corpus(300_000), block_size=32, batch_size=batch_size, device=device, seed=0)

    def loss_of(gm: torch.nn.Module) -> torch.Tensor:
        x, y = batches.get("train")
        return F.cross_entropy(gm(x).reshape(-1, VOCAB_SIZE), y.reshape(-1))

    return model, (batches.get("train")[0],), amp_fx.optim.FusedAdam, loss_of


def resnet18_job(device: torch.device, batch_size: int) -> tuple[torch.nn.Module, tuple, object, callable]:
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).to(device)
    templates = torch.randn(10, 3, 32, 32, device=device)

    def loss_of(gm: torch.nn.Module) -> torch.Tensor:
        labels = torch.randint(0, 10, (batch_size,), device=device)
        images = templates[labels] + torch.randn(batch_size, 3, 32, 32, device=device)
        return F.cross_entropy(gm(images), labels)

    return model, (templates[:2],), amp_fx.optim.FusedSGD, loss_of


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=["gpt", "resnet18"])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--steps", type=int, default=20)
    # Small enough for CPUs without native bf16 (their bf16 matmuls are ~25x slower than fp32).
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--full-report", action="store_true", help="print the per-node table, not only the summary"
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    print(f"device {device}, {args.model} at {args.opt_level} with {dtype}, torch {torch.__version__}")
    job = gpt_job if args.model == "gpt" else resnet18_job
    model, example_inputs, optimizer_class, loss_of = job(device, args.batch_size)

    # 1. Convert: a torch.fx GraphModule whose casts are explicit nodes (example inputs make the
    #    report's dtypes exact).
    start = time.perf_counter()
    gm = amp_fx.convert(model, args.opt_level, dtype=dtype, example_inputs=example_inputs)
    print(f"converted in {time.perf_counter() - start:.2f}s")

    # 2. Train: FP32 master weights inside the fused optimizer, loss scaling on the device (fp16
    #    only: bf16 has fp32's range), no host sync in the step.
    optimizer = optimizer_class(gm.parameters(), lr=3e-3 if args.model == "gpt" else 0.05)
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16 and args.opt_level in ("O1", "O2"))
    losses = []
    gm.train()
    start = time.perf_counter()
    for step in range(args.steps):
        loss = loss_of(gm)  # O2 outputs come back FP32, so the loss is computed in FP32
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}: loss {losses[-1]:.4f}  loss scale {scaler.get_scale():g}")
    print(f"trained {args.steps} steps in {time.perf_counter() - start:.1f}s")

    # 3. What the conversion did: the summary, or with --full-report also one line per node.
    report = amp_fx.report(gm)
    print()
    if args.full_report:
        print(report)
    else:
        table_start = str(report).index(report.table())
        print(str(report)[:table_start].rstrip())  # the report's header: model, opt level, dtype
        print(report.summary())
        print(f"({len(report.rows)} nodes; --full-report prints each node's rule, dtypes and reason)")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
