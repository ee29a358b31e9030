"""Benchmark: the fused optimizer step on FSDP2's local shards against the unsharded fused step.

Under `amp_fx.training.fsdp.fully_shard_converted` the parameters are FP32 ``DTensor`` shards and the fused
optimizers update their local tensors in place (one kernel launch per dtype group, as unsharded).
This times ``optimizer.step()`` on this rank's shards and on plain FP32 tensors of the same
shapes (the same number of elements, the same kernel), interleaved in one run, and prints the
medians: the sharded step should cost what the unsharded one does (the goal: within 10%).
For context it also times the O2 step without FSDP (bf16 params + FP32 masters), which moves
more bytes per element.

With ``--model hf_gpt2`` or ``--model hf_llama`` it times whole training steps of a Hugging Face
model (benchmarks/models.py, random weights) converted at O2 (bf16) and sharded by
`amp_fx.training.fsdp.fully_shard_converted` (one FSDP2 group per block), called as Hugging Face documents
(``model(input_ids=ids, labels=ids).loss``), against one process training the unsharded converted
model on the whole global batch (FusedAdam with FP32 masters): time per step, optimizer state per
rank and the peak of the gathered parameter bytes in the forward (read at every group's pre-hook,
in a step of its own: the hooks read every parameter of the model, host time kept out of the
timed steps). Where the time goes: ``host ms`` is the time the step's Python takes to return (on
a GPU, a step whose host ms reaches its ms/step is host-bound: the GPU waits for launches), and
one profiled step counts what it ran and sums its time: kernels and copies on a GPU, top-level
aten ops on a CPU; ``--trace-dir`` writes that step's Chrome trace per row.
``--no-reshard-after-forward`` keeps each block gathered from its forward to its backward (no
second all-gather).

Run it under torchrun (NCCL on GPUs, gloo on CPUs):

    torchrun --standalone --nproc_per_node=1 benchmarks/bench_fsdp_step.py
    torchrun --standalone --nproc_per_node=1 benchmarks/bench_fsdp_step.py --hidden 64 --layers 2 --device cpu
    torchrun --standalone --nproc_per_node=1 benchmarks/bench_fsdp_step.py --model hf_gpt2
    torchrun --standalone --nproc_per_node=2 benchmarks/bench_fsdp_step.py --model hf_gpt2 --small \
        --device cpu
    torchrun --standalone --nproc_per_node=1 benchmarks/bench_fsdp_step.py --model hf_gpt2 \
        --trace-dir /tmp/fsdp_traces
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.profiler import DeviceType, ProfilerActivity, profile

import amp_fx
from amp_fx.capture.sharding import sharded_modules
from amp_fx.training.distributed import local_tensor
from amp_fx.training.fsdp import fully_shard_converted, gathered_parameter_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import build_hf  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=None, help="default: 2048 on CUDA, 64 on CPU")
    parser.add_argument("--layers", type=int, default=None, help="MLP blocks; default: 8 on CUDA, 2 on CPU")
    parser.add_argument("--optimizer", default="FusedAdam", choices=["FusedAdam", "FusedSGD"])
    parser.add_argument("--reps", type=int, default=None, help="timed steps per row; default 50 CUDA, 5 CPU")
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    parser.add_argument(
        "--model", default="mlp", choices=["mlp", "hf_gpt2", "hf_llama"], help="hf_*: whole training steps"
    )
    parser.add_argument("--small", action="store_true", help="hf_*: the tiny config (CPU)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="hf_*: global batch; default the model's"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="hf_*: tokens per row; default the model's")
    parser.add_argument(
        "--no-reshard-after-forward", action="store_true", help="hf_*: blocks stay gathered until backward"
    )
    parser.add_argument(
        "--trace-dir", default=None, help="hf_*: write one profiled step's Chrome trace per row"
    )
    return parser.parse_args()


def setup(device_kind: str) -> torch.device:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(
            "bench_fsdp_step.py runs under torchrun:\n"
            "    torchrun --standalone --nproc_per_node=1 benchmarks/bench_fsdp_step.py"
        )
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(minutes=5),
        device_id=device if device.type == "cuda" else None,
    )
    return device


def mlp(hidden: int, layers: int) -> nn.Sequential:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)]
    return nn.Sequential(*blocks)


def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "FusedAdam":
        return amp_fx.optim.FusedAdam(params, lr=1e-4, weight_decay=0.01)
    return amp_fx.optim.FusedSGD(params, lr=1e-4, momentum=0.9)


def sharded_step(args: argparse.Namespace, device: torch.device) -> tuple[torch.optim.Optimizer, list]:
    """FSDP2 over the MLP (one group per Linear, FP32 shards); grads from one backward."""
    torch.manual_seed(0)
    model = mlp(args.hidden, args.layers).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(8, args.hidden, device=device)).square().mean().backward()
    params = list(model.parameters())
    torch.manual_seed(1)
    for param in params:  # the same grad values as plain_step's: tiny grads would time denormals on CPU
        param.grad.to_local().copy_(torch.randn(param.to_local().shape, device=device))
    return make_optimizer(args.optimizer, params), [p.to_local().shape for p in params]


def plain_step(args: argparse.Namespace, shapes: list, device: torch.device, dtype: torch.dtype):
    """The unsharded fused step on tensors of the shards' shapes (dtype bf16: O2, with FP32 masters)."""
    params = [nn.Parameter(torch.randn(shape, device=device).to(dtype)) for shape in shapes]
    torch.manual_seed(1)
    for param in params:
        param.grad = torch.randn(param.shape, device=device).to(dtype)
    return make_optimizer(args.optimizer, params)


