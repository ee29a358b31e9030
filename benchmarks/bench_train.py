"""End-to-end training-step benchmark: torch's mixed precision against amp_fx O1/O2/O3.

Models (``--models``, benchmarks/models.py): ``gpt`` (GPT-2 small written out by hand),
``resnet50``, and three Hugging Face transformers causal LMs from configs, random weights:
``hf_gpt2`` (``GPT2LMHeadModel(GPT2Config())``, 124M, 16 x 1024 tokens), ``hf_llama`` (Llama
architecture, 0.67B, 8 x 2048 tokens) and ``hf_llama_liger`` (the Llama of Liger-Kernel's
comparison, 0.50B, 8 x 2048 tokens); ``--batch-size``/``--seq-len`` change the shape. The
transformers models train on their own loss (``model(input_ids=..., labels=...).loss``); amp_fx
converts them with its torch.export front end (`amp_fx.captured_model`), which captures a graph at
the first call and another at the first call of a new shape. For those, after the eager timing, the
first call of a freshly converted model and its first call at 3/4 of the sequence length are timed
beside the same calls once captured, and printed under the table. Without ``--variants`` they run
autocast_fp16 and o2_fp16 only (the comparison of issue 12); hf_llama_liger runs issue 25's in
bf16: autocast_bf16 (the baseline of its ratios), pure_bf16, o2_bf16 and the two Liger variants.

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
                     (amp_fx.training_step.CudaGraphStep; eager mode, CUDA only)
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

Every variant trains ``WithLoss(model, loss_fn)``: the model and its loss as one module (the loss
under autocast for the autocast variants, as before). amp_fx converts that module, so at O2 the
cross-entropy reads the low-precision logits directly
(``amp_fx.ops.cross_entropy.fp32_cross_entropy``: float32 math without a float32 copy of the
logits); ``o2_fp16_loss_outside`` shows the cost of the copy.

each eager and under torch.compile (the forward and the loss compiled; the optimizer step runs
eagerly, as a fused kernel in every variant). All variants of a mode are built and warmed up first
(compiles, CUDA-graph capture), then timed in ``--rounds`` rounds of ``--steps`` steps, the order
reversed every other round: a GPU slows as it heats up or reaches its power limit, and variants
timed in a fixed order would carry that into their ratios. Per variant it reports the median of
all its timed steps, the ratio to autocast_fp16 in the same mode, and peak memory
(``torch.cuda.max_memory_allocated`` during its warm-up, above what was allocated before it was
built: its weights, optimizer state, grads and activations, not the unconverted model, other
variants or cuBLAS's workspaces, which are allocated before the first; o2_fp16_cuda_graph's peak
counts those of its capture stream). A variant that fails is reported in the table and the run
goes on.

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

CPU check that every variant runs (tiny models, Dynamo capture without Inductor; 1-2 minutes
on one core; the transformers models ~1 minute more)::

    python benchmarks/bench_train.py --small
    python benchmarks/bench_train.py --small --models hf_gpt2,hf_llama
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolated_runs import Group, run_groups, write_results  # noqa: E402
from kernel_breakdown import format_breakdown, profile_breakdown  # noqa: E402
from liger import patch_transformers  # noqa: E402
from liger import unavailable_reason as liger_unavailable_reason  # noqa: E402
from models import (  # noqa: E402
    BUILDERS,
    HF_MODEL_CLASSES,
    LabelsLoss,
    WithLoss,
    Workload,
    build_workload,
    hf_model_type,
    parameter_count,
    token_shape,
    with_loss,
)
from reporting import environment, publish  # noqa: E402

logger = logging.getLogger("bench_train")

GPT_ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
RESNET_SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}


@dataclass(frozen=True)
class Variant:
    """How one row of the table trains: who converts the model and in which precision."""

    name: str
    # "torch": plain PyTorch (fp32, autocast or .half()); "amp_fx": amp_fx.convert + fused optimizer.
    framework: str
    # dtype of the model's parameters (torch variants) or amp_fx's low dtype.
    dtype: torch.dtype = torch.float32
    autocast: bool = False
    opt_level: str | None = None
    # The whole step captured once with amp_fx.training_step.CudaGraphStep and replayed (eager only).
    cuda_graph: bool = False
    # amp_fx converts the model alone; the loss runs on its float32 outputs.
    loss_outside: bool = False
    # amp_fx's BatchNorm + [add] + ReLU fusion (the O2 default); False runs them as torch ops.
    fused_batch_norm: bool = True
    # amp_fx's max-pool kernels (the O2 default); False runs torch's.
    fused_max_pool: bool = True
    # amp_fx's linear head + cross-entropy fusion (the O2 default); False runs them as two calls.
    fused_linear_loss: bool = True
    # A transformers model called as its config says (use_cache: a key/value cache is filled);
    # False sets config.use_cache=False, the comparison row of issue 22.
    kv_cache: bool = True
    # Liger-Kernel's patch for the model's family applied before it is built (benchmarks/liger.py);
    # it holds for the whole process, so these variants run in a process of their own.
    liger: bool = False

    @property
    def uses_loss_scaling(self) -> bool:
        # fp16 needs a dynamic loss scale wherever an fp32 copy of the weights exists (autocast, O1,
        # O2); `.half()` and O3 train without one, as Apex's O3 does.
        if self.dtype != torch.float16:
            return False
        return self.autocast or self.opt_level in ("O1", "O2")


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("fp32", "torch"),
        Variant("autocast_fp16", "torch", torch.float16, autocast=True),
        Variant("autocast_bf16", "torch", torch.bfloat16, autocast=True),
        Variant("half", "torch", torch.float16),
        Variant("pure_bf16", "torch", torch.bfloat16),
        *(
            Variant(f"o{level}_{short}", "amp_fx", dtype, opt_level=f"O{level}")
            for level in (1, 2, 3)
            for short, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
        ),
        Variant("o2_fp16_cuda_graph", "amp_fx", torch.float16, opt_level="O2", cuda_graph=True),
        Variant("o2_fp16_loss_outside", "amp_fx", torch.float16, opt_level="O2", loss_outside=True),
        Variant("o2_fp16_unfused_bn", "amp_fx", torch.float16, opt_level="O2", fused_batch_norm=False),
        Variant("o2_fp16_unfused_pool", "amp_fx", torch.float16, opt_level="O2", fused_max_pool=False),
        Variant(
            "o2_fp16_unfused_linear_loss", "amp_fx", torch.float16, opt_level="O2", fused_linear_loss=False
        ),
        Variant("o2_fp16_no_kv_cache", "amp_fx", torch.float16, opt_level="O2", kv_cache=False),
        Variant("autocast_fp16_no_kv_cache", "torch", torch.float16, autocast=True, kv_cache=False),
        Variant("liger_autocast_bf16", "torch", torch.bfloat16, autocast=True, liger=True),
        Variant("liger_pure_bf16", "torch", torch.bfloat16, liger=True),
    ]
}
BASELINE = "autocast_fp16"
RUN_ORDER = [
    BASELINE,
    "o2_fp16",
    "half",
    "o2_bf16",
    "autocast_bf16",
    "pure_bf16",
    "liger_autocast_bf16",
    "liger_pure_bf16",
    "o2_fp16_cuda_graph",
    "o2_fp16_loss_outside",
    "o2_fp16_unfused_bn",
    "o2_fp16_unfused_pool",
    "o2_fp16_unfused_linear_loss",
    "o2_fp16_no_kv_cache",
    "autocast_fp16_no_kv_cache",
    "o1_fp16",
    "o3_fp16",
    "o1_bf16",
    "o3_bf16",
    "fp32",
]
assert sorted(RUN_ORDER) == sorted(VARIANTS)
# What a model runs without --variants: every variant, except for the transformers models: issue
# 12's comparison (their loss is inside the model, so o2_fp16_loss_outside has no meaning), which
# keeps both within one GPU run of <= 9 minutes.
# hf_llama_liger runs the comparison of issue 25 in bf16, its Liger rows in a process of their own.
DEFAULT_VARIANTS: dict[str, list[str]] = {
    "hf_gpt2": [BASELINE, "o2_fp16"],
    "hf_llama": [BASELINE, "o2_fp16"],
    "hf_llama_liger": ["autocast_bf16", "pure_bf16", "o2_bf16", "liger_autocast_bf16", "liger_pure_bf16"],
}
# The variant a model's ratios are taken to, where it is not BASELINE (``--baseline`` overrides).
MODEL_BASELINES: dict[str, str] = {"hf_llama_liger": "autocast_bf16"}
# Eager steps CudaGraphStep runs before it captures; the benchmark's warm-up covers them and the capture.
GRAPH_WARMUP_STEPS = 2


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


# ---------------------------------------------------------------------------------------------
# Building one variant's training step
# ---------------------------------------------------------------------------------------------


def make_optimizer(variant: Variant, work: Workload, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """torch's fused AdamW/SGD for the torch variants, amp_fx's FusedAdam/FusedSGD for amp_fx's."""
    if variant.framework == "amp_fx":
        import amp_fx.optim

        # FP32 masters where the weights are stored low and updated by the optimizer (O2); O1's
        # weights are fp32 already and O3 has none by definition.
        masters = variant.opt_level == "O2"
        if work.optimizer == "adamw":
            return amp_fx.optim.FusedAdam(params, adam_w_mode=True, master_weights=masters, **GPT_ADAMW)
        return amp_fx.optim.FusedSGD(params, master_weights=masters, **RESNET_SGD)
    if work.optimizer == "adamw":
        return torch.optim.AdamW(params, fused=True, **GPT_ADAMW)
    return torch.optim.SGD(params, fused=True, **RESNET_SGD)


