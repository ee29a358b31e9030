"""Training through Hugging Face's Trainer: `AmpTrainer` at O2 against ``Trainer(fp16=True)`` /
``Trainer(bf16=True)``, and bench_train's own loop for the same variant.

The models and batches are bench_train's (benchmarks/models.py): ``hf_gpt2`` (``GPT2LMHeadModel``,
124M, 16 x 1024 tokens) and ``hf_llama`` (``LlamaForCausalLM``, 0.67B, 8 x 2048), random weights
from configs, the same seeded model and batch for every row; the dataset is that batch's rows,
repeated, in memory. Rows, per dtype (``--dtypes``):

    trainer           transformers.Trainer(fp16=True / bf16=True): accelerate's autocast and
                      GradScaler (fp16), torch's fused AdamW (``optim="adamw_torch_fused"``)
    amp_trainer       amp_fx.integrations.transformers.AmpTrainer, the same TrainingArguments,
                      opt_level="O2": the converted model, amp_fx's FusedAdam with FP32 masters,
                      amp_fx's LossScaler (fp16)
    loop_o2           bench_train's own loop for o2_fp16 / o2_bf16: no Trainer, no clipping
    loop_autocast     bench_train's own loop for autocast_fp16 / autocast_bf16

Both Trainer rows use bench_train's AdamW hyperparameters (lr 3e-4, betas 0.9/0.95, eps 1e-8,
weight decay 0.1), a constant learning rate, ``max_grad_norm`` 1.0 (the Trainer's default;
``--max-grad-norm 0`` turns clipping off, though the Trainer still measures the norm every step),
``logging_nan_inf_filter=False`` and ``accelerator_config={"non_blocking": True}``: by default the
Trainer reads every step's loss on the host to filter NaNs and copies each batch to the GPU with a
blocking copy, two waits per step for the step before, which bench_train's loop does not have
(``--trainer-defaults`` keeps both). A
Trainer row is timed by CUDA events recorded at each step's end (``on_step_end``, no sync in
between); each round is one ``trainer.train()`` of ``--warmup`` + ``--steps`` steps, of which the
last ``--steps`` count. The rows of a dtype are built first, then timed in ``--rounds`` rounds, the
order reversed every other round, as bench_train does; each row's time is the median of all its
timed steps. The table ends with AmpTrainer's step against bench_train's loop for the same variant
(target: at most 1.05x) and against the Trainer's own mixed precision.

On the H200 (eager only; about 5 minutes for both models and dtypes)::

    python benchmarks/bench_trainer.py --models hf_gpt2,hf_llama --markdown BENCHMARKS.md

A CPU check that every row runs (tiny models, a minute or two)::

    python benchmarks/bench_trainer.py --small --steps 3
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import (  # noqa: E402
    GPT_ADAMW,
    VARIANTS,
    allocate_library_workspaces,
    make_workload,
    prepare_variant,
    release_memory,
    short_error,
    time_steps,
    workload_description,
)
from models import HF_MODEL_CLASSES  # noqa: E402
from reporting import environment, publish  # noqa: E402

logger = logging.getLogger("bench_trainer")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ROWS = ("trainer", "amp_trainer", "loop_o2", "loop_autocast")
# What 'AmpTrainer's step over bench_train's loop for the same variant' must not exceed (issue 26).
TARGET = 1.05


@dataclass
class Timing:
    """One row: every timed step (ms), each round's median, peak memory; or why it has none."""

    step_ms: list[float] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)
    peak_gib: float | None = None
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.step_ms) if self.step_ms and self.error is None else None


def row_label(row: str, dtype: str) -> str:
    return {
        "trainer": f"Trainer({dtype}=True)",
        "amp_trainer": f"AmpTrainer O2 {dtype}",
        "loop_o2": f"bench_train o2_{dtype}",
        "loop_autocast": f"bench_train autocast_{dtype}",
    }[row]


# ---------------------------------------------------------------------------------------------
# Trainer rows
# ---------------------------------------------------------------------------------------------


class RepeatedBatch(torch.utils.data.Dataset):
    """The workload's batch, row by row, ``repeats`` times: what the Trainer's dataloader batches."""

    def __init__(self, tokens: torch.Tensor, repeats: int) -> None:
        self.tokens, self.repeats = tokens.cpu(), repeats

    def __len__(self) -> int:
        return len(self.tokens) * self.repeats

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.tokens[index % len(self.tokens)]
        return {"input_ids": row, "labels": row}


