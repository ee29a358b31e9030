"""The accuracy side of O2's residual-stream choice (issue 25): each way of training in low
precision, measured against FP32 by amp_fx.testing's relative oracle (`error_ratio`).

For Hugging Face Llama and GPT-2 (bench_train's ``hf_llama`` / ``hf_gpt2`` configs, ``--size small``
by default: 2 layers, width 64, 2 x 32 tokens) and each low dtype, four models run the same seeded
batches: torch.autocast, amp_fx O2 (FP32 residual stream), O2 with ``low_precision_residual=True``
and the model cast with ``.to(dtype)``. Each column is a norm-wise error against FP32 (‖x − x_fp32‖
/ ‖x_fp32‖), the median over the oracle's 7 batches: the logits, and the median and the largest
over the parameters' gradients (the loss, a mean of 64 terms, is left out: its error is mostly
cancellation); ``vs autocast`` is the oracle's ratio (its largest, floored
as in `error_ratio`), which `assert_equivalent` bounds by 1.5.

    python benchmarks/residual_accuracy.py                     # CPU, tiny models: docs/DESIGN.md's figures
    python benchmarks/residual_accuracy.py --layers 8          # the same, 8 layers deep
    python benchmarks/residual_accuracy.py --device cuda --size full --models hf_llama_liger --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import hf_config, hf_model, token_shape  # noqa: E402

import amp_fx  # noqa: E402
from amp_fx.testing import ErrorRatio, error_ratio, low_precision_copy, with_autocast  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
MODELS = ("hf_llama", "hf_gpt2")

Builder = Callable[[torch.nn.Module, torch.dtype, str], torch.nn.Module]
# The ways of training measured, in the table's order; each takes (fp32 model, dtype, device type).
CANDIDATES: dict[str, Builder] = {
    "autocast": lambda model, dtype, device: with_autocast(model, device, dtype),
    "O2": lambda model, dtype, device: amp_fx.convert(model, policy=amp_fx.preset("O2", dtype, device)),
    "O2 low_precision_residual": lambda model, dtype, device: amp_fx.convert(
        model, policy=amp_fx.preset("O2", dtype, device, low_precision_residual=True)
    ),
    ".to(dtype)": lambda model, dtype, device: low_precision_copy(model, dtype),
}


def build(
    name: str, size: str, device: torch.device, layers: int | None = None
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The FP32 model (eval mode: no dropout, so every candidate computes the same function), with
    ``layers`` layers if given, and its batch, ``input_ids`` and ``labels``."""
    small = size == "small"
    batch, seq = token_shape(name, small, None, None)
    config = hf_config(name, small, seq)
    if layers is not None:
        config.num_hidden_layers = layers  # GPT2Config maps it to n_layer
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_model(name, config).eval()
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's class name names no loss (bench_train does the same)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    return model, {"input_ids": tokens, "labels": tokens}


def summarize(measured: ErrorRatio) -> dict[str, float]:
    """The table's columns of one measurement."""
    errors = {t.name: t.error for t in measured.tensors}
    grads = [error for name, error in errors.items() if name.startswith("grad of parameter")]
    return {
        "logits": errors["output[1]"],
        "grads (median)": statistics.median(grads),
        "grads (max)": max(grads),
        "vs autocast": measured.ratio,
    }


def measure(
    name: str, dtype: torch.dtype, size: str, device: torch.device, layers: int | None = None
) -> dict[str, dict[str, float]]:
    """Each candidate's summary, measured against FP32 with autocast as the oracle's reference."""
    model, batch = build(name, size, device, layers)
    reference = with_autocast(model, device.type, dtype)
    rows = {}
    for label, make in CANDIDATES.items():
        candidate = make(model, dtype, device.type)
        measured = error_ratio(model, candidate, (), keyword_inputs=batch, reference=reference, dtype=dtype)
        if measured.mismatches:
            raise AssertionError(f"{name} {label}: {measured.failures()}")
        rows[label] = summarize(measured)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="hf_llama, hf_llama_liger, hf_gpt2")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--size", choices=("small", "full"), default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--layers", type=int, default=None, help="layers of each model (default: its config's)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    depth = "" if args.layers is None else f" with {args.layers} layers"
    print(f"norm-wise error against FP32, median over 7 batches; {args.size} models{depth} on {device}")
    print("| model | dtype | training | logits | grads (median) | grads (max) | vs autocast |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            for label, row in measure(name, DTYPES[dtype_name], args.size, device, args.layers).items():
                cells = " | ".join(f"{value:.2g}" for value in row.values())
                print(f"| {name} | {dtype_name} | {label} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