def timed_ms(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(milliseconds the call takes to finish, on the device for CUDA; milliseconds until it returns
    on the host): equal on a CPU; on a GPU the second reaching the first means host-bound."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        fn()
        host = (time.perf_counter() - begin) * 1e3
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host
    begin = time.perf_counter()
    fn()
    elapsed = (time.perf_counter() - begin) * 1e3
    return elapsed, elapsed


def hf_training(args: argparse.Namespace, device: torch.device, shard: bool):
    """(step function, optimizer, model) of a converted Hugging Face model; ``shard``: FSDP2 over the
    world, each rank on its slice of the global batch, else this process on the whole batch."""
    work = build_hf(args.model, device, small=args.small, batch_size=args.batch_size, seq_len=args.seq_len)
    model = amp_fx.convert(work.model, "O2", dtype=torch.bfloat16)
    ids = work.inputs
    if shard:
        model = fully_shard_converted(model, reshard_after_forward=not args.no_reshard_after_forward)
        ids = ids.chunk(dist.get_world_size())[dist.get_rank()]
    optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step, optimizer, model


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's optimizer state (masters, moments) and FP32 parameters (their own masters)."""
    state = [
        t for s in optimizer.state.values() for k, t in s.items() if torch.is_tensor(t) and k != "step_offset"
    ]
    params = [p for g in optimizer.param_groups for p in g["params"] if p.dtype == torch.float32]
    return sum(local_tensor(t).nbytes for t in state + params)


def peak_gathered_bytes(model: nn.Module, step: Callable[[], None]) -> int:
    """The most parameter bytes gathered at any group's forward pre-hook during one step (all of
    them unsharded). The hooks are removed after it: each reads every parameter of the model."""
    peaks: list[int] = []
    handles = [
        group.register_forward_pre_hook(lambda *_: peaks.append(gathered_parameter_bytes(model)))
        for group in sharded_modules(model).values()
    ]
    step()
    for handle in handles:
        handle.remove()
    return max(peaks) if peaks else gathered_parameter_bytes(model)


def profiled_step(step: Callable[[], None], device: torch.device, trace: str | None) -> tuple[int, float]:
    """(count, summed milliseconds) of what one step runs: its device activities (kernels, copies)
    on a GPU, its top-level aten ops on a CPU. ``trace``: where to write the Chrome trace."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(trace)
    if device.type == "cuda":
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [
            e
            for e in prof.events()
            if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))
        ]
    return len(events), sum(e.time_range.elapsed_us() for e in events) / 1e3


def hf_main(args: argparse.Namespace, device: torch.device) -> None:
    args.reps = args.reps or (20 if device.type == "cuda" else 3)
    rows: dict[str, tuple[float, ...]] = {}
    for shard in (True, False):
        if not shard and dist.get_rank() != 0:
            break  # one process on the whole batch: rank 0 alone, the others wait
        step, optimizer, model = hf_training(args, device, shard)
        for _ in range(3):  # captures, moments
            step()
        peak_gathered = peak_gathered_bytes(model, step)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        samples = [timed_ms(step, device) for _ in range(args.reps)]
        memory = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
        name = f"FSDP2 over {dist.get_world_size()} rank(s)" if shard else "one process, unsharded O2"
        trace = None
        if args.trace_dir is not None:
            os.makedirs(args.trace_dir, exist_ok=True)
            trace = os.path.join(args.trace_dir, f"{args.model}_{'sharded' if shard else 'unsharded'}.json")
        launches, busy = profiled_step(step, device, trace)
        rows[name] = (
            statistics.median(ms for ms, _ in samples),
            statistics.median(host for _, host in samples),
            launches,
            busy,
            state_bytes(optimizer) / 2**20,
            peak_gathered / 2**20,
            memory,
        )
        del step, optimizer, model
        gc.collect()  # the captured graphs and the model refer to each other
    if dist.get_rank() == 0:
        size = " (small)" if args.small else ""
        reshard = ", blocks kept gathered to backward" if args.no_reshard_after_forward else ""
        print(f"{args.model}{size}, O2 bf16, FusedAdam, {device}{reshard}, median of {args.reps}")
        launched = "kernels" if device.type == "cuda" else "aten ops"
        columns = {
            "ms/step": ".1f", "host ms": ".1f", launched: "d", f"{launched} ms": ".1f",
            "optimizer MiB": ".3f", "peak gathered MiB": ".3f", "max alloc MiB": ".1f",
        }  # fmt: skip
        print(f"{'':32s} " + " ".join(f"{c:>{max(len(c), 9)}s}" for c in columns))
        for name, values in rows.items():
            cells = [f"{v:>{max(len(c), 9)}{f}}" for (c, f), v in zip(columns.items(), values, strict=True)]
            print(f"{name:32s} " + " ".join(cells))
    dist.barrier()


def main() -> None:
    args = parse_args()
    device = setup(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.model != "mlp":
        hf_main(args, device)
        dist.destroy_process_group()
        return
    on_cuda = device.type == "cuda"
    args.hidden = args.hidden or (2048 if on_cuda else 64)
    args.layers = args.layers or (8 if on_cuda else 2)
    args.reps = args.reps or (50 if on_cuda else 5)

    sharded, shapes = sharded_step(args, device)
    rows = {
        "FSDP2 local shards, FP32 (DTensor)": sharded,
        "unsharded, FP32 params": plain_step(args, shapes, device, torch.float32),
        "unsharded, O2 (bf16 params + FP32 masters)": plain_step(args, shapes, device, torch.bfloat16),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for rep in range(args.reps + 3):  # interleaved: drift affects every row alike; 3 warm-up rounds
        for name, optimizer in rows.items():
            elapsed, _ = timed_ms(optimizer.step, device)
            if rep >= 3:
                times[name].append(elapsed)

    if dist.get_rank() == 0:
        numel = sum(torch.Size(shape).numel() for shape in shapes)
        baseline = statistics.median(times["unsharded, FP32 params"])
        print(
            f"{args.optimizer} step, {numel:,} elements on rank 0 of {dist.get_world_size()}, {device}, "
            f"median of {args.reps}"
        )
        print(f"{'':44s} {'ms':>9s} {'vs unsharded FP32':>18s}")
        for name, samples in times.items():
            median = statistics.median(samples)
            print(f"{name:44s} {median:9.3f} {median / baseline:17.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
