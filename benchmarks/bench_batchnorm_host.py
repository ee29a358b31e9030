"""Host cost of one fused BatchNorm call (forward + backward), measured on CPU without a GPU.

In an eager training step every `amp_fx.norms.batch_norm_act` call costs Python and dispatcher
time on the host, and every torch op it runs besides the Triton kernels becomes a small device
kernel on the GPU. This script measures both where no GPU is needed:

- the Triton kernels of ``amp_fx.kernels.batch_norm`` are replaced by stubs that only count their
  launches (so the time is everything around the launches: argument checks, autograd, custom-op
  dispatch, allocations, grid sizes, and the torch ops on tiny CPU tensors);
- ``AMP_FX_FORCE_TRITON=1`` routes the CPU tensors to the Triton wrappers;
- ``torch.profiler`` counts the aten ops of one call that would launch a device kernel (views,
  allocations and metadata ops excluded).

Triton's own launch cost (binding the arguments, the driver call) is not included; count it from
the launch numbers. Median microseconds over many calls, on a tiny (2, 64, 2, 2) fp16 input::

    python benchmarks/bench_batchnorm_host.py
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from amp_fx.kernels import batch_norm
from amp_fx.norms import batch_norm_act

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


def _make_call(shape: tuple[int, int, int, int], residual: bool):
    generator = torch.Generator().manual_seed(0)

    def activation() -> torch.Tensor:
        values = torch.randn(shape, generator=generator).half()
        return values.contiguous(memory_format=torch.channels_last)

    channels = shape[1]
    x = activation().requires_grad_(True)
    identity = activation().requires_grad_(True) if residual else None
    weight = torch.ones(channels, requires_grad=True)
    bias = torch.zeros(channels, requires_grad=True)
    running_mean, running_var = torch.zeros(channels), torch.ones(channels)
    grad = activation()

    def forward() -> torch.Tensor:
        return batch_norm_act(x, weight, bias, running_mean, running_var, 0.1, 1e-5, identity, True)

    leaves = [x, weight, bias] + ([identity] if residual else [])

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
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    os.environ["AMP_FX_FORCE_TRITON"] = "1"
    torch.set_num_threads(1)
    launches = [0]
    _stub_kernels(launches)
    for residual in (False, True):
        forward, backward, call = _make_call((2, 64, 2, 2), residual)
        for _ in range(50):
            call()
        times = {"forward": [], "forward + backward": []}
        for _ in range(args.calls):
            start = time.perf_counter()
            out = forward()
            middle = time.perf_counter()
            backward(out)
            end = time.perf_counter()
            times["forward"].append(middle - start)
            times["forward + backward"].append(end - start)
        launches[0] = 0
        ops, names = _kernel_ops(call)
        timing = ", ".join(f"{k} {statistics.median(v) * 1e6:.0f} us" for k, v in times.items())
        print(
            f"residual={residual}: {timing}; per call {launches[0]} Triton launches, "
            f"{ops} other kernel-launching aten ops ({names})"
        )


if __name__ == "__main__":
    main()
