"""What conversion produces for the models the suite converts, written as text files: each
rewritten graph's code, its cast count and `amp_fx.report`'s text, per model and policy.

A refactor that should change nothing is checked by comparing two snapshots:

    python -m tests.graph_snapshot /tmp/before     # on the commit before the change
    python -m tests.graph_snapshot /tmp/after      # on the change
    diff -r /tmp/before /tmp/after                 # no output: nothing changed

A model that fails to convert writes its error instead, so a change in failures shows too.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

import amp_fx
from tests.models.hf import MODELS as HF_MODELS
from tests.models.small import GatedByValue, NanoGPT

Build = Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]
LEVELS = (("O1", torch.float16), ("O2", torch.float16), ("O3", torch.float16), ("O2", torch.bfloat16))


def _small_models() -> dict[str, Build]:
    def nanogpt() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        idx = torch.randint(0, 64, (2, 8))
        return NanoGPT(), (idx, idx.clone()), {}

    def gated() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        return GatedByValue(), (torch.randn(2, 8),), {}

    def vision(name: str) -> Build:
        def build() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
            extra = {"image_size": 64} if name.startswith("vit") else {}
            model = getattr(torchvision.models, name)(num_classes=10, **extra)
            return model, (torch.randn(2, 3, 64, 64),), {}

        return build

    def hf(name: str) -> Build:
        def build() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
            model, inputs = HF_MODELS[name]()
            return model, (), inputs(2, 8)

        return build

    models = {"nanogpt": nanogpt, "gated_by_value": gated}
    models |= {name: vision(name) for name in ("resnet18", "mobilenet_v3_small", "vit_b_16")}
    models |= {f"hf_{name}": hf(name) for name in HF_MODELS}
    return models


def _snapshot(build: Build, level: str, dtype: torch.dtype) -> str:
    torch.manual_seed(0)
    model, args, kwargs = build()
    try:
        converted = amp_fx.convert(model, level, dtype=dtype)
        converted.train()
        converted(*args, **kwargs)
        graphs = amp_fx.captured_graphs(converted)
        parts = []
        for index, gm in enumerate(graphs):
            report = amp_fx.report(gm)
            parts.append(f"## graph {index}: {type(gm).__name__}, {report.casts_inserted} casts\n{gm.code}")
        parts.append(f"## report\n{amp_fx.report(converted)}")
        return "\n".join(parts)
    except Exception:  # the snapshot records failures as they are
        return "## error\n" + traceback.format_exc(limit=0)


def main(out: str) -> None:
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for name, build in _small_models().items():
        for level, dtype in LEVELS:
            if name.startswith("vit_b") and level != "O2":
                continue  # the largest model: one policy is enough
            path = root / f"{name}-{level}-{str(dtype).removeprefix('torch.')}.txt"
            path.write_text(_snapshot(build, level, dtype))
            print(path, flush=True)


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":
        # transformers iterates sets of layer types (Gemma 3's rotary embeddings): string hashing
        # would order the graph's nodes differently from run to run.
        os.execve(
            sys.executable,
            [sys.executable, "-m", "tests.graph_snapshot", *sys.argv[1:]],
            {**os.environ, "PYTHONHASHSEED": "0"},
        )
    main(sys.argv[1])
