"""A language model's head and loss: the linear layer + FP32 cross-entropy, fused or not.

Forward + backward of ``loss(h @ W.T, t)`` for GPT-2's head (16 x 1024 tokens, d = 768, vocab
50304, no bias), h and W both needing gradients, the loss scaled before the backward as a loss
scaler does (65536 for fp16, 1 for bf16):

    cast_fp32          F.cross_entropy(F.linear(h, W).float(), t): torch.autocast's loss
    fp32_fused         amp_fx.fp32_cross_entropy(F.linear(h, W), t, grad_into_input=True): O2
                       today (the gradient written over the logits in the loss's backward)
    linear_fused       amp_fx.ops.cross_entropy.linear_cross_entropy_rows(h, W, None, t, -100), the op that
                       amp_fx.ops.cross_entropy.linear_cross_entropy runs under torch.compile (O2's default
                       there), called directly in eager mode too: the loss's gradient written in
                       its forward kernel, a backward of two matmuls. (Eagerly,
                       linear_cross_entropy itself runs fp32_fused, which measured faster.)

    chunked            amp_fx.ops.chunked_cross_entropy.chunked_linear_cross_entropy(h, W, None, t):
                       O2's fused head + loss for graphs captured in training mode (Hugging Face
                       models): chunks of rows, gradients in the forward, never the [rows, V]
                       logits; ``--chunk-rows`` sweeps the rows per chunk (``chunked_<rows>``)

each eager and under ``torch.compile`` (Inductor). Per row: median ms (``triton.testing.do_bench``),
peak memory of one step above the inputs, and the largest differences from ``cast_fp32`` eager
(loss; grad_h and grad_W relative to that gradient's largest entry). GPU only::

    python benchmarks/bench_linear_cross_entropy.py --markdown BENCHMARKS.md
    # the chunked op at Llama-0.5B's and GPT-2's shapes against the unfused head + loss:
    python benchmarks/bench_linear_cross_entropy.py --preset llama --modes eager,compile
    python benchmarks/bench_linear_cross_entropy.py --preset gpt2 --modes eager --chunk-rows auto,1024,4096

Presets (``--preset``) set rows, d, V and the dtype: ``gpt2`` 16 x 1024 rows, d 768, V 50257, fp16;
``llama`` 8 x 2048 rows, d 1536, V 32000, bf16 (Llama-0.5B).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from reporting import environment, publish

import amp_fx
from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy
from amp_fx.ops.cross_entropy import linear_cross_entropy_rows

VARIANTS = {
    "cast_fp32": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t),
    "fp32_fused": lambda h, w, t: amp_fx.fp32_cross_entropy(F.linear(h, w), t, grad_into_input=True),
    "linear_fused": lambda h, w, t: linear_cross_entropy_rows(h, w, None, t, -100)[0].mean(),
}

PRESETS = {
    "gpt2": {"rows": 16 * 1024, "dim": 768, "classes": 50257, "dtypes": "float16"},
    "llama": {"rows": 8 * 2048, "dim": 1536, "classes": 32000, "dtypes": "bfloat16"},
}
LOSS_SCALES = {torch.float16: 65536.0, torch.bfloat16: 1.0}


def _chunked(chunk_rows: int | None):
    return lambda h, w, t: chunked_linear_cross_entropy(h, w, None, t, chunk_rows=chunk_rows)


def _variants(names: list[str], chunk_rows: list[str]) -> dict:
    """The variants to run: ``chunked`` once per entry of ``--chunk-rows``."""
    chosen = {}
    for name in names:
        if name != "chunked":
            chosen[name] = VARIANTS[name]
            continue
        for rows in chunk_rows:
            label = "chunked" if rows == "auto" else f"chunked_{rows}"
            chosen[label] = _chunked(None if rows == "auto" else int(rows))
    return chosen


def _step(loss_fn, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, scale: float):
    def run() -> torch.Tensor:
        h.grad = w.grad = None
        loss = loss_fn(h, w, t)
        (loss * scale).backward()
        return loss

    return run


def _relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16 * 1024)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--classes", type=int, default=50304)
    parser.add_argument("--modes", default="eager,compile", help="comma-separated: eager, compile")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="rows, dim, classes, dtype")
    parser.add_argument("--dtypes", default="float16,bfloat16", help="comma-separated: float16, bfloat16")
    parser.add_argument(
        "--variants", default="cast_fp32,fp32_fused,linear_fused,chunked", help="comma-separated"
    )
    parser.add_argument("--chunk-rows", default="auto", help="comma-separated rows per chunk, or auto")
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    if args.preset is not None:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear_cross_entropy.py needs a CUDA device")
    from triton.testing import do_bench

    modes = args.modes.split(",")
    generator = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        f"#### Linear head + cross-entropy forward + backward, {args.rows} x {args.dim} -> {args.classes} - "
        f"{environment()}",
        "",
        "| dtype | mode | variant | ms | vs cast_fp32 | peak GiB | loss diff | grad_h diff | grad_W diff |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    variants = _variants(args.variants.split(","), args.chunk_rows.split(","))
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        scale = LOSS_SCALES[dtype]
        h = torch.randn(args.rows, args.dim, device="cuda", generator=generator).to(dtype).requires_grad_()
        w = (torch.randn(args.classes, args.dim, device="cuda", generator=generator) * 0.02).to(dtype)
        w.requires_grad_()
        t = torch.randint(0, args.classes, (args.rows,), device="cuda", generator=generator)
        reference_loss = _step(VARIANTS["cast_fp32"], h, w, t, scale)()
        reference = (h.grad.clone(), w.grad.clone())
        for mode in modes:
            times: dict[str, float] = {}
            for name, loss_fn in variants.items():
                fn = torch.compile(loss_fn) if mode == "compile" else loss_fn
                run = _step(fn, h, w, t, scale)
                loss = run()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                run()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                diffs = (
                    (loss - reference_loss).abs().item(),
                    _relative_difference(h.grad, reference[0]),
                    _relative_difference(w.grad, reference[1]),
                )
                times[name] = do_bench(run, warmup=10, rep=100, return_mode="median")
                baseline = times.get("cast_fp32", times[name])
                lines.append(
                    f"| {str(dtype).removeprefix('torch.')} | {mode} | {name} | {times[name]:.2f} | "
                    f"{times[name] / baseline:.2f}x | {peak:.2f} | {diffs[0]:.1e} | "
                    f"{diffs[1]:.1e} | {diffs[2]:.1e} |"
                )
        del h, w, t, reference
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    publish(text, args.markdown)


if __name__ == "__main__":
    main()
