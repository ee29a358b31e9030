"""Benchmark: amp_fx's fused O2 optimizer steps against torch, on the GPT shape list of DESIGN.md.

The shapes: d=2048, 24 layers, vocab 50304 -> 1,311,625,216 parameters in 291 tensors. Params are
fp16 with fp32 masters (O2). Every row is timed with ``triton.testing.do_bench`` (median) and
reported as ms, effective GB/s (the row's own bytes / time) and the ratio to the O2 floor:

    floor = (bytes per parameter that an O2 step must move) x N / copy bandwidth

Bytes per parameter (each input read once, each output written once):

- Adam O2: grad fp16 (2) + master, m, v read (12) + master, m, v written (12) + param fp16 written (2)
  = 28, plus 2 for the overflow-check pass over the fp16 grads = 30.
- SGD with momentum O2: grad fp16 (2) + master, buf read (8) + master, buf written (8) + param fp16
  written (2) = 20, plus 2 for the check = 22. (Without momentum: 12 + 2 = 14.)
- torch fused AdamW on fp32 params: p, g, m, v read (16) + p, m, v written (12) = 28.
  torch fused SGD (momentum) on fp32: p, g, buf read (12) + p, buf written (8) = 20.
- The same O2 step written by hand from torch parts: grads fp16 -> fp32 (2 + 4), unscale and check
  in place (4 + 4), the fused fp32 update (28 Adam / 20 SGD), masters -> fp16 params (4 + 2)
  = 48 (Adam) / 40 (SGD).

The copy row is a device-to-device copy (bytes read + written), the bandwidth ceiling.

Variants (``--variants``): the update and check kernels alone at several block/chunk/warp settings,
with the 16-byte alignment hint on and off, each first checked against the reference.

Usage:
    python benchmarks/bench_optimizer.py [--variants] [--markdown PATH] [--layers 24]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import triton
import triton.testing
from reporting import environment

from amp_fx.kernels import pointer_table, reference, triton_ops
from amp_fx.kernels.adam import triton as adam_triton
from amp_fx.kernels.overflow_check import triton as overflow_check_triton
from amp_fx.kernels.pointer_table import LaunchConfig
from amp_fx.kernels.sgd import triton as sgd_triton

ADAM = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adam_w_mode=True)
SGD = dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
LOSS_SCALE = 1024.0
DEVICE = "cuda"
# For the correctness check before timing: sizes at block and chunk boundaries, odd shapes.
SMALL_SHAPES = [(1,), (1023,), (1025,), (16 * 1024 + 1,), (96, 100), (3, 5, 7)]


def gpt_shapes(d: int = 2048, layers: int = 24, vocab: int = 50304) -> list[tuple[int, ...]]:
    """The parameter shapes of DESIGN.md's GPT: embedding, per layer qkv/proj/fc1/fc2 and 2 LayerNorms."""
    per_layer = [
        (3 * d, d),
        (3 * d,),
        (d, d),
        (d,),
        (4 * d, d),
        (4 * d,),
        (d, 4 * d),
        (d,),
        (d,),
        (d,),
        (d,),
        (d,),
    ]
    return [(vocab, d), *per_layer * layers, (d,), (d,)]


@dataclass
class Row:
    name: str
    ms: float
    bytes_per_param: int
    note: str = ""


def bench(fn: Callable[[], object], rep_ms: int) -> float:
    return triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