def make_scaler(variant: Variant, device: torch.device) -> object | None:
    if variant.framework == "amp_fx":
        import amp_fx

        return amp_fx.LossScaler(enabled=variant.uses_loss_scaling)
    if variant.uses_loss_scaling:
        return torch.amp.GradScaler(device.type)
    return None


def prepare_model(variant: Variant, work: Workload) -> nn.Module:
    """What the variant trains, ``(inputs, targets) -> loss``: the model with its loss as is,
    `.half()`-ed, or amp_fx-converted (with the loss, or without it for ``loss_outside``)."""
    if variant.framework == "amp_fx":
        import amp_fx

        device_type = work.inputs.device.type
        # The variant's False turns a fusion off; True leaves the preset's default.
        policy = amp_fx.preset(
            variant.opt_level,
            variant.dtype,
            device_type,
            fused_batch_norm=None if variant.fused_batch_norm else False,
            fused_max_pool=None if variant.fused_max_pool else False,
            fused_linear_loss=None if variant.fused_linear_loss else False,
        )
        if work.loss_fn is None:
            # The model computes its loss (a transformers LM): converted as a user converts it.
            if variant.loss_outside:
                raise ValueError(
                    f"{variant.name} needs the loss outside; {work.name} computes its own (labels=)"
                )
            return LabelsLoss(amp_fx.convert(work.model, variant.opt_level, policy=policy))
        if variant.loss_outside:
            return WithLoss(amp_fx.convert(work.model, variant.opt_level, policy=policy), work.loss_fn)
        return amp_fx.convert(WithLoss(work.model, work.loss_fn), variant.opt_level, policy=policy)
    model = with_loss(work.model, work.loss_fn)
    if not variant.autocast and variant.dtype != torch.float32:
        return model.to(variant.dtype)
    return model


