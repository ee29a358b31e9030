"""Cross-entropy on low-precision logits: amp_fx's fused FP32 loss against torch's ways of doing it.

Forward + backward of the loss on a language model's logits (GPT-2: 16 x 1024 tokens, vocab 50304):

    cast_fp32      F.cross_entropy(logits.float(), t): what torch.autocast and an unfused O2 run
    fp32_fused     amp_fx.fp32_cross_entropy(logits, t): the same fp32 math, no fp32 copy
    low_precision  F.cross_entropy(logits, t) on fp16/bf16 logits: what `.half()` runs (its
                   log-probabilities rounded to fp16, not an FP32 loss)

Per row: median ms (``triton.testing.do_bench``), effective GB/s counting the fused kernel's
minimum traffic (forward reads the logits once, backward reads them and writes the gradient:
3 x N x C x itemsize bytes), and the largest differences from ``cast_fp32`` (loss, gradient).
GPU only::

    python benchmarks/bench_cross_entropy.py --markdown BENCHMARKS.md
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from reporting import environment, publish

import amp_fx


def _forward_backward(loss_fn, logits: torch.Tensor, targets: torch.Tensor):
    def run() -> torch.Tensor:
        logits.grad = None
        loss = loss_fn(logits, targets)
        loss.backward()
        return loss

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16 * 1024)
    parser.add_argument("--classes", type=int, default=50304)
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_cross_entropy.py needs a CUDA device")
    from triton.testing import do_bench

    variants = {
        "cast_fp32": lambda x, t: F.cross_entropy(x.float(), t),
        "fp32_fused": amp_fx.fp32_cross_entropy,
        "low_precision": F.cross_entropy,
    }
    generator = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        f"#### Cross-entropy forward + backward, {args.rows} x {args.classes} logits - {environment()}",
        "",
        "| logits | variant | ms | GB/s (3 x logits bytes) | vs cast_fp32 | max loss diff | max grad diff |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for dtype in (torch.float16, torch.bfloat16):
        logits = (torch.randn(args.rows, args.classes, device="cuda", generator=generator) * 3).to(dtype)
        logits.requires_grad_(True)
        targets = torch.randint(0, args.classes, (args.rows,), device="cuda", generator=generator)
        reference_loss = _forward_backward(variants["cast_fp32"], logits, targets)()
        reference_grad = logits.grad.clone()
        times = {}
        for name, loss_fn in variants.items():
            run = _forward_backward(loss_fn, logits, targets)
            loss = run()
            loss_diff = (loss.float() - reference_loss).abs().item()
            grad_diff = (logits.grad.float() - reference_grad.float()).abs().max().item()
            times[name] = do_bench(run, warmup=25, rep=200, return_mode="median")
            gbps = 3 * logits.numel() * logits.element_size() / times[name] / 1e6
            ratio = times[name] / times["cast_fp32"]
            lines.append(
                f"| {str(dtype).removeprefix('torch.')} | {name} | {times[name]:.2f} | {gbps:.0f} | "
                f"{ratio:.2f}x | {loss_diff:.1e} | {grad_diff:.1e} |"
            )
        del logits, targets, reference_grad
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    publish(text, args.markdown)


if __name__ == "__main__":
    main()