def host_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """Host time to enqueue one call (the GPU runs behind; a queue this short never fills)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return 1e3 * elapsed


@contextlib.contextmanager
def launch_configs(adam_cfg=None, sgd_cfg=None, check_cfg=None, aligned_hint: bool = True) -> Iterator[None]:
    """Run the kernels with other launch settings; aligned_hint=False makes every table 'unaligned'."""
    saved = (
        adam_triton.LAUNCH,
        sgd_triton.LAUNCH,
        overflow_check_triton.LAUNCH,
        pointer_table.ALIGNMENT_BYTES,
    )
    adam_triton.LAUNCH = adam_cfg or adam_triton.LAUNCH
    sgd_triton.LAUNCH = sgd_cfg or sgd_triton.LAUNCH
    overflow_check_triton.LAUNCH = check_cfg or overflow_check_triton.LAUNCH
    if not aligned_hint:
        pointer_table.ALIGNMENT_BYTES = 1 << 62  # no real pointer is a multiple of this
    pointer_table.clear_cache()
    try:
        yield
    finally:
        adam_triton.LAUNCH, sgd_triton.LAUNCH, overflow_check_triton.LAUNCH, pointer_table.ALIGNMENT_BYTES = (
            saved
        )
        pointer_table.clear_cache()


class Problem:
    """fp16 params and grads with fp32 masters and states, on the GPU, random (never zeros)."""

    def __init__(self, shapes, states: tuple[str, ...], seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.params = [(0.02 * torch.randn(s, device=DEVICE)).half() for s in shapes]
        self.grads = [torch.randn(s, device=DEVICE).half() for s in shapes]  # scaled grads (x LOSS_SCALE)
        self.masters = [p.float() for p in self.params]
        self.states = {}
        for name in states:
            make = (
                (lambda s: 1e-6 * torch.rand(s, device=DEVICE))
                if name == "exp_avg_sqs"
                else (lambda s: 1e-3 * torch.randn(s, device=DEVICE))
            )
            self.states[name] = [make(s) for s in shapes]
        self.numel = sum(p.numel() for p in self.params)
        self.found_inf = torch.zeros(1, device=DEVICE)
        self.inv_scale = torch.full((1,), 1.0 / LOSS_SCALE, device=DEVICE)
        self.step = torch.zeros(1, device=DEVICE)
        # Per-parameter step offsets, as FusedAdam/FusedSGD pass them (one pointer column more).
        self.step_offsets = [torch.zeros((), device=DEVICE) for _ in shapes]

    def check(self) -> None:
        triton_ops.check_finite_and_norm_(self.grads, self.found_inf, grad_multiplier=self.inv_scale)

    def adam_update(self, ops=triton_ops) -> None:
        ops.adam_step_(
            self.params,
            self.grads,
            self.masters,
            self.states["exp_avgs"],
            self.states["exp_avg_sqs"],
            self.step,
            grad_multiplier=self.inv_scale,
            found_inf=self.found_inf,
            step_offsets=self.step_offsets,
            **ADAM,
        )

    def sgd_update(self, ops=triton_ops) -> None:
        ops.sgd_step_(
            self.params,
            self.grads,
            self.masters,
            self.states["momentum_buffers"],
            self.step,
            grad_multiplier=self.inv_scale,
            found_inf=self.found_inf,
            step_offsets=self.step_offsets,
            **SGD,
        )

    def adam_o2_step(self) -> None:
        self.found_inf.zero_()
        self.check()
        self.adam_update()
        triton_ops.advance_step_(self.step, self.found_inf)

    def sgd_o2_step(self) -> None:
        self.found_inf.zero_()
        self.check()
        self.sgd_update()
        triton_ops.advance_step_(self.step, self.found_inf)


def check_against_reference(shapes, kind: str) -> str:
    """Run the Triton step and the reference on a copy of the same small problem; return the max error."""
    states = ("exp_avgs", "exp_avg_sqs") if kind == "adam" else ("momentum_buffers",)
    ours, theirs = Problem(shapes, states, seed=1), Problem(shapes, states, seed=1)
    for _ in range(3):
        for problem, ops in ((ours, triton_ops), (theirs, reference)):
            problem.found_inf.zero_()
            ops.check_finite_and_norm_(problem.grads, problem.found_inf, grad_multiplier=problem.inv_scale)
            (problem.adam_update if kind == "adam" else problem.sgd_update)(ops)
            ops.advance_step_(problem.step, problem.found_inf)
    worst = 0.0
    for name in ("masters", *states):
        mine = ours.masters if name == "masters" else ours.states[name]
        ref = theirs.masters if name == "masters" else theirs.states[name]
        for a, b in zip(mine, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            worst = max(worst, (a - b).abs().max().item())
    for p, m in zip(ours.params, ours.masters, strict=True):
        assert torch.equal(p, m.half()), "fp16 param is not its master rounded to nearest"
    assert ours.found_inf.item() == 0.0 and ours.step.item() == 3.0
    return f"{worst:.2e}"


def copy_bandwidth(numel: int, rep_ms: int) -> tuple[float, float]:
    src = torch.randn(numel, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), rep_ms)
    return ms, 2 * 4 * numel / (ms * 1e-3)


def adam_rows(shapes, rep_ms: int) -> list[Row]:
    problem = Problem(shapes, ("exp_avgs", "exp_avg_sqs"))
    rows = [
        Row(
            "amp_fx Adam O2 step (check + update)",
            bench(problem.adam_o2_step, rep_ms),
            30,
            f"host {host_ms(problem.adam_o2_step):.2f} ms/step",
        )
    ]
    rows.append(Row("  amp_fx overflow check only", bench(problem.check, rep_ms), 2))
    rows.append(Row("  amp_fx Adam update only", bench(problem.adam_update, rep_ms), 28))
    assert problem.found_inf.item() == 0.0, "the benchmark must time real updates, not skipped ones"
    rows += fused_optimizer_row(problem, "FusedAdam", 30, rep_ms)

    # torch: fused AdamW over fp32 tensors (the masters, with fp32 grads).
    grads32 = [g.float() for g in problem.grads]
    for m, g in zip(problem.masters, grads32, strict=True):
        m.grad = g
    del problem.states  # free amp_fx's moments before torch allocates its own
    optimizer = torch.optim.AdamW(
        problem.masters,
        lr=ADAM["lr"],
        betas=(ADAM["beta1"], ADAM["beta2"]),
        eps=ADAM["eps"],
        weight_decay=ADAM["weight_decay"],
        fused=True,
    )
    rows.append(Row("torch fused AdamW, fp32 params", bench(optimizer.step, rep_ms), 28))

    def by_hand() -> None:
        problem.found_inf.zero_()
        torch._foreach_copy_(grads32, problem.grads)
        torch._amp_foreach_non_finite_check_and_unscale_(grads32, problem.found_inf, problem.inv_scale)
        optimizer.step()
        torch._foreach_copy_(problem.params, problem.masters)

    rows.append(Row("by hand: fp16->fp32, unscale, fused AdamW, copy back", bench(by_hand, rep_ms), 48))
    return rows


def sgd_rows(shapes, rep_ms: int) -> list[Row]:
    problem = Problem(shapes, ("momentum_buffers",))
    problem.step.fill_(1.0)  # past the first step: the momentum buffer is read
    rows = [
        Row(
            "amp_fx SGD-momentum O2 step (check + update)",
            bench(problem.sgd_o2_step, rep_ms),
            22,
            f"host {host_ms(problem.sgd_o2_step):.2f} ms/step",
        )
    ]
    rows.append(Row("  amp_fx SGD update only", bench(problem.sgd_update, rep_ms), 20))
    assert problem.found_inf.item() == 0.0
    rows += fused_optimizer_row(problem, "FusedSGD", 22, rep_ms)

    grads32 = [g.float() for g in problem.grads]
    for m, g in zip(problem.masters, grads32, strict=True):
        m.grad = g
    del problem.states
    optimizer = torch.optim.SGD(problem.masters, lr=SGD["lr"], momentum=SGD["momentum"], fused=True)
    rows.append(Row("torch fused SGD-momentum, fp32 params", bench(optimizer.step, rep_ms), 20))

    def by_hand() -> None:
        problem.found_inf.zero_()
        torch._foreach_copy_(grads32, problem.grads)
        torch._amp_foreach_non_finite_check_and_unscale_(grads32, problem.found_inf, problem.inv_scale)
        optimizer.step()
        torch._foreach_copy_(problem.params, problem.masters)

    rows.append(Row("by hand: fp16->fp32, unscale, fused SGD, copy back", bench(by_hand, rep_ms), 40))
    return rows


def fused_optimizer_row(problem: Problem, name: str, bytes_per_param: int, rep_ms: int) -> list[Row]:
    """amp_fx.optim.FusedAdam/FusedSGD driven by amp_fx.LossScaler, when those exist and work."""
    try:
        import amp_fx
        from amp_fx import optim

        params = [torch.nn.Parameter(p) for p in problem.params]
        for p, g in zip(params, problem.grads, strict=True):
            p.grad = g
        if name == "FusedAdam":
            opt = optim.FusedAdam(
                params,
                lr=ADAM["lr"],
                betas=(ADAM["beta1"], ADAM["beta2"]),
                eps=ADAM["eps"],
                weight_decay=ADAM["weight_decay"],
                adam_w_mode=True,
                master_weights=True,
            )
        else:
            opt = optim.FusedSGD(params, lr=SGD["lr"], momentum=SGD["momentum"], master_weights=True)
        scaler = amp_fx.LossScaler(init_scale=LOSS_SCALE)
        loss = torch.ones((), device=DEVICE)

        def step() -> None:
            scaler.scale(loss)  # the grads are already there: this only marks a scaled step
            scaler.step(opt)
            scaler.update()

        ms = bench(step, rep_ms)
        row = Row(
            f"amp_fx.optim.{name} + LossScaler (step + update)",
            ms,
            bytes_per_param,
            f"host {host_ms(step):.2f} ms/step",
        )
        return [row]
    except Exception as error:  # report and go on: the optimizer is not this benchmark's subject
        return [
            Row(f"amp_fx.optim.{name} + LossScaler", float("nan"), bytes_per_param, f"failed: {error!r}"[:90])
        ]


# The first of each list is the shipped setting (also timed without the alignment hint).
ADAM_VARIANTS = [
    LaunchConfig(1024, 2 * 1024, 8),
    LaunchConfig(1024, 4 * 1024, 8),
    LaunchConfig(1024, 1024, 8),
    LaunchConfig(1024, 8 * 1024, 8),
    LaunchConfig(1024, 16 * 1024, 4),
    LaunchConfig(512, 2 * 1024, 4),
    LaunchConfig(512, 4 * 1024, 4),
    LaunchConfig(2048, 4 * 1024, 16),
]
CHECK_VARIANTS = [
    LaunchConfig(512, 8 * 1024, 4),
    LaunchConfig(1024, 16 * 1024, 4),
    LaunchConfig(1024, 4 * 1024, 8),
    LaunchConfig(2048, 8 * 1024, 8),
    LaunchConfig(512, 2 * 1024, 4),
]


VARIANT_KINDS = {
    # kind: (states, bytes per param, launch_configs keyword, variants)
    "adam": (("exp_avgs", "exp_avg_sqs"), 28, "adam_cfg", ADAM_VARIANTS),
    "sgd": (("momentum_buffers",), 20, "sgd_cfg", ADAM_VARIANTS),
    "check": ((), 2, "check_cfg", CHECK_VARIANTS),
}


def variant_rows(shapes, small_shapes, rep_ms: int) -> tuple[list[Row], dict[str, LaunchConfig]]:
    """Each kernel alone at each launch setting (the first also without the alignment hint), each
    checked against the reference first; returns the rows and the fastest setting per kernel."""
    rows, best = [], {}
    for kind, (states, bytes_per_param, keyword, variants) in VARIANT_KINDS.items():
        problem = Problem(shapes, states)
        problem.step.fill_(1.0)
        fn = {"adam": problem.adam_update, "sgd": problem.sgd_update, "check": problem.check}[kind]
        timings = {}
        for config in variants:
            for aligned in (True, False) if config == variants[0] else (True,):
                with launch_configs(**{keyword: config}, aligned_hint=aligned):
                    error = check_against_reference(small_shapes, "sgd" if kind == "sgd" else "adam")
                    ms = bench(fn, rep_ms)
                if aligned:
                    timings[config] = ms
                label = f"{kind} block={config.block_size} chunk={config.chunk_size} warps={config.num_warps}"
                label += "" if aligned else " NO-ALIGN-HINT"
                rows.append(Row(label, ms, bytes_per_param, f"err {error}"))
        best[kind] = min(timings, key=timings.get)
        del problem, fn
        torch.cuda.empty_cache()
    return rows, best


def best_variant_rows(shapes, best: dict[str, LaunchConfig], rep_ms: int) -> list[Row]:
    """The whole O2 steps again, each kernel at its fastest launch setting."""
    rows = []
    with launch_configs(adam_cfg=best["adam"], sgd_cfg=best["sgd"], check_cfg=best["check"]):
        for kind, bytes_per_param in (("adam", 30), ("sgd", 22)):
            problem = Problem(shapes, VARIANT_KINDS[kind][0])
            problem.step.fill_(1.0)
            fn = problem.adam_o2_step if kind == "adam" else problem.sgd_o2_step
            name = f"amp_fx {'Adam' if kind == 'adam' else 'SGD-momentum'} O2 step, best settings"
            note = f"{kind}: {best[kind]}; check: {best['check']}"
            rows.append(Row(name, bench(fn, rep_ms), bytes_per_param, note))
            del problem, fn
            torch.cuda.empty_cache()
    return rows


def format_table(rows: list[Row], numel: int, copy_gbs: float, title: str) -> str:
    lines = [
        f"### {title}",
        "",
        f"N = {numel:,} params; copy bandwidth {copy_gbs / 1e9:.0f} GB/s",
        "",
        "| what | ms | B/param | GB/s | floor ms | x floor | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        gbs = row.bytes_per_param * numel / (row.ms * 1e-3) / 1e9
        floor_ms = row.bytes_per_param * numel / copy_gbs * 1e3
        lines.append(
            f"| {row.name} | {row.ms:.3f} | {row.bytes_per_param} | {gbs:.0f} | {floor_ms:.3f} | "
            f"{row.ms / floor_ms:.3f} | {row.note} |"
        )
    return "\n".join(lines)


def o2_ratio_table(rows: list[Row], numel: int, copy_gbs: float, floors: dict[str, int]) -> str:
    """Each step against the O2 floor of its optimizer (30 B/param Adam, 22 SGD), the targets' measure."""
    lines = [
        "### Against the O2 floor",
        "",
        "| step | ms | O2 floor ms | x O2 floor |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        for key, bytes_per_param in floors.items():
            if key in row.name and not row.name.startswith("  "):
                floor_ms = bytes_per_param * numel / copy_gbs * 1e3
                lines.append(f"| {row.name} | {row.ms:.3f} | {floor_ms:.3f} | {row.ms / floor_ms:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--variants", action="store_true", help="also time launch-setting variants")
    parser.add_argument("--repeat", type=int, default=1, help="time the main table this many times")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_optimizer.py needs a CUDA device")

    shapes = gpt_shapes(layers=args.layers)
    numel = sum(torch.Size(s).numel() for s in shapes)
    small_shapes = SMALL_SHAPES
    header = f"{environment()}; {len(shapes)} tensors"
    print(header, flush=True)
    print(
        "correctness vs reference (max abs err): adam",
        check_against_reference(small_shapes, "adam"),
        "sgd",
        check_against_reference(small_shapes, "sgd"),
        flush=True,
    )

    copy_runs, tables = [], []
    for run in range(args.repeat):
        copy_ms, copy_gbs = copy_bandwidth(numel, args.rep_ms)
        copy_runs.append(copy_gbs)
        rows = [Row("device copy (fp32, read + write)", copy_ms, 8)]
        rows += adam_rows(shapes, args.rep_ms)
        torch.cuda.empty_cache()
        rows += sgd_rows(shapes, args.rep_ms)
        torch.cuda.empty_cache()
        tables.append(format_table(rows, numel, copy_gbs, f"GPT shapes, fp16 params (run {run + 1})"))
        tables.append(o2_ratio_table(rows, numel, copy_gbs, {"Adam": 30, "SGD": 22}))
        print(tables[-2] + "\n\n" + tables[-1] + "\n", flush=True)
    if args.variants:
        copy_gbs = statistics.median(copy_runs)
        rows, best = variant_rows(shapes, small_shapes, args.rep_ms)
        tables.append(format_table(rows, numel, copy_gbs, "Kernel variants (update or check alone)"))
        print(tables[-1] + "\n", flush=True)
        rows = best_variant_rows(shapes, best, args.rep_ms)
        tables.append(format_table(rows, numel, copy_gbs, "O2 steps with the fastest settings"))
        tables.append(o2_ratio_table(rows, numel, copy_gbs, {"Adam": 30, "SGD": 22}))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n\n" + "\n\n".join(tables) + "\n")
    print(header)
    print("\n\n".join([tables[0], tables[1], *(tables[-3:] if args.variants else [])]))


if __name__ == "__main__":
    main()
