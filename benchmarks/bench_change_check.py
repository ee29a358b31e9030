"""What checking for changes after conversion costs per call (issue 35), on both front ends,
on the CPU: a model of ``--blocks`` blocks of 5 modules (the block, its Linear, LayerNorm, GELU and
Dropout; 100 blocks give 502 with the root and its ModuleList), each block holding a Hugging
Face-like ``config`` of 60 attributes, as each layer of a transformers model does.

It reports, as medians over ``--repeats`` rounds:

- ``check``: the per-call check of a call with nothing changed (`_follow_changes`: one integer
  compare, the config's ``__dict__`` against its copy, torch's global hooks; on the torch.fx front
  end its `GraphFollower`, which holds no config), the cost every call adds, over ``--calls``
  checks a round;
- ``call``: a whole call of the converted model with nothing changed (graph replay included), 10
  a round, and how many graphs those calls captured (none must be);
- ``walk``: one walk of the model after a change (`amp_fx.capture.changes.take`), paid once per
  change (``model.train()`` on a model in eval mode, ``dropout.p = 0``) before a recapture.

    python benchmarks/bench_change_check.py
    python benchmarks/bench_change_check.py --blocks 250 --repeats 7 --markdown out.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Callable

import torch
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import _follow_changes, capture_states
from amp_fx.capture.changes import take
from amp_fx.capture.traced_graph_module import FOLLOWER_ATTR

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reporting import environment, publish  # noqa: E402

WIDTH = 8
_WHOLE_CALLS = 10


class Block(nn.Module):
    def __init__(self, config: types.SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.fc, self.norm = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)
        self.act, self.drop = nn.GELU(), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.norm(self.fc(x))))


class Stack(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(**{f"flag_{i}": i for i in range(60)})
        self.blocks = nn.ModuleList(Block(self.config) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _median_us(samples: list[float], per: int) -> float:
    return statistics.median(samples) / per * 1e6


def bench(blocks: int, calls: int, repeats: int) -> dict[str, float]:
    """Median microseconds of check, call and walk (module docstring); ``recaptures`` counts graphs
    captured by the timed calls."""
    torch.manual_seed(0)
    model = amp_fx.convert(Stack(blocks).eval(), "O2", dtype=torch.bfloat16, front_end="export")
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        model(x)
    state = capture_states(model)[0][1]
    captured = list(state.graphs)
    timed = _timed_rounds(model, x, lambda: _follow_changes(model, state), calls, repeats)
    recaptures = sum(all(graph is not old for old in captured) for graph in state.graphs)
    return {**timed, "recaptures": float(recaptures)}


def _timed_rounds(
    model: nn.Module, x: torch.Tensor, check_once: Callable[[], object], calls: int, repeats: int
) -> dict[str, float]:
    """Medians over ``repeats`` rounds of the check alone, a whole call, and one walk."""
    check, call, walk = [], [], []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                check_once()
            check.append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(_WHOLE_CALLS):
                model(x)
            call.append(time.perf_counter() - start)
            start = time.perf_counter()
            take(model)
            walk.append(time.perf_counter() - start)
    return {
        "modules": float(len(list(model.modules()))),
        "check": _median_us(check, calls),
        "call": _median_us(call, _WHOLE_CALLS),
        "walk": _median_us(walk, 1),
    }


def bench_fx(blocks: int, calls: int, repeats: int) -> dict[str, float]:
    """The same on the torch.fx front end: the check is its `GraphFollower`'s; ``recaptures``
    counts rewrites of its graph by the timed calls."""
    torch.manual_seed(0)
    model = amp_fx.convert(Stack(blocks).eval(), "O2", dtype=torch.bfloat16, front_end="fx")
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        model(x)
    follower = model.__dict__[FOLLOWER_ATTR]
    graph = model.graph
    timed = _timed_rounds(model, x, lambda: follower(model), calls, repeats)
    return {**timed, "recaptures": float(model.graph is not graph)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    rows = [
        ("torch.export", bench(args.blocks, args.calls, args.repeats)),
        ("torch.fx", bench_fx(args.blocks, args.calls, args.repeats)),
    ]
    lines = [
        f"#### Change check per call - {environment(torch.device('cpu'))}",
        "",
        f"Medians of {args.repeats} rounds ({args.calls} checks, {_WHOLE_CALLS} calls each), O2 bf16, "
        "nothing changed between calls.",
        "",
        "| front end | modules | check us/call | whole call us | walk after a change us | recaptures |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {r['modules']:.0f} | {r['check']:.1f} | {r['call']:.0f} | {r['walk']:.0f} "
        f"| {r['recaptures']:.0f} |"
        for name, r in rows
    ]
    publish("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()
