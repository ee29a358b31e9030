"""Bytes one eager training step writes, O2 against torch.autocast and the model ``.to(dtype)``.

A device-free measure of memory traffic (`amp_fx.testing.bytes_written`): every op's fresh outputs
and in-place writes, summed over the forward with the loss, the backward and the optimizer step
(torch's fused AdamW for autocast and ``.to(dtype)``, amp_fx's FusedAdam with FP32 masters for O2).
Fusions show up as fewer bytes: each intermediate a fused kernel keeps in registers is a tensor
less. On the CPU amp_fx's optimizer runs its pure-torch reference, whose temporaries are counted;
on a GPU its Triton kernel writes in place, unseen (only its wrappers' allocations count). Compare
the forward and backward columns across recipes; the optimizer column only within torch's.

The transformers models of benchmarks/models.py at their CPU size (``--small``, the default here:
seconds on one core), called as their docs show (``model(input_ids=ids, labels=ids)``)::

    python benchmarks/bench_bytes_written.py
    python benchmarks/bench_bytes_written.py --models hf_llama_liger --dtype float16
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import HF_MODEL_CLASSES, build_workload  # noqa: E402
from reporting import environment, publish  # noqa: E402

from amp_fx.testing.bytes_written import RECIPES, StepBytes, training_step_bytes  # noqa: E402

CASTS = "aten._to_copy.default"


def format_table(title: str, counts: dict[str, StepBytes]) -> str:
    """One row per recipe: KiB written by the forward, backward and optimizer, the casts among the
    forward and backward's, and forward + backward against autocast's."""
    header = ["recipe", "forward KiB", "backward KiB", "optimizer KiB", "casts KiB", "fwd+bwd vs autocast"]
    lines = [f"#### {title}", "", "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    baseline = counts["autocast"].forward + counts["autocast"].backward
    for recipe, counted in counts.items():
        model_part = counted.forward + counted.backward
        casts = counted.op_bytes(CASTS, ("forward", "backward"))
        cells = [counted.forward, counted.backward, counted.optimizer, casts]
        row = [recipe, *(f"{value / 1024:.1f}" for value in cells), f"{model_part / baseline:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="hf_gpt2,hf_llama", help=f"comma list of {', '.join(HF_MODEL_CLASSES)}"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--full-size", action="store_true", help="the benchmark sizes (a GPU's work)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--markdown", default=None, help="append the tables to this file")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for name in models:
        if name not in HF_MODEL_CLASSES:
            parser.error(f"unknown model {name!r}: choose from {', '.join(HF_MODEL_CLASSES)}")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CI machine; the counts do not depend on it
    dtype = getattr(torch, args.dtype)
    tables = []
    for name in models:
        work = build_workload(name, device, small=not args.full_size)
        inputs = {"input_ids": work.inputs, "labels": work.targets}
        counts = {recipe: training_step_bytes(work.model, inputs, recipe, dtype) for recipe in RECIPES}
        batch, seq = work.inputs.shape
        title = (
            f"Bytes written by one training step: {HF_MODEL_CLASSES[name]} ({name}"
            f"{'' if args.full_size else ', CPU size'}), batch {batch} x seq {seq}, {args.dtype} - "
            f"{environment(device)}"
        )
        tables.append(format_table(title, counts))
    publish("\n".join(tables), args.markdown)


if __name__ == "__main__":
    main()