def make_forward_loss(
    variant: Variant, model: nn.Module
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """forward + loss as one function, the region torch.compile compiles."""

    def forward_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if variant.autocast:
            with torch.autocast(inputs.device.type, dtype=variant.dtype):
                return model(inputs, targets)
        return model(inputs, targets)

    return forward_loss


def build_step(
    variant: Variant, work: Workload, mode: str, compile_backend: str
) -> Callable[[], torch.Tensor]:
    """Return a function that runs one full training step on the workload's batch."""
    model = prepare_model(variant, work)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(variant, work, params)
    scaler = make_scaler(variant, work.inputs.device)
    forward_loss = make_forward_loss(variant, model)
    inputs = work.inputs
    if mode == "compile":
        if variant.framework == "amp_fx":
            # One eager call captures the torch.export front end's graph first: a capture during
            # a compiled call is a graph break inside the model, and its compiled code keeps it.
            forward_loss(inputs, work.targets)
        forward_loss = torch.compile(forward_loss, backend=compile_backend)
    if variant.framework == "torch" and not variant.autocast and inputs.is_floating_point():
        inputs = inputs.to(variant.dtype)  # `.half()` models take fp16 images
    targets = work.targets

    if variant.cuda_graph:
        from amp_fx.training_step import CudaGraphStep

        graph_step = CudaGraphStep(forward_loss, optimizer, scaler, warmup_steps=GRAPH_WARMUP_STEPS)
        return lambda: graph_step(inputs, targets)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_loss(inputs, targets)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss

    return step


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


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


def make_workload(
    model_name: str,
    args: argparse.Namespace,
    device: torch.device,
    kv_cache: bool = True,
    liger: bool = False,
) -> Workload:
    """A fresh, seeded workload of the command line's size (--small, --batch-size, --seq-len)."""
    if liger:
        patch_transformers(hf_model_type(model_name))
    workload = build_workload(
        model_name, device, small=args.small, batch_size=args.batch_size, seq_len=args.seq_len
    )
    if (args.no_kv_cache or not kv_cache) and hasattr(workload.model, "config"):
        workload.model.config.use_cache = False  # the comparison row; people call the default
    return workload


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
        work = make_workload(model_name, args, device, variant.kv_cache, variant.liger)
        step = build_step(variant, work, mode, args.compile_backend)
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


# ---------------------------------------------------------------------------------------------
# What capturing a new call structure or shape costs (amp_fx's torch.export front end)
# ---------------------------------------------------------------------------------------------


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
    from amp_fx.captured_model import CapturedModel
    from amp_fx.summary import capture_summary

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


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        help=f"comma list of {', '.join(VARIANTS)} (default: all; for the transformers models "
        f"{', '.join(DEFAULT_VARIANTS['hf_gpt2'])})",
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
        help=f"the variant ratios are taken to (default {BASELINE}; autocast_bf16 for hf_llama_liger)",
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


def model_variants(model_name: str, args: argparse.Namespace) -> list[Variant]:
    """The variants ``model_name`` runs: ``--variants``, else its default (`DEFAULT_VARIANTS`)."""
    if args.variants is not None:
        return list(args.variants)
    return [VARIANTS[name] for name in DEFAULT_VARIANTS.get(model_name, VARIANTS)]


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
    """`measure_in_process` of each group in a fresh process of this script (isolated_runs.py)."""
    rows, notes = run_groups(os.path.abspath(__file__), args.argv, model_name, groups, deadline)
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
    title = f"Training step: {description} - {environment_line(args.device, args.compile_backend)}"
    baseline = args.baseline or MODEL_BASELINES.get(model_name, BASELINE)
    # The targets are about the full-size models on a GPU; a --small run only checks the code.
    table = format_table(
        model_name, ordered, args.modes, results, title, baseline, check_targets=not args.small
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
