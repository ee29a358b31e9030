"""Measuring one model's variants: in this process (built, timed, profiled, the capture cost),
or in groups, each in a fresh process of bench_train.py (benchmarks/isolated_runs.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch
from isolated_runs import Group, run_groups
from kernel_breakdown import profile_breakdown
from train_capture_cost import measure_capture_cost
from train_timing import (
    Result,
    allocate_library_workspaces,
    prepare_variant,
    profile_steps,
    release_memory,
    time_interleaved,
)
from train_variants import Variant

logger = logging.getLogger("bench_train")
# The script each group's process runs: bench_train.py, with the parent's options.
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_train.py")


def measure_in_process(
    model_name: str, variants: list[Variant], args: argparse.Namespace, deadline: float | None
) -> tuple[dict[tuple[str, str], Result], list[str]]:
    """Build, time (and with --breakdown profile) ``variants`` of one model in this process: the
    results by (variant, mode), and notes for under the table (the capture cost)."""
    notes: list[str] = []
    results: dict[tuple[str, str], Result] = {}
    for mode in args.modes:
        built: dict[str, Callable[[], torch.Tensor]] = {}
        mode_results: dict[str, Result] = {}
        allocate_library_workspaces(args.device)
        for variant in variants:
            if variant.cuda_graph and mode != "eager":
                continue  # a graph of a compiled model is torch.compile(mode="reduce-overhead")'s job
            if variant.cuda_graph and args.device.type != "cuda":
                results[(variant.name, mode)] = Result(error="skipped: CUDA graphs need a CUDA device")
                continue
            if deadline is not None and time.perf_counter() > deadline:
                results[(variant.name, mode)] = Result(error="skipped: --time-budget spent")
                continue
            result, step = prepare_variant(model_name, variant, mode, args, args.device)
            results[(variant.name, mode)] = result
            if step is not None:
                built[variant.name] = step
                mode_results[variant.name] = result
            status = result.error or "built" + (
                f", peak {result.peak_gib:.2f} GiB" if result.peak_gib is not None else ""
            )
            line = f"  {model_name} {mode:7s} {variant.name:18s} {status} ({result.setup_s:.0f} s)"
            print(line, flush=True)
        time_interleaved(built, mode_results, args, args.device, deadline)
        for name, result in mode_results.items():
            if result.error is not None:
                print(f"  {model_name} {mode:7s} {name:18s} {result.error}", flush=True)
                continue
            print(
                f"  {model_name} {mode:7s} {name:18s} {result.median_ms:.2f} ms/step "
                f"(rounds {', '.join(f'{ms:.2f}' for ms in result.round_ms)})",
                flush=True,
            )
            try:  # the timing stands; the profiles are extra
                if args.profile:
                    print(profile_steps(built[name], args.device, args.profile), flush=True)
                if args.breakdown:
                    result.breakdown = profile_breakdown(built[name], args.device)
            except Exception:
                logger.exception("%s failed while profiled", name)
        built.clear()  # frees the models, optimizer states and compiled graphs of this mode
        release_memory(args.device)
        converting = [v for v in variants if v.framework == "amp_fx" and not v.cuda_graph]
        in_time = deadline is None or time.perf_counter() < deadline
        if mode == "eager" and converting and in_time:
            capture_cost = None
            try:
                capture_cost = measure_capture_cost(model_name, converting[0], args, args.device)
            except Exception:  # the step times stand; the capture cost is extra
                logger.exception("%s: measuring the capture cost failed", model_name)
            if capture_cost is not None:
                print(f"  {model_name} {capture_cost}", flush=True)
                notes.append(str(capture_cost))
            release_memory(args.device)
    return results, notes


def process_groups(variants: list[Variant], modes: list[str], isolate: str) -> list[Group] | None:
    """What each process runs (``--isolate``), None: everything in this one.

    ``auto`` separates the Liger variants from the others, only where both are asked for;
    ``variant`` gives every variant in every mode a process.
    """
    if isolate == "variant":
        return [Group([v.name], [mode]) for mode in modes for v in variants]
    liger_names = [v.name for v in variants if v.liger]
    if isolate == "none" or not liger_names or len(liger_names) == len(variants):
        return None
    return [Group([v.name for v in variants if not v.liger], modes), Group(liger_names, modes)]


def measure_in_processes(
    model_name: str, groups: list[Group], args: argparse.Namespace, deadline: float | None
) -> tuple[dict[tuple[str, str], Result], list[str]]:
    """`measure_in_process` of each group in a fresh process of bench_train.py (isolated_runs.py)."""
    rows, notes = run_groups(SCRIPT, args.argv, model_name, groups, deadline)
    result_fields = {f.name for f in dataclasses.fields(Result)}
    results: dict[tuple[str, str], Result] = {}
    for row in rows:
        results[(row["variant"], row["mode"])] = Result(
            **{k: v for k, v in row.items() if k in result_fields}
        )
    return results, notes


def check_liger_alone(model_name: str, variants: list[Variant], isolate: str) -> None:
    """Liger's patch holds for the whole process: refuse to run its variants beside others in one."""
    if isolate == "none" and any(v.liger for v in variants) and not all(v.liger for v in variants):
        raise SystemExit(
            f"{model_name}: the Liger variants patch transformers for the whole process, so they cannot "
            "run beside the others in one: leave --isolate at auto (each group its own process)"
        )
