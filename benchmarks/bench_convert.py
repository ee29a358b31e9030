"""How long `amp_fx.convert` takes on CPU: ResNet-50 and 12-layer transformers, per opt level.

The target (issue 2) is under 1 s for each. Models:

    resnet50        torchvision ResNet-50 (weights=None), 25.6 M parameters, 161 leaf modules
    gpt2_small      the benchmark GPT of benchmarks/models.py: 12 blocks written by hand
                    (d=768, vocab 50304, tied embeddings), 124 M parameters
    transformer12   torch.nn.TransformerEncoder, 12 layers (d=768, 12 heads, 3072 hidden),
                    traced through its non-fast path, 110 M parameters (85 M in the layers)

For each model and opt level it converts ``--repeats`` times (after one warm-up conversion) and
prints the median and the minimum wall time, with ``--example-inputs`` also the time with exact
dtype propagation (fake tensors). Trace alone (`amp_fx.capture.fx.trace`: a deep copy of the
model plus torch.fx tracing) is shown as a baseline: every conversion includes it.

    python benchmarks/bench_convert.py
    python benchmarks/bench_convert.py --models resnet50 --repeats 9 --example-inputs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torchvision
from torch import nn

import amp_fx
from amp_fx.capture.fx import trace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, GPT2_SMALL  # noqa: E402

LEVELS = ("O0", "O1", "O2", "O3")


class TransformerClassifier(nn.Module):
    """nn.TransformerEncoder (12 layers) over embedded tokens, mean-pooled to class logits."""

    def __init__(self, d_model: int = 768, layers: int = 12, heads: int = 12, vocab: int = 32000) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(tokens)).mean(1))


def _resnet50() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return torchvision.models.resnet50(weights=None), (torch.randn(2, 3, 224, 224),)


def _gpt2_small() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return GPT(GPT2_SMALL), (torch.randint(0, GPT2_SMALL.vocab_size, (2, 128)),)


def _transformer12() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TransformerClassifier(), (torch.randint(0, 32000, (2, 128)),)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "resnet50": _resnet50,
    "gpt2_small": _gpt2_small,
    "transformer12": _transformer12,
}


def _time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    fn()  # warm-up: first-call costs (imports, fx code generation caches)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def _cell(median: float, best: float) -> str:
    return f"{median:6.3f} ({best:.3f})"


def bench_model(name: str, repeats: int, dtype: torch.dtype, example_inputs: bool) -> list[str]:
    """The table's lines for one model: trace time, then convert time per opt level."""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    params = sum(p.numel() for p in model.parameters()) / 1e6
    nodes = len(trace(model).graph.nodes)
    trace_time = _cell(*_time(lambda: trace(model), repeats))

    def convert_times(examples: tuple[torch.Tensor, ...] | None) -> str:
        cells = []
        for level in LEVELS:
            timing = _time(
                lambda level=level: amp_fx.convert(
                    model, level, dtype=dtype, device_type="cpu", example_inputs=examples
                ),
                repeats,
            )
            cells.append(f" {_cell(*timing):>13}")
        return "".join(cells)

    lines = [f"{name:<14} {params:6.1f}M {nodes:>6} {trace_time:>13}" + convert_times(None)]
    if example_inputs:
        lines.append(f"{'  +examples':<14} {'':>7} {'':>6} {'':>13}" + convert_times(inputs))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="timed conversions per cell (median reported)")
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--example-inputs", action="store_true", help="also time exact dtype propagation")
    args = parser.parse_args(argv)

    print(
        f"amp_fx.convert on CPU: torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"Python {platform.python_version()}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs; dtype {args.dtype}; "
        f"median (min) of {args.repeats} runs, seconds"
    )
    header = f"{'model':<14} {'params':>7} {'nodes':>6} {'trace':>13}"
    header += "".join(f" {level:>13}" for level in LEVELS)
    print(header)
    print("-" * len(header))
    for name in args.models:
        for line in bench_model(name, args.repeats, getattr(torch, args.dtype), args.example_inputs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
