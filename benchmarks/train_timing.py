"""Timing bench_train's variants: each built and warmed up (compiles, CUDA-graph capture) with its
peak memory, then all timed in rounds, the order reversed every other round.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from liger import unavailable_reason as liger_unavailable_reason
from models import hf_model_type
from train_step import GRAPH_WARMUP_STEPS, build_step, make_workload
from train_variants import Variant, compile_mode

logger = logging.getLogger("bench_train")


@dataclass
class Result:
    median_ms: float | None = None
    peak_gib: float | None = None
    setup_s: float = 0.0
    error: str | None = None
    step_ms: list[float] = field(default_factory=list)  # every timed step, all rounds
    round_ms: list[float] = field(default_factory=list)  # median of each round
    # --breakdown: milliseconds per step by kind of kernel (benchmarks/kernel_breakdown.py).
    breakdown: dict[str, float] | None = None
    # Memory allocated before the variant was built, and its peak above that in the timed steps
    # (steady state, no compile); meaningful where the variant ran alone (--isolate variant).
    allocated_before: int = 0
    timed_peak_gib: float | None = None

    @property
    def round_spread(self) -> float:
        """(slowest - fastest round median) / median: how much the order moved this variant."""
        if len(self.round_ms) < 2 or not self.median_ms:
            return 0.0
        return (max(self.round_ms) - min(self.round_ms)) / self.median_ms


def time_steps(
    step: Callable[[], torch.Tensor], device: torch.device, warmup: int, steps: int
) -> list[float]:
    """Milliseconds of each of ``steps`` steps after ``warmup`` untimed ones. On CUDA, events between
    consecutive steps with no sync in between, so a step's time includes any host-side gap (launch
    overhead shows up, as it does in training)."""
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    torch.cuda.synchronize(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    events[0].record()
    for i in range(steps):
        step()
        events[i + 1].record()
    torch.cuda.synchronize(device)
    return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]


def profile_steps(step: Callable[[], torch.Tensor], device: torch.device, rows: int) -> str:
    """Three more steps under torch.profiler: the ops with the most self time on the device."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    sort_by = "self_cpu_time_total"
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort_by = "self_device_time_total"
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return profiler.key_averages().table(sort_by=sort_by, row_limit=rows)


def release_memory(device: torch.device) -> None:
    """Drop everything the previous mode's variants left: compiled graphs, cached blocks, peaks."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocate_library_workspaces(device: torch.device) -> None:
    """Allocate cuBLAS's workspaces before the first variant is built, so that no variant's peak
    counts them. cuBLAS keeps one per handle and stream, allocated on first use and kept for the
    life of the process; the forward runs on this thread's handle and the backward on the autograd
    engine's, so one small linear forward and backward per dtype creates them all."""
    if device.type != "cuda":
        return
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        weight = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        torch.nn.functional.linear(weight, weight, weight[0]).sum().backward()
    torch.cuda.synchronize(device)


def short_error(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line[:100]}"


def prepare_variant(
    model_name: str,
    variant: Variant,
    mode: str,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[Result, Callable[[], torch.Tensor] | None]:
    """Build one variant's step and run its warm-up steps (compiles, CUDA-graph capture).

    Returns its result so far (peak memory, setup time, or the error) and the step, None on error.
    Variants built earlier stay alive, so the peak is counted from the memory allocated before this
    one was built: its own weights, optimizer state, grads and activations.
    """
    result = Result()
    start = time.perf_counter()
    # Garbage of earlier variants (compiler objects in reference cycles hold tensors) goes first:
    # freed while this variant is measured, it would lower this variant's apparent peak.
    gc.collect()
    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    result.allocated_before = allocated_before
    step = None
    try:
        if variant.liger:
            reason = liger_unavailable_reason(hf_model_type(model_name), device.type)
            if reason is not None:
                result.error = f"skipped: {reason}"
                return result, None
        if not variant.kv_cache and hf_model_type(model_name) is None:
            result.error = f"skipped: {model_name} fills no key/value cache (a transformers comparison)"
            return result, None
        work = make_workload(model_name, args, device, variant.kv_cache, variant.liger)
        # bench_trainer's arguments have no compile mode: it builds eager steps only.
        torch_compile_mode = compile_mode(model_name, args) if mode == "compile" else None
        step = build_step(variant, work, mode, args.compile_backend, torch_compile_mode)
        # The step holds what it needs; amp_fx's unconverted original goes now, and the peak counts
        # from here: weights, optimizer state and activations of training, not conversion copies.
        del work
        gc.collect()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # Under torch.compile the first step compiles; the second may recompile (grads now exist).
        warmup = args.warmup if mode == "eager" or args.small else max(args.warmup, 2)
        if variant.cuda_graph:
            warmup = max(warmup, GRAPH_WARMUP_STEPS + 1)
        for _ in range(warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            result.peak_gib = (torch.cuda.max_memory_allocated(device) - allocated_before) / 2**30
    except Exception as exc:  # a failing variant is a row of the table, not the end of the run
        logger.exception("%s %s %s failed", model_name, variant.name, mode)
        result.error = short_error(exc)
        step = None
    result.setup_s = time.perf_counter() - start
    return result, step


def time_interleaved(
    steps: dict[str, Callable[[], torch.Tensor]],
    results: dict[str, Result],
    args: argparse.Namespace,
    device: torch.device,
    deadline: float | None,
) -> None:
    """Time every built variant in ``args.rounds`` rounds, the order reversed every other round.

    A GPU slows as it heats up or reaches its power limit, so a variant timed later in a run can
    be slower for that alone (on an H200 running GPT-2, ~1 ms of 34 between the first and the last
    place of a round). Alternating rounds give every variant each place; the median of all its
    steps is its time, and the spread of its round medians says how much the order moved it.
    After ``deadline`` no further round starts (every variant keeps the same number of rounds); a
    variant that fails is reported and left out of the rounds after.
    """
    names = list(steps)
    for round_index in range(args.rounds):
        if round_index > 0 and deadline is not None and time.perf_counter() > deadline:
            break
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            result = results[name]
            if result.error is not None:
                continue
            # Other variants' garbage is collected here, not during this variant's timed steps.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            try:
                # Two untimed steps after switching variants: caches and clocks settle for this one.
                times = time_steps(steps[name], device, warmup=2, steps=args.steps)
            except Exception as exc:  # a failing variant is a row of the table, not the end of the run
                logger.exception("%s failed while timed", name)
                result.error = short_error(exc)
                continue
            result.step_ms += times
            if device.type == "cuda":
                peak = (torch.cuda.max_memory_allocated(device) - result.allocated_before) / 2**30
                result.timed_peak_gib = max(peak, result.timed_peak_gib or 0.0)
            result.round_ms.append(statistics.median(times))
    for result in results.values():
        if result.error is None and result.step_ms:
            result.median_ms = statistics.median(result.step_ms)