def step_timer(device: torch.device, first: int, last: int) -> Any:
    """A TrainerCallback marking the end of each step from ``first`` to ``last`` (global step):
    CUDA events without a sync on a GPU, the host clock elsewhere."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[Any] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if first <= state.global_step <= last:
                if device.type == "cuda":
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    self.marks.append(event)
                else:
                    self.marks.append(time.perf_counter())

        def step_ms(self) -> list[float]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                times = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
            else:
                times = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
            self.marks = []
            return times

    return StepTimer()


def build_trainer(row: str, dtype: str, model_name: str, args: argparse.Namespace, output_dir: str) -> Any:
    """A Trainer (or AmpTrainer) over the workload's model and batch, one train() = one round."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from amp_fx.integrations.transformers import AmpTrainer

    work = make_workload(model_name, args, args.device)
    steps = args.warmup + args.steps
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=work.inputs.shape[0],
        learning_rate=GPT_ADAMW["lr"],
        adam_beta1=GPT_ADAMW["betas"][0],
        adam_beta2=GPT_ADAMW["betas"][1],
        adam_epsilon=GPT_ADAMW["eps"],
        weight_decay=GPT_ADAMW["weight_decay"],
        optim="adamw_torch_fused",
        lr_scheduler_type="constant",
        max_grad_norm=args.max_grad_norm,
        logging_nan_inf_filter=args.trainer_defaults,
        accelerator_config={"non_blocking": not args.trainer_defaults},
        logging_steps=10**9,  # no logging inside the timed window
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=args.device.type == "cpu",
        seed=0,
        **{dtype: True},
    )
    timer = step_timer(args.device, args.warmup, steps)
    dataset = RepeatedBatch(work.inputs, steps)
    if row == "amp_trainer":
        trainer = AmpTrainer(
            model=work.model, args=training_args, train_dataset=dataset, callbacks=[timer], opt_level="O2"
        )
    else:
        trainer = Trainer(model=work.model, args=training_args, train_dataset=dataset, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # its lines (one per train() call) would bury the table
    del work  # AmpTrainer trains a converted copy; the original's tensors go (Trainer keeps its own)
    gc.collect()

    def one_round() -> list[float]:
        trainer.train()
        return timer.step_ms()

    return one_round


# ---------------------------------------------------------------------------------------------
# Building and timing the rows of one dtype
# ---------------------------------------------------------------------------------------------


def build_row(
    row: str, dtype: str, model_name: str, args: argparse.Namespace, output_dir: str
) -> tuple[Timing, Callable[[], list[float]] | None]:
    """Build one row and run its warm-up; returns its timing so far and one round of it."""
    timing = Timing()
    gc.collect()
    allocated_before = torch.cuda.memory_allocated(args.device) if args.device.type == "cuda" else 0
    try:
        if row.startswith("loop_"):
            name = f"{'o2' if row == 'loop_o2' else 'autocast'}_{dtype}"
            result, step = prepare_variant(model_name, VARIANTS[name], "eager", args, args.device)
            if step is None:
                timing.error = result.error
                return timing, None
            timing.peak_gib = result.peak_gib

            def one_round() -> list[float]:
                return time_steps(step, args.device, warmup=2, steps=args.steps)

            return timing, one_round
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        one_round = build_trainer(row, dtype, model_name, args, output_dir)
        one_round()  # the warm-up round: capture (AmpTrainer), cuBLAS and allocator warm-up
        if args.device.type == "cuda":
            timing.peak_gib = (torch.cuda.max_memory_allocated(args.device) - allocated_before) / 2**30
        return timing, one_round
    except Exception as exc:  # a failing row is a row of the table, not the end of the run
        logger.exception("%s %s %s failed", model_name, row, dtype)
        timing.error = short_error(exc)
        return timing, None


def benchmark_dtype(model_name: str, dtype: str, args: argparse.Namespace) -> dict[str, Timing]:
    import tempfile

    timings: dict[str, Timing] = {}
    rounds: dict[str, Callable[[], list[float]]] = {}
    allocate_library_workspaces(args.device)
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as output_dir:
        for row in ROWS:
            start = time.perf_counter()
            timing, one_round = build_row(row, dtype, model_name, args, output_dir)
            timings[row] = timing
            if one_round is not None:
                rounds[row] = one_round
            status = timing.error or "built"
            print(
                f"  {model_name} {row_label(row, dtype):26s} {status} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        names = list(rounds)
        for index in range(args.rounds):
            for row in names if index % 2 == 0 else names[::-1]:
                if timings[row].error is not None:
                    continue
                gc.collect()
                try:
                    times = rounds[row]()
                except Exception as exc:
                    logger.exception("%s %s %s failed while timed", model_name, row, dtype)
                    timings[row].error = short_error(exc)
                    continue
                timings[row].step_ms += times
                timings[row].round_ms.append(statistics.median(times))
        for row in names:
            timing = timings[row]
            if timing.median_ms is not None:
                rounds_text = ", ".join(f"{ms:.2f}" for ms in timing.round_ms)
                label = row_label(row, dtype)
                print(
                    f"  {model_name} {label:26s} {timing.median_ms:.2f} ms/step (rounds {rounds_text})",
                    flush=True,
                )
        rounds.clear()  # frees the models, optimizers and trainers of this dtype
    release_memory(args.device)
    return timings


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def format_table(model_name: str, results: dict[str, dict[str, Timing]], args: argparse.Namespace) -> str:
    import transformers

    description = workload_description(model_name, args.small, args.batch_size, args.seq_len)
    versions = f"{environment(args.device)}, transformers {transformers.__version__}"
    title = f"Training through the Trainer: {description} - {versions}"
    lines = [f"#### {title}", "", "| row | ms/step | steps/s | peak GiB |", "|---|---|---|---|"]
    notes, checks = [], []
    for dtype, timings in results.items():
        for row in ROWS:
            timing = timings[row]
            if timing.median_ms is None:
                lines.append(f"| {row_label(row, dtype)} | failed | - | - |")
                notes.append(f"- {row_label(row, dtype)}: {timing.error}")
                continue
            peak = "-" if timing.peak_gib is None else f"{timing.peak_gib:.2f}"
            speed = f"{timing.median_ms:.1f} | {1e3 / timing.median_ms:.2f}"
            lines.append(f"| {row_label(row, dtype)} | {speed} | {peak} |")
        amp, loop, trainer = (timings[r].median_ms for r in ("amp_trainer", "loop_o2", "trainer"))
        if amp is not None and loop is not None:
            # The target is the full-size models' on a GPU; a --small run only checks the code.
            verdict = "met" if amp / loop <= TARGET else "missed"
            target = "no target for a CPU check" if args.small else f"target <= {TARGET}: {verdict}"
            checks.append(
                f"- {dtype}: AmpTrainer's step is {amp / loop:.3f}x bench_train's o2_{dtype} loop ({target})"
            )
        if amp is not None and trainer is not None:
            checks.append(
                f"- {dtype}: AmpTrainer O2 runs {trainer / amp:.2f}x the steps/s of Trainer({dtype}=True)"
            )
    clipping = f"max_grad_norm {args.max_grad_norm:g}" if args.max_grad_norm else "no clipping"
    filtering = (
        "the Trainer's NaN filter and blocking batch copies (host syncs per step)"
        if args.trainer_defaults
        else "logging_nan_inf_filter=False, non-blocking batch copies"
    )
    lines += [
        "",
        f"Trainer rows: {clipping}, {filtering}. Each time: median of {args.rounds} round(s) x "
        f"{args.steps} steps after warm-up, rows timed in turn, order reversed every other round.",
    ]
    return "\n".join([*lines, "", *checks, *(["", "Not measured:", *notes] if notes else [])]) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", default="hf_gpt2,hf_llama", help=f"comma list of {', '.join(HF_MODEL_CLASSES)}"
    )
    parser.add_argument("--dtypes", default="fp16,bf16", help="comma list of fp16, bf16")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per round (default 10; 3 with --small)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --small)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 3; 1 with --small)")
    parser.add_argument("--batch-size", type=int, default=None, help="override the model's batch size")
    parser.add_argument("--seq-len", type=int, default=None, help="override the sequence length")
    parser.add_argument(
        "--small", "--tiny", action="store_true", help="tiny models: checks every row runs, on CPU"
    )
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="the Trainer rows' clipping (0: none)"
    )
    parser.add_argument(
        "--trainer-defaults",
        action="store_true",
        help="keep the Trainer's per-step NaN filter and blocking batch copies (each a host sync per step)",
    )
    parser.add_argument("--device", default=None, help="default cuda when available, else cpu")
    parser.add_argument(
        "--markdown", default=None, help="append the tables to this file (e.g. BENCHMARKS.md)"
    )
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    for model_name in args.models:
        if model_name not in HF_MODEL_CLASSES:
            parser.error(f"unknown model {model_name!r}: choose from {', '.join(HF_MODEL_CLASSES)}")
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    for dtype in args.dtypes:
        if dtype not in DTYPES:
            parser.error(f"unknown dtype {dtype!r}: use fp16 and/or bf16")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.steps = args.steps if args.steps is not None else (3 if args.small else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 3)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.small else 3)
    if min(args.steps, args.rounds, args.warmup) < 1:
        parser.error("--steps, --warmup and --rounds must be at least 1")
    # What bench_train's helpers read (make_workload, prepare_variant).
    args.no_kv_cache, args.compile_backend = False, "eager"
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    if args.small and args.device.type == "cpu":
        torch.set_num_threads(1)  # as bench_train --small: no OpenMP spinning against other processes
    tables = []
    for model_name in args.models:
        print(
            f"{model_name}: {args.rounds} round(s) of {args.steps} timed steps after {args.warmup}, "
            f"{args.device}",
            flush=True,
        )
        results = {dtype: benchmark_dtype(model_name, dtype, args) for dtype in args.dtypes}
        tables.append(format_table(model_name, results, args))
    print()
    publish("\n".join(tables), args.markdown)


if __name__ == "__main__":
    main()
