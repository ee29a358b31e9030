"""Host cost of one fused BatchNorm call (forward + backward), measured on CPU without a GPU.

In an eager training step every `amp_fx.ops.batch_norm.batch_norm_act` call costs Python and dispatcher
time on the host, and every torch op it runs besides the Triton kernels becomes a small device
kernel on the GPU. This script measures both where no GPU is needed:

- the Triton kernels of ``amp_fx.kernels.batch_norm.triton`` are replaced by stubs that only count their
  launches (so the time is everything around the launches: argument checks, autograd, custom-op
  dispatch, allocations, grid sizes, and the torch ops on tiny CPU tensors);
- ``AMP_FX_FORCE_TRITON=1`` routes the CPU tensors to the Triton wrappers;
- ``torch.profiler`` counts the aten ops of one call that would launch a device kernel (views,
  allocations and metadata ops excluded).

Triton's own launch cost (binding the arguments, the driver call) is not included; count it from
the launch numbers. Median microseconds per call over chains of calls (one backward pass per
chain), on a tiny (2, 64, 2, 2) fp16 input, beside the unfused torch ops (on CPU, which is their
host cost too: one dispatch each, tiny kernels)::

    python benchmarks/bench_batch_norm_host.py
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from amp_fx.kernels.batch_norm import triton as batch_norm
from amp_fx.ops.batch_norm import batch_norm_act

# aten ops that launch nothing on a GPU: views, allocations, metadata.
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::permute",
    "aten::select",
    "aten::slice",
    "aten::as_strided",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::expand",
    "aten::t",
    "aten::transpose",
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::unbind",
    "aten::contiguous",
    "aten::to",
    "aten::_to_copy",
    "aten::result_type",
    "aten::is_nonzero",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::zeros_like",
    "aten::ones_like",
    "aten::full_like",
}


class _CountedLaunches:
    """Stands in for a ``triton.JITFunction``: ``kernel[grid](...)`` counts instead of launching."""

    def __init__(self, counter: list[int]) -> None:
        self._counter = counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self._counter[0] += 1

        return launch


def _stub_kernels(counter: list[int]) -> None:
    # The launched kernels are the module's *_kernel functions (JITFunction, or the interpreter's
    # InterpretedFunction under TRITON_INTERPRET=1).
    for name in [name for name in vars(batch_norm) if name.endswith("_kernel")]:
        setattr(batch_norm, name, _CountedLaunches(counter))


def torch_batch_norm(x, weight, bias, running_mean, running_var, momentum, eps, residual, relu):
    """The unfused ops, for comparison: their host cost (on GPU, one launch each, cuDNN's two)."""
    y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=momentum, eps=eps)
    if residual is not None:
        y = y + residual
    return F.relu(y) if relu else y


def _make_chain(fn, shape: tuple[int, int, int, int], residual: bool, depth: int):
    """``depth`` calls of ``fn`` in a row (each one's output the next one's input, as in a network,
    so one backward pass covers them and its fixed cost is shared) and their backward."""
    generator = torch.Generator().manual_seed(0)

    def activation() -> torch.Tensor:
        values = torch.randn(shape, generator=generator).half()
        return values.contiguous(memory_format=torch.channels_last)

    channels = shape[1]
    x = activation().requires_grad_(True)
    grad = activation()
    # Each call its own parameters, buffers and residual, as each BatchNorm of a network has
    # (shared ones would add gradient accumulations to the backward).
    layers = [
        {
            "weight": torch.ones(channels, requires_grad=True),
            "bias": torch.zeros(channels, requires_grad=True),
            "running_mean": torch.zeros(channels),
            "running_var": torch.ones(channels),
            "residual": activation().requires_grad_(True) if residual else None,
        }
        for _ in range(depth)
    ]

    def forward() -> torch.Tensor:
        y = x
        for layer in layers:
            y = fn(
                y,
                layer["weight"],
                layer["bias"],
                layer["running_mean"],
                layer["running_var"],
                0.1,
                1e-5,
                layer["residual"],
                True,
            )
        return y

    leaves = [x] + [layer[name] for layer in layers for name in ("weight", "bias")]
    leaves += [layer["residual"] for layer in layers if residual]

    def backward(out: torch.Tensor) -> None:
        # autograd.grad, not .backward(): no accumulation into .grad (an optimizer step's cost).
        torch.autograd.grad(out, leaves, grad)

    def call() -> None:
        backward(forward())

    return forward, backward, call


def _kernel_ops(call) -> tuple[int, str]:
    """aten ops of one call that would each launch a device kernel: the outermost op that is not a
    view, allocation or conversion wrapper (``div`` by a Python number is one kernel on the GPU,
    though on CPU it converts the number first)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    names = []
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in _NO_KERNEL:
            continue
        parent = event.cpu_parent
        while parent is not None and (not parent.name.startswith("aten::") or parent.name in _NO_KERNEL):
            parent = parent.cpu_parent
        if parent is None:
            names.append(event.name)
    counts = collections.Counter(name.removeprefix("aten::") for name in names)
    return len(names), " ".join(f"{name} x{n}" for name, n in sorted(counts.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=300, help="timed chains per row")
    parser.add_argument("--depth", type=int, default=8, help="calls per chain (one backward pass)")
    args = parser.parse_args(argv)
    os.environ["AMP_FX_FORCE_TRITON"] = "1"
    torch.set_num_threads(1)
    launches = [0]
    _stub_kernels(launches)
    for name, fn in (("fused batch_norm_act", batch_norm_act), ("torch bn + add + relu", torch_batch_norm)):
        for residual in (False, True):
            forward, backward, call = _make_chain(fn, (2, 64, 2, 2), residual, args.depth)
            for _ in range(20):
                call()
            times = {"forward": [], "forward + backward": []}
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = forward()
                middle = time.perf_counter()
                backward(out)
                end = time.perf_counter()
                times["forward"].append((middle - start) / args.depth)
                times["forward + backward"].append((end - start) / args.depth)
            launches[0] = 0
            ops, names = _kernel_ops(call)
            timing = ", ".join(f"{k} {statistics.median(v) * 1e6:.0f} us" for k, v in times.items())
            print(
                f"{name}, residual={residual}: per call {timing}; {launches[0] / args.depth:g} Triton "
                f"launches, {ops / args.depth:g} other kernel-launching aten ops ({names})"
            )


if __name__ == "__main__":
    main()
