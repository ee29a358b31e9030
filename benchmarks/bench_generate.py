"""``generate()`` of a converted Hugging Face model against the original under torch.autocast.

For each model (``hf_gpt2``, ``hf_llama`` of `models.py`, random weights) and each variant
(the original model under ``torch.autocast``; ``amp_fx.convert`` at O1 and O2), greedy
generation of ``--new-tokens`` tokens after a ``--batch`` x ``--prompt`` prompt. The first call of a
converted model captures its graphs (prefill and decode); it is reported apart, then the median of
``--repeats`` timed calls. Tokens of O1 are checked against autocast's (the same greedy choices).

    python benchmarks/bench_generate.py --models hf_gpt2,hf_llama --new-tokens 32
    python benchmarks/bench_generate.py --small          # CPU: checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import hf_config, hf_model  # noqa: E402

import amp_fx  # noqa: E402
from amp_fx.capture.captured_model import capture_states  # noqa: E402


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(call, device: torch.device) -> tuple[float, torch.Tensor]:
    _synchronize(device)
    start = time.perf_counter()
    tokens = call()
    _synchronize(device)
    return time.perf_counter() - start, tokens


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> list[str]:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    config = hf_config(name, args.small, args.prompt + args.new_tokens)
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_model(name, config).eval()
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.prompt), device=device)

    def generate(module):
        return module.generate(
            prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
        )

    def autocast_generate():
        with torch.autocast(device.type, dtype=dtype):
            return generate(model)

    variants = {"autocast": autocast_generate}
    converted, convert_seconds = {}, {}
    for level in ("O1", "O2"):
        start = time.perf_counter()
        converted[level] = amp_fx.convert(model, level, dtype=dtype)
        convert_seconds[level] = time.perf_counter() - start
        variants[level] = lambda level=level: generate(converted[level])
    rows, reference = [], None
    for variant, call in variants.items():
        first_s, tokens = _timed(call, device)
        times = [_timed(call, device)[0] for _ in range(args.repeats)]
        median = statistics.median(times)
        if variant == "autocast":
            reference, base = tokens, median
            extra = "-"
        else:
            graphs = sum(len(state.graphs) for _, state in capture_states(converted[variant]))
            islands = sum(len(state.islands) for _, state in capture_states(converted[variant]))
            same = "same tokens" if torch.equal(tokens, reference) else "tokens differ"
            extra = f"convert {convert_seconds[variant]:.2f} s, {graphs} graphs, {islands} islands, {same}"
        timing = f"{first_s * 1e3:.0f} | {median * 1e3:.1f} | {median / base:.2f}x"
        rows.append(f"| {name} | {variant} | {timing} | {extra} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="hf_gpt2,hf_llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU: checks that it runs")
    args = parser.parse_args(argv)
    if args.small:
        args.batch, args.prompt, args.new_tokens, args.repeats = 2, 8, 4, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [
        f"generate(): {args.batch} x {args.prompt} prompt, {args.new_tokens} new tokens (greedy), "
        f"{args.dtype}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, "
        f"torch {torch.__version__}",
        "",
        "| model | variant | first call ms | median ms | vs autocast | notes |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name in args.models.split(","):
        lines += bench_model(name, args, device)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
