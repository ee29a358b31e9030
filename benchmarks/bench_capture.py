"""What each front end of `amp_fx.convert` costs on CPU (bf16): Hugging Face GPT-2 small (124 M,
from config, random weights) through torch.export, beside the hand-written GPT of
benchmarks/models.py (the same shape) through torch.fx.

For each opt level it reports, as medians of ``--repeats`` fresh conversions:

- ``convert``: the call itself (the torch.export front end copies the model and stores its
  parameters; capturing waits for the first call);
- ``first call``: the first forward, batch 1 x ``--seq`` tokens (capture at static sizes, the
  passes, then the forward);
- ``new length``: the first forward at 3/4 of that length (a second capture, dynamic sizes);
- ``then``: the same forward once captured.

    python benchmarks/bench_capture.py
    python benchmarks/bench_capture.py --levels O2 --repeats 5 --markdown BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import amp_fx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, GPT2_SMALL  # noqa: E402
from reporting import environment, publish  # noqa: E402


def _hf_gpt2() -> torch.nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()


def bench_export(level: str, seq: int, repeats: int) -> list[float]:
    """Median seconds of convert, first call, new length, then (see the module docstring)."""
    samples: list[list[float]] = [[], [], [], []]
    model = _hf_gpt2()
    ids, shorter = torch.randint(0, 50257, (1, seq)), torch.randint(0, 50257, (1, seq * 3 // 4))
    for _ in range(repeats):
        start = time.perf_counter()
        converted = amp_fx.convert(model, level, dtype=torch.bfloat16)
        samples[0].append(time.perf_counter() - start)
        with torch.no_grad():
            for sample, tokens in zip(samples[1:], (ids, shorter, shorter), strict=True):
                start = time.perf_counter()
                converted(input_ids=tokens, labels=tokens)
                sample.append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def bench_fx(level: str, repeats: int) -> float:
    model = GPT(GPT2_SMALL)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        amp_fx.convert(model, level, dtype=torch.bfloat16)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", nargs="+", default=["O1", "O2"])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lines = [
        f"#### Capture cost per front end - {environment(torch.device('cpu'))}",
        "",
        f"Medians of {args.repeats} fresh conversions; forward of batch 1 x {args.seq} tokens with labels.",
        "",
        "| model, front end | level | convert s | first call s | new length s | then s |",
        "|---|---|---|---|---|---|",
    ]
    for level in args.levels:
        convert_s, first, new_length, then = bench_export(level, args.seq, args.repeats)
        lines.append(
            f"| HF GPT-2 124M, torch.export | {level} | {convert_s:.3f} | {first:.2f} | {new_length:.2f} "
            f"| {then:.3f} |"
        )
        lines.append(
            f"| models.GPT 124M, torch.fx | {level} | {bench_fx(level, args.repeats):.3f} | - | - | - |"
        )
    publish("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
