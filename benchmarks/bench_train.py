"""End-to-end training-step benchmark: torch's mixed precision against amp_fx O1/O2/O3.

Models (``--models``, benchmarks/models.py): ``gpt`` (GPT-2 small written out by hand),
``resnet50``, and Hugging Face transformers causal LMs from configs, random weights:
``hf_gpt2`` (``GPT2LMHeadModel(GPT2Config())``, 124M, 16 x 1024 tokens), ``hf_llama`` (Llama
architecture, 0.67B, 8 x 2048 tokens), ``hf_llama_liger`` (the Llama of Liger-Kernel's
comparison, 0.50B, 8 x 2048 tokens), ``hf_llama32_1b`` (the Llama-3.2-1B shape: hidden 2048, 16
layers, 32 heads / 8 KV heads, FFN 8192, vocab 128256, tied embeddings, 1.24B, 4 x 4096 tokens;
issue 41), ``hf_mixtral`` (Mixtral architecture: hidden 1024, 8 layers, 8 experts top 2, expert
FFN 3584, 8 x 2048 tokens; issue 37); ``--batch-size``/``--seq-len`` change the shape. The
transformers models train on their own loss (``model(input_ids=..., labels=...).loss``); amp_fx
converts them with its torch.export front end (`amp_fx.capture.captured_model`), which captures a graph at
the first call and another at the first call of a new shape. For those, after the eager timing, the
first call of a freshly converted model and its first call at 3/4 of the sequence length are timed
beside the same calls once captured, and printed under the table. Without ``--variants`` they run
autocast_fp16 and o2_fp16 only (the comparison of issue 12); hf_llama_liger runs issue 25's in
bf16: autocast_bf16 (the baseline of its ratios), pure_bf16, o2_bf16 and the two Liger variants;
hf_llama32_1b and hf_mixtral run autocast_bf16 (their baseline) and o2_bf16.

One training step is forward, loss, (scaled) backward, optimizer step and scaler update. Every
variant trains the same freshly seeded model on the same batch:

    fp32             fp32 model, torch fused AdamW / SGD
    autocast_fp16    torch.autocast(float16) + torch.amp.GradScaler, torch fused optimizer
    autocast_bf16    torch.autocast(bfloat16), torch fused optimizer
    half             model.half() (no master weights, no loss scaling), torch fused optimizer on fp16
    pure_bf16        model.to(bfloat16) (no master weights), torch fused optimizer on bf16
    liger_autocast_bf16, liger_pure_bf16
                     autocast_bf16 / pure_bf16 on a model built after Liger-Kernel's patch of its
                     family (``apply_liger_kernel_to_llama()``: RMSNorm, SwiGLU MLP, rotary and the
                     fused linear + cross-entropy; Liger has no GPT-2 patch, and the table says so).
                     Liger patches transformers for the whole process, so these run in a process
                     of their own (``--isolate``). Liger is a benchmark-only dependency: on the GPU
                     machine, which has no registry, install its wheel, downloaded beforehand into
                     .wheels/ (``python -m pip download liger-kernel --no-deps -d .wheels``), with
                     ``python3 -m pip install --no-deps .wheels/liger_kernel-*.whl``. Its kernels
                     need CUDA: on a CPU these rows are skipped, with the reason.
    o{1,2,3}_{fp16,bf16}
                     amp_fx.convert(model, level, dtype=...) + amp_fx.optim.FusedAdam / FusedSGD
                     (FP32 masters at O2) + amp_fx.LossScaler (dynamic for fp16 at O1/O2; off for
                     bf16 and for O3, whose loss scale is 1.0 as in Apex)
    o2_fp16_cuda_graph
                     o2_fp16 with the whole step captured in one CUDA graph and replayed
                     (amp_fx.CudaGraphStep; eager mode, CUDA only)
    o2_fp16_loss_outside
                     o2_fp16 with the loss computed outside the converted model, on its float32
                     outputs (cast_model_outputs), as a training loop written for Apex does
    o2_fp16_unfused_bn
                     o2_fp16 without fused BatchNorm + [add] + ReLU (``fused_batch_norm=False``:
                     cuDNN's BatchNorm and separate add and ReLU kernels, as autocast runs them)
    o2_fp16_unfused_pool
                     o2_fp16 with torch's max-pool (``fused_max_pool=False``: int64 indices, as
                     autocast runs it) instead of amp_fx.ops.max_pool.max_pool2d
    o2_fp16_unfused_linear_loss
                     o2_fp16 without its linear-head + loss fusion (``fused_linear_loss=False``):
                     a GPT's lm_head, then the loss (under torch.compile the fused call computes
                     the loss's gradient in its forward kernel, a backward of matmuls only)
    o2_{fp16,bf16}_low_residual
                     O2 with its opt-in low-precision residual stream
                     (``preset(..., low_precision_residual=True)``: embedding tables stored low, the
                     residual adds and the fused add + norm calls on a low stream, as pure_bf16 runs
                     them; norms still in FP32 on FP32 weights, FP32 masters)

Every variant trains ``WithLoss(model, loss_fn)``: the model and its loss as one module (the loss
under autocast for the autocast variants, as before). amp_fx converts that module, so at O2 the
cross-entropy reads the low-precision logits directly
(``amp_fx.ops.cross_entropy.fp32_cross_entropy``: float32 math without a float32 copy of the
logits); ``o2_fp16_loss_outside`` shows the cost of the copy.

each eager and under torch.compile (the forward and the loss compiled; the optimizer step runs
eagerly, as a fused kernel in every variant; ``--compile-mode`` sets torch.compile's mode, which
is torch's default except for hf_llama_liger: ``max-autotune-no-cudagraphs``, issue 41). All
variants of a mode are built and warmed up first (compiles, CUDA-graph capture), then timed in
``--rounds`` rounds of ``--steps`` steps, the order reversed every other round: a GPU slows as it
heats up or reaches its power limit, and variants timed in a fixed order would carry that into
their ratios. Per variant it reports the median of all its timed steps, the ratio to the model's
baseline (autocast_fp16, or ``--baseline``'s help) in the same mode, and peak memory
(``torch.cuda.max_memory_allocated`` during its warm-up, above what was allocated before it was
built: its weights, optimizer state, grads and activations, not the unconverted model, other
variants or cuBLAS's workspaces, which are allocated before the first; o2_fp16_cuda_graph's peak
counts those of its capture stream), model TFLOP/s and MFU (benchmarks/train_flops.py: 6 x
matmul parameters x tokens + causal attention's 6 x batch x seq^2 x width x layers, the LM head
counted as a matmul and the embedding lookup not; over the GPU's dense fp16/bf16 peak, 989
TFLOP/s on an H100 SXM or H200, none stated for fp32 rows or other devices). A variant that fails
is reported in the table and the run goes on.

GPU runs (eager ~1-2 min, then ~10 compiles of 20-50 s each; ``--time-budget`` skips, and
reports, the variants that would start after it, least telling last; with several models each gets
an equal share of what is left of it)::

    python benchmarks/bench_train.py --models gpt --markdown BENCHMARKS.md --time-budget 480
    python benchmarks/bench_train.py --models resnet50 --markdown BENCHMARKS.md --time-budget 480

The transformers models, both in one run meant to fit in 9 minutes on an H200 (fewer steps: a
Llama step is ~5x a GPT-2 one, and each model compiles twice)::

    python benchmarks/bench_train.py --models hf_gpt2,hf_llama --steps 10 --rounds 4 --time-budget 420

Where a variant's time goes: ``--variants o2_fp16,autocast_fp16 --modes eager --profile 25``
(torch.profiler's top ops), or ``--breakdown``: 3 more steps of every variant profiled and their
GPU time summed by kind of kernel (casts/copies, elementwise, GEMM, attention, norms, reductions,
optimizer, Triton kernels by family, other; benchmarks/kernel_breakdown.py), a table under the
main one.

Fresh processes (``--isolate``): ``variant`` runs every variant, in every mode, in a process of
its own (benchmarks/isolated_runs.py) and collects the results into one table: a compiled
variant's peak memory measured alone, not lowered by what variants built before it left behind.
``auto`` (the default) does so only to keep the Liger variants apart from the others.

Issue 25's runs, each well within 10 minutes on an H200 (the Liger wheel in .wheels/)::

    python3 benchmarks/bench_train.py --models hf_llama_liger --modes eager --steps 10 --rounds 3 --breakdown
    python3 benchmarks/bench_train.py --models hf_gpt2 --modes eager --variants autocast_fp16,half,o2_fp16 \
        --steps 10 --rounds 3 --breakdown
    python3 benchmarks/bench_train.py --models gpt --modes compile --variants autocast_fp16,o2_fp16,half \
        --isolate variant --steps 10 --rounds 3

Issue 41's runs: compiled rows in bf16 and fp16 (compile is a mode of every variant; the first
takes hf_llama_liger's max-autotune-no-cudagraphs, whose compile time is not yet measured, so it
has a budget), the Llama-3.2-1B shape (its autocast row may need an H200's memory: ~70 GiB by an
estimate, O2 ~41)::

    python3 benchmarks/bench_train.py --models hf_llama_liger --modes compile \
        --variants autocast_bf16,o2_bf16 --isolate variant --steps 10 --rounds 3 --time-budget 540
    python3 benchmarks/bench_train.py --models hf_llama_liger --modes compile --compile-mode default \
        --variants autocast_fp16,o2_fp16 --baseline autocast_fp16 --isolate variant --steps 10 --rounds 3
    python3 benchmarks/bench_train.py --models hf_llama32_1b --modes eager --steps 10 --rounds 3

CPU check that every variant runs (tiny models, Dynamo capture without Inductor; 1-2 minutes
on one core; the transformers models ~1 minute more)::

    python benchmarks/bench_train.py --small
    python benchmarks/bench_train.py --small --models hf_gpt2,hf_llama,hf_llama32_1b
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolated_runs import write_results  # noqa: E402
from kernel_breakdown import format_breakdown  # noqa: E402
from models import BUILDERS  # noqa: E402
from reporting import publish  # noqa: E402
from train_flops import step_flops  # noqa: E402
from train_measure import (  # noqa: E402
    check_liger_alone,
    measure_in_process,
    measure_in_processes,
    process_groups,
)
from train_report import (  # noqa: E402
    environment_line,
    format_table,
    steady_peaks_note,
    timing_note,
    workload_description,
)
from train_step import GPT_ADAMW, make_workload  # noqa: E402
from train_timing import (  # noqa: E402
    allocate_library_workspaces,
    prepare_variant,
    release_memory,
    short_error,
    time_steps,
)
from train_variants import (  # noqa: E402
    BASELINE,
    DEFAULT_VARIANTS,
    MODEL_BASELINES,
    MODEL_COMPILE_MODES,
    RUN_ORDER,
    VARIANTS,
    compile_mode,
    model_variants,
)

# What benchmarks/bench_trainer.py imports from here (its own loop is bench_train's).
__all__ = [
    "GPT_ADAMW",
    "VARIANTS",
    "allocate_library_workspaces",
    "main",
    "make_workload",
    "prepare_variant",
    "release_memory",
    "short_error",
    "time_steps",
    "workload_description",
]


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


# torch.compile's modes (torch._inductor.list_mode_options()).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model_defaults = "; ".join(f"{model} {'/'.join(names)}" for model, names in DEFAULT_VARIANTS.items())
    model_baselines = ", ".join(f"{name} for {model}" for model, name in MODEL_BASELINES.items())
    parser.add_argument(
        "--models",
        "--model",
        default="gpt,resnet50",
        help=f"comma list of {', '.join(BUILDERS)}, or all (default gpt,resnet50)",
    )
    parser.add_argument("--modes", default="eager,compile", help="comma list of eager, compile")
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma list of {', '.join(VARIANTS)} (default: all; the transformers models their "
        f"comparison: {model_defaults})",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; 2 with --small)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --small)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timing rounds over all variants, order reversed every other round (default 5; 1 with --small)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="override the model's batch size")
    parser.add_argument(
        "--seq-len", type=int, default=None, help="override the token models' sequence length"
    )
    parser.add_argument("--small", action="store_true", help="tiny models: checks the benchmark runs, on CPU")
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default inductor on CUDA, eager on CPU: Dynamo's capture alone, "
        "which is what can break; inductor's C++ compile takes minutes there, and a CPU run only "
        "checks that everything works)",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        choices=COMPILE_MODES,
        help="torch.compile's mode for the compiled rows, Inductor only (default: torch's default, "
        f"except {', '.join(f'{m}: {c}' for m, c in MODEL_COMPILE_MODES.items())})",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; variants that would start after this are reported as skipped (with several "
        "models each gets an equal share of what is left)",
    )
    parser.add_argument(
        "--markdown", default=None, help="append the tables to this file (e.g. BENCHMARKS.md)"
    )
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="transformers models with config.use_cache=False (default: the config's default call, "
        "which fills a key/value cache)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="after timing, profile 3 steps of each variant and print its top ROWS ops by self device "
        "time (use with --variants: where a variant's time goes)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="after timing, profile 3 steps of each variant and sum the GPU time by kind of kernel "
        "(casts, GEMM, attention, norms, ..., Triton kernels by family): a table under the main one",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help=f"the variant ratios are taken to (default {BASELINE}; {model_baselines})",
    )
    parser.add_argument(
        "--isolate",
        choices=["auto", "variant", "none"],
        default="auto",
        help="run variants in fresh processes of this script: 'variant' each alone (compiled peak "
        "memory, unhidden by other variants); 'auto' (default) the Liger variants apart from the "
        "others, where both are asked for; 'none' all in this process",
    )
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)  # a child's results, for its parent
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    args.modes = [m for m in args.modes.split(",") if m]
    for mode in args.modes:
        if mode not in ("eager", "compile"):
            parser.error(f"unknown mode {mode!r}: use eager and/or compile")
    args.models = list(BUILDERS) if args.models == "all" else [m for m in args.models.split(",") if m]
    for model_name in args.models:
        if model_name not in BUILDERS:
            parser.error(f"unknown model {model_name!r}: choose from {', '.join(BUILDERS)} or all")
    if args.seq_len is not None and "resnet50" in args.models:
        parser.error("--seq-len is for the token models: leave resnet50 out of --models")
    if args.variants is not None:
        names = [v for v in args.variants.split(",") if v]
        for name in names:
            if name not in VARIANTS:
                parser.error(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")
        args.variants = [VARIANTS[n] for n in names]
    if args.baseline is not None and args.baseline not in VARIANTS:
        parser.error(f"unknown --baseline {args.baseline!r}: choose from {', '.join(VARIANTS)}")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.steps is None:
        args.steps = 2 if args.small else 20
    if args.warmup is None:
        args.warmup = 1 if args.small else 3
    if args.rounds is None:
        args.rounds = 1 if args.small else 5
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.compile_backend is None:
        args.compile_backend = "inductor" if args.device.type == "cuda" else "eager"
    if args.compile_mode is not None and args.compile_backend != "inductor":
        parser.error(
            f"--compile-mode is Inductor's: add --compile-backend inductor (now {args.compile_backend})"
        )
    return args


@contextlib.contextmanager
def compile_settings(num_variants: int) -> Iterator[None]:
    """Every compiled variant stays alive until all are timed, and all compile the same function
    (`make_forward_loss`'s), one Dynamo cache entry each: raise Dynamo's limit of entries per
    function above the variant count (past it, Dynamo would run the function eagerly, silently).
    Recompile warnings from torch._dynamo would interleave with the table; failures are logged."""
    previous_level = logging.getLogger("torch._dynamo").level
    previous_limit = torch._dynamo.config.recompile_limit
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    # Two entries per variant: the first step compiles, the second may recompile (grads now exist).
    torch._dynamo.config.recompile_limit = max(previous_limit, 2 * num_variants + 2)
    try:
        yield
    finally:
        logging.getLogger("torch._dynamo").setLevel(previous_level)
        torch._dynamo.config.recompile_limit = previous_limit


def benchmark_model(model_name: str, args: argparse.Namespace, deadline: float | None) -> str:
    ordered = model_variants(model_name, args)
    # Most telling first, so that a run cut short by --time-budget still has the baseline and O2.
    variants = sorted(ordered, key=lambda v: RUN_ORDER.index(v.name))
    groups = process_groups(variants, args.modes, args.isolate)
    if groups is None:
        results, notes = measure_in_process(model_name, variants, args, deadline)
    else:
        results, notes = measure_in_processes(model_name, groups, args, deadline)
    if args.json:  # a child of measure_in_processes: its parent prints the table
        rows = [
            {"variant": name, "mode": mode, **dataclasses.asdict(r)} for (name, mode), r in results.items()
        ]
        write_results(args.json, rows, notes)
        return ""
    description = workload_description(model_name, args.small, args.batch_size, args.seq_len)
    mode = compile_mode(model_name, args) if "compile" in args.modes else None
    title = f"Training step: {description} - {environment_line(args.device, args.compile_backend, mode)}"
    baseline = args.baseline or MODEL_BASELINES.get(model_name, BASELINE)
    flops = step_flops(model_name, args.small, args.batch_size, args.seq_len)
    # The targets are about the full-size models on a GPU; a --small run only checks the code.
    checks = not args.small
    table = format_table(
        model_name, ordered, args.modes, results, title, flops, args.device, baseline, check_targets=checks
    )
    text = table + "\n" + timing_note(results, args, processes=len(groups or [variants])) + "\n"
    for note in notes:
        text += "\n" + note + "\n"
    if groups is not None and all(len(group.variants) == 1 for group in groups):
        text += "\n" + steady_peaks_note(results) + "\n"
    profiled = [(f"{v.name} {mode}", results.get((v.name, mode))) for mode in args.modes for v in ordered]
    profiled = [(column, r) for column, r in profiled if r is not None and r.breakdown]
    if profiled:
        unit = "GPU ms/step" if args.device.type == "cuda" else "CPU ms/step (self time of ops)"
        breakdowns = {column: r.breakdown for column, r in profiled}
        text += "\n" + format_breakdown(breakdowns, unit, {column: r.median_ms for column, r in profiled})
    return text


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    for model_name in args.models:
        check_liger_alone(model_name, model_variants(model_name, args), args.isolate)
    if args.small and args.device.type == "cpu":
        # A CPU run only checks that every variant works; on a shared machine one thread per
        # process avoids OpenMP spinning against other processes.
        torch.set_num_threads(1)
    end = None if args.time_budget is None else time.perf_counter() + args.time_budget
    tables = []
    with compile_settings(max(len(model_variants(m, args)) for m in args.models)):
        for index, model_name in enumerate(args.models):
            # An equal share of what is left of the budget: a model that runs long cannot take
            # all of the next one's.
            deadline = None
            if end is not None:
                now = time.perf_counter()
                deadline = now + (end - now) / (len(args.models) - index)
            print(
                f"{model_name}: {args.steps} timed steps after {args.warmup} warm-up, {args.device}",
                flush=True,
            )
            tables.append(benchmark_model(model_name, args, deadline))
    if args.json:
        return  # a child of measure_in_processes: the results are in the file
    text = "\n".join(tables)
    print()
    publish(text, args.markdown)


if __name__ == "__main__":
    main()
