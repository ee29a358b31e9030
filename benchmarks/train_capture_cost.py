"""What capturing a new call structure or shape costs (amp_fx's torch.export front end): a freshly
converted model's first calls, timed beside the same calls once captured.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from models import LabelsLoss
from train_step import make_forward_loss, make_workload, prepare_model
from train_timing import time_steps
from train_variants import Variant


@dataclass
class CaptureCost:
    """A converted model's first forward call (captured at static sizes), its first call at a new
    sequence length (captured again, with dynamic sizes), and each call once captured."""

    variant: str
    seq_len: int
    first_call_s: float
    capture_s: float  # of first_call_s: torch.export and amp_fx's passes (capture_summary)
    captured_call_ms: float
    new_seq_len: int
    new_first_call_s: float
    new_capture_s: float
    new_captured_call_ms: float
    graphs: int
    islands: int

    def __str__(self) -> str:
        return (
            f"Capture cost ({self.variant}, eager, forward with the loss): first call at seq "
            f"{self.seq_len} {self.first_call_s:.2f} s (capture {self.capture_s:.2f} s), then "
            f"{self.captured_call_ms:.1f} ms; first call at new seq {self.new_seq_len} "
            f"{self.new_first_call_s:.2f} s (capture {self.new_capture_s:.2f} s), then "
            f"{self.new_captured_call_ms:.1f} ms; {self.graphs} graph(s), {self.islands} island(s)."
        )


def time_first_call(call: Callable[[], torch.Tensor], device: torch.device) -> float:
    """Seconds of one call, from an idle device to its result: a capture runs once, so no loop."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure_capture_cost(
    model_name: str, variant: Variant, args: argparse.Namespace, device: torch.device
) -> CaptureCost | None:
    """Time a freshly converted model's first calls (module docstring); None where ``variant``
    converts ``model_name`` with torch.fx (the graph is made at conversion, not at a call)."""
    from amp_fx.capture.captured_model import CapturedModel
    from amp_fx.inspect.capture_summary import capture_summary

    work = make_workload(model_name, args, device)
    model = prepare_model(variant, work)
    converted = model.model if isinstance(model, LabelsLoss) else model
    if not isinstance(converted, CapturedModel):
        return None
    forward_loss = make_forward_loss(variant, model)
    tokens = work.inputs
    del work  # the unconverted original
    gc.collect()
    new_seq_len = tokens.shape[1] * 3 // 4
    measured: list[tuple[float, float, float]] = []
    for batch in (tokens, tokens[:, :new_seq_len].contiguous()):
        captured_before = sum(capture_summary(converted).capture_seconds)
        first_s = time_first_call(lambda batch=batch: forward_loss(batch, batch), device)
        capture_s = sum(capture_summary(converted).capture_seconds) - captured_before
        times = time_steps(lambda batch=batch: forward_loss(batch, batch), device, warmup=1, steps=3)
        measured.append((first_s, capture_s, statistics.median(times)))
    summary = capture_summary(converted)
    (first_s, capture_s, captured_ms), (new_first_s, new_capture_s, new_captured_ms) = measured
    return CaptureCost(
        variant.name, tokens.shape[1], first_s, capture_s, captured_ms,
        new_seq_len, new_first_s, new_capture_s, new_captured_ms, summary.graphs, len(summary.islands),
    )  # fmt: skip
