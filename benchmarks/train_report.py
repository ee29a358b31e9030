"""bench_train's report: the table of step times, ratios, peaks, model TFLOP/s and MFU per
variant and mode, the targets it checks, and the notes under it.
"""

from __future__ import annotations

import argparse

import torch
from models import HF_MODEL_CLASSES, parameter_count, token_shape
from reporting import environment
from train_flops import StepFlops, dense_peak_flops
from train_timing import Result
from train_variants import AUTOCAST_OF, BASELINE, VARIANTS, Variant


def environment_line(device: torch.device, compile_backend: str, compile_mode: str | None = None) -> str:
    """The machine, versions and date, with the compile backend and (where one is set) its mode."""
    where_and_versions, date = environment(device).rsplit(", ", 1)
    mode = f" (mode {compile_mode})" if compile_mode else ""
    return f"{where_and_versions}, compile backend {compile_backend}{mode}, {date}"


def format_table(
    model_name: str,
    variants: list[Variant],
    modes: list[str],
    results: dict[tuple[str, str], Result],
    title: str,
    flops: StepFlops,
    device: torch.device,
    baseline_name: str = BASELINE,
    check_targets: bool = True,
) -> str:
    """The table of one model: per variant and mode its step time, ratio to the baseline, peak
    memory, model TFLOP/s and MFU; what was not measured, how the FLOPs were counted, and (with
    ``check_targets``) the targets met or missed."""
    header = ["variant"]
    for mode in modes:
        columns = ("ms/step", f"vs {baseline_name}", "peak GiB", "TFLOP/s", "MFU")
        header += [f"{mode} {column}" for column in columns]
    lines = [f"#### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    errors = []
    for variant in variants:
        cells = [variant.name]
        for mode in modes:
            result = results.get((variant.name, mode))
            baseline = results.get((baseline_name, mode))
            if result is None:
                cells += ["-"] * 5
                continue
            if result.error is not None:
                errors.append(f"- {variant.name} ({mode}): {result.error}")
                cells += ["skipped" if result.error.startswith("skipped") else "failed"] + ["-"] * 4
                continue
            ratio = "-"
            if baseline is not None and baseline.median_ms:
                ratio = f"{result.median_ms / baseline.median_ms:.2f}x"
            peak = "-" if result.peak_gib is None else f"{result.peak_gib:.2f}"
            tflops = flops.total / (result.median_ms / 1e3) / 1e12
            mfu = model_flops_utilisation(flops, result, dense_peak_flops(device, variant.dtype))
            tflops_text = f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"
            mfu_text = "-" if mfu is None else f"{mfu:.1%}"
            cells += [f"{result.median_ms:.1f}", ratio, peak, tflops_text, mfu_text]
        lines.append("| " + " | ".join(cells) + " |")
    if errors:
        lines += ["", "Not measured:", *errors]
    lines += ["", f"{flops}. {peak_note(device, {v.dtype for v in variants})}"]
    checks = target_checks(model_name, modes, results, flops, device) if check_targets else []
    if checks:
        lines += ["", "Targets:", *checks]
    return "\n".join(lines) + "\n"


def model_flops_utilisation(flops: StepFlops, result: Result, peak: float | None) -> float | None:
    """The model FLOPs per second of ``result``'s median step over ``peak`` (FLOP/s); None where
    the peak or the time is not known."""
    if peak is None or not result.median_ms:
        return None
    return flops.total / (result.median_ms / 1e3) / peak


def peak_note(device: torch.device, dtypes: set[torch.dtype]) -> str:
    """Which dense peak MFU is taken against, per dtype of the table's rows, or why there is none."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "a CPU"
    known = {dtype: dense_peak_flops(device, dtype) for dtype in sorted(dtypes, key=str)}
    stated = [f"{str(d).removeprefix('torch.')} {p / 1e12:.0f}" for d, p in known.items() if p is not None]
    unknown = [str(d).removeprefix("torch.") for d, p in known.items() if p is None]
    text = "TFLOP/s: those FLOPs over the median step."
    if stated:
        text += f" MFU: TFLOP/s over {where}'s dense peak ({', '.join(stated)} TFLOP/s)."
    if unknown:
        text += f" No MFU for {', '.join(unknown)} on {where}: its dense peak is not known."
    return text


# An O2 row's step time as a fraction of the autocast row's of its dtype in the same run, by model,
# mode and O2 row, with the issue each target comes from (DESIGN.md, Performance).
TIME_TARGETS: dict[tuple[str, str, str], tuple[float, int]] = {
    ("gpt", "eager", "o2_fp16"): (0.85, 5),
    ("gpt", "compile", "o2_fp16"): (0.90, 5),
    ("resnet50", "eager", "o2_fp16"): (0.95, 5),
    ("resnet50", "compile", "o2_fp16"): (0.90, 5),
    ("hf_gpt2", "eager", "o2_fp16"): (0.50, 41),
    ("hf_gpt2", "compile", "o2_fp16"): (0.72, 41),
    ("hf_llama", "eager", "o2_fp16"): (0.80, 12),
    ("hf_llama", "compile", "o2_fp16"): (0.90, 12),
    ("hf_llama_liger", "eager", "o2_bf16"): (0.57, 41),
    ("hf_llama_liger", "compile", "o2_bf16"): (0.70, 41),
    ("hf_llama32_1b", "eager", "o2_bf16"): (0.60, 41),
}
# An O2 row's model FLOPs utilisation at least this.
MFU_TARGETS: dict[tuple[str, str, str], tuple[float, int]] = {
    ("hf_llama32_1b", "eager", "o2_bf16"): (0.55, 41),
}


def target_checks(
    model_name: str,
    modes: list[str],
    results: dict[tuple[str, str], Result],
    flops: StepFlops,
    device: torch.device,
) -> list[str]:
    """One line per target of the rows measured: an O2 row's time against the autocast row of its
    dtype (`TIME_TARGETS`), its MFU (`MFU_TARGETS`), and every O2 row's peak memory against the
    autocast row's of its dtype."""
    checks = []
    for (name, mode), result in results.items():
        variant = VARIANTS[name]
        autocast_name = AUTOCAST_OF.get(variant.dtype)
        autocast = results.get((autocast_name, mode))
        if variant.opt_level != "O2" or result.median_ms is None:
            continue
        if (model_name, mode, name) in TIME_TARGETS and autocast is not None and autocast.median_ms:
            target, issue = TIME_TARGETS[(model_name, mode, name)]
            ratio = result.median_ms / autocast.median_ms
            verdict = "met" if ratio <= target else "missed"
            checks.append(
                f"- {mode}: {name} takes {ratio:.2f}x {autocast_name}'s time "
                f"(issue {issue}: <= {target}): {verdict}"
            )
        if (model_name, mode, name) in MFU_TARGETS:
            target, issue = MFU_TARGETS[(model_name, mode, name)]
            mfu = model_flops_utilisation(flops, result, dense_peak_flops(device, variant.dtype))
            if mfu is None:
                verdict = "unchecked, no dense peak known here"
            else:
                verdict = f"{mfu:.1%}, " + ("met" if mfu >= target else "missed")
            checks.append(f"- {mode}: {name} MFU (issue {issue}: >= {target:.0%}): {verdict}")
        if autocast is not None and result.peak_gib is not None and autocast.peak_gib is not None:
            verdict = "met" if result.peak_gib <= autocast.peak_gib else "missed"
            checks.append(
                f"- {mode}: {name} peak {result.peak_gib:.2f} GiB vs {autocast_name} "
                f"{autocast.peak_gib:.2f} GiB (issue 41: <=): {verdict}"
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
