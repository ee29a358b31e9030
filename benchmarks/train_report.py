"""bench_train's report: the table of step times, ratios and peaks per variant and mode, the
targets it checks, and the notes under it.
"""

from __future__ import annotations

import argparse

import torch
from models import HF_MODEL_CLASSES, parameter_count, token_shape
from reporting import environment
from train_timing import Result
from train_variants import BASELINE, Variant


def environment_line(device: torch.device, compile_backend: str) -> str:
    where_and_versions, date = environment(device).rsplit(", ", 1)
    return f"{where_and_versions}, compile backend {compile_backend}, {date}"


def format_table(
    model_name: str,
    variants: list[Variant],
    modes: list[str],
    results: dict[tuple[str, str], Result],
    title: str,
    baseline_name: str = BASELINE,
    check_targets: bool = True,
) -> str:
    header = ["variant"]
    for mode in modes:
        header += [f"{mode} ms/step", f"{mode} vs {baseline_name}", f"{mode} peak GiB"]
    lines = [f"#### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    errors = []
    for variant in variants:
        cells = [variant.name]
        for mode in modes:
            result = results.get((variant.name, mode))
            baseline = results.get((baseline_name, mode))
            if result is None:
                cells += ["-", "-", "-"]
                continue
            if result.error is not None:
                errors.append(f"- {variant.name} ({mode}): {result.error}")
                cells += ["skipped" if result.error.startswith("skipped") else "failed", "-", "-"]
                continue
            ratio = "-"
            if baseline is not None and baseline.median_ms:
                ratio = f"{result.median_ms / baseline.median_ms:.2f}x"
            peak = "-" if result.peak_gib is None else f"{result.peak_gib:.2f}"
            cells += [f"{result.median_ms:.1f}", ratio, peak]
        lines.append("| " + " | ".join(cells) + " |")
    if errors:
        lines += ["", "Not measured:", *errors]
    checks = target_checks(model_name, modes, results) if check_targets else []
    if checks:
        lines += ["", f"Targets (issue {TARGET_ISSUES[model_name]}):", *checks]
    return "\n".join(lines) + "\n"


# O2 fp16's step time as a fraction of autocast fp16's in the same run (DESIGN.md, Performance).
TIME_TARGETS = {
    ("gpt", "eager"): 0.85,
    ("gpt", "compile"): 0.90,
    ("resnet50", "eager"): 0.95,
    ("resnet50", "compile"): 0.90,
    ("hf_gpt2", "eager"): 0.80,
    ("hf_gpt2", "compile"): 0.90,
    ("hf_llama", "eager"): 0.80,
    ("hf_llama", "compile"): 0.90,
}
# The issue each model's targets come from.
TARGET_ISSUES = {"gpt": 5, "resnet50": 5, "hf_gpt2": 12, "hf_llama": 12}


def target_checks(model_name: str, modes: list[str], results: dict[tuple[str, str], Result]) -> list[str]:
    """One line per target: o2_fp16's time ratio and peak memory against autocast_fp16's."""
    checks = []
    for mode in modes:
        if (model_name, mode) not in TIME_TARGETS:
            continue  # a comparison without targets (hf_llama_liger: issue 25's)
        o2, baseline = results.get(("o2_fp16", mode)), results.get((BASELINE, mode))
        if o2 is None or baseline is None or o2.median_ms is None or baseline.median_ms is None:
            continue
        target = TIME_TARGETS[(model_name, mode)]
        ratio = o2.median_ms / baseline.median_ms
        verdict = "met" if ratio <= target else "missed"
        checks.append(
            f"- {mode}: o2_fp16 takes {ratio:.2f}x autocast_fp16's time (target <= {target}): {verdict}"
        )
        if o2.peak_gib is not None and baseline.peak_gib is not None:
            verdict = "met" if o2.peak_gib <= baseline.peak_gib else "missed"
            checks.append(
                f"- {mode}: o2_fp16 peak {o2.peak_gib:.2f} GiB vs autocast_fp16 {baseline.peak_gib:.2f} GiB "
                f"(target <=): {verdict}"
            )
    return checks


def workload_description(model_name: str, small: bool, batch_size: int | None, seq_len: int | None) -> str:
    if model_name in HF_MODEL_CLASSES:
        batch, seq = token_shape(model_name, small, batch_size, seq_len)
        size = parameter_count(model_name, small, seq_len)
        size_text = f"{size / 1e9:.2f}B" if size >= 1e9 else f"{size / 1e6:.3g}M"
        return (
            f"transformers {HF_MODEL_CLASSES[model_name]} {size_text} from config, loss from labels=, "
            f"batch {batch} x seq {seq}" + (" (CPU check)" if small else "")
        )
    if model_name == "gpt":
        batch, seq = token_shape(model_name, small, batch_size, seq_len)
        return "GPT tiny (CPU check)" if small else f"GPT-2 small 124M, batch {batch} x seq {seq}"
    if small:
        return "ResNet (Bottleneck [1,1,1,1], 16x16, CPU check)"
    return f"ResNet-50, batch {batch_size or 256} x 224x224, channels_last"


def steady_peaks_note(results: dict[tuple[str, str], Result]) -> str:
    """Each variant's peak memory in its timed steps, measured alone: the table's peak also
    covers the warm-up steps, which compile (torch.compile) or capture (amp_fx)."""
    peaks = [
        f"{name} {mode} {r.timed_peak_gib:.2f}" for (name, mode), r in results.items() if r.timed_peak_gib
    ]
    if not peaks:
        return "Peak memory in the timed steps: not measured (no CUDA device)."
    return (
        "Every variant ran alone in its process. Peak GiB in the timed steps (steady state; the "
        f"table's peak also covers the warm-up, with its compile): {', '.join(peaks)}."
    )


def timing_note(results: dict[tuple[str, str], Result], args: argparse.Namespace, processes: int = 1) -> str:
    """How the times were taken, and the largest effect of the order within a round."""
    rounds = max((len(r.round_ms) for r in results.values()), default=0)
    note = (
        f"Each time: median of {rounds} round(s) x {args.steps} steps after warm-up, all variants "
        "of a mode built first, then timed in turn, the order reversed every other round."
    )
    if processes > 1:
        note += (
            f" The variants ran in {processes} processes, one after the other: ratios across "
            "processes also carry the GPU's drift between them (clocks, temperature)."
        )
    spreads = [(r.round_spread, name, mode) for (name, mode), r in results.items() if r.round_ms]
    if rounds > 1 and spreads:
        spread, name, mode = max(spreads)
        note += f" Largest spread of a variant's round medians: {spread:.1%} ({name}, {mode})."
    return note
