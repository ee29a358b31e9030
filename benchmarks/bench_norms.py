"""Fused norms: amp_fx's RMSNorm / LayerNorm kernels against the eager torch chains they replace.

Forward + backward at Llama-0.5B's shapes (8 x 2048 rows, 1536 wide) on O2's dtypes: an fp32
residual stream, a bf16 branch (the attention's or MLP's output), fp32 weights, the normed output
cast to bf16 for the next matmuls. Variants, each as eager torch (what autocast and an unfused O2
graph run) and fused (`amp_fx.ops.norms`, what `fuse_norms` puts in the graph):

    rms           x (bf16) -> Llama's RMSNorm -> bf16
    add_rms       stream (fp32) + branch (bf16) -> RMSNorm -> (fp32 sum, bf16 output)
    layer         x (bf16) -> LayerNorm (fp32 math) -> bf16
    add_layer     stream (fp32) + branch (bf16) -> LayerNorm -> (fp32 sum, bf16 output)

Per row: median ms (``triton.testing.do_bench``: wall-clock, which host time bounds at small
sizes), the kernels' time per step from torch.profiler (GPU ms), GB/s of that counting the fused
kernels' minimum traffic (every input and output read or written once, forward and backward),
that as a share of the measured copy bandwidth (a device-to-device copy of 1 GiB, bytes read + written: the
ceiling), the speedup of fused over eager, and the largest output difference. GPU only::

    python benchmarks/bench_norms.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from kernel_breakdown import device_ms
from reporting import environment, publish

from amp_fx.ops.norms import add_layer_norm_fp32, add_rms_norm_fp32, layer_norm_fp32, rms_norm_fp32

EPS = 1e-6
LOW = torch.bfloat16


def eager_rms(x, weight):
    """transformers' LlamaRMSNorm on what O2 and autocast feed it, then the cast for the matmuls."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return (weight * h.to(torch.float32)).to(LOW)


def eager_layer(x, weight, bias):
    return F.layer_norm(x.float(), x.shape[-1:], weight, bias, EPS).to(LOW)


# name: (eager, fused, has a residual, has a bias); each called as f(x, residual, weight, bias).
VARIANTS = {
    "rms": (
        lambda x, r, w, b: eager_rms(x, w),
        lambda x, r, w, b: rms_norm_fp32(x, w, EPS, out_dtype=LOW),
        False,
        False,
    ),
    "add_rms": (
        lambda x, r, w, b: (r + x, eager_rms(r + x, w)),
        lambda x, r, w, b: add_rms_norm_fp32(x, r, w, EPS, out_dtype=LOW),
        True,
        False,
    ),
    "layer": (
        lambda x, r, w, b: eager_layer(x, w, b),
        lambda x, r, w, b: layer_norm_fp32(x, x.shape[-1:], w, b, EPS, out_dtype=LOW),
        False,
        True,
    ),
    "add_layer": (
        lambda x, r, w, b: (r + x, eager_layer(r + x, w, b)),
        lambda x, r, w, b: add_layer_norm_fp32(x, r, x.shape[-1:], w, b, EPS, out_dtype=LOW),
        True,
        True,
    ),
}


def minimum_bytes(rows: int, width: int, residual: bool, bias: bool) -> int:
    """What a fused forward + backward must move: inputs read, outputs written, once each."""
    low, fp32 = torch.tensor([], dtype=LOW).element_size(), 4
    if residual:  # fwd: branch, stream in; sum, out out. bwd: sum, d_out, d_sum in; d_stream, d_branch out
        per_element = (low + fp32 + fp32 + low) + (fp32 + low + fp32 + fp32 + low)
    else:  # fwd: x in, out out. bwd: x, d_out in; d_x out
        per_element = (low + low) + (low + low + low)
    return rows * width * per_element + (2 if bias else 1) * 2 * width * fp32


def copy_bandwidth(do_bench) -> float:
    """Bytes per second of a device-to-device copy (read + write), the ceiling."""
    source = torch.empty(2**28, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), warmup=25, rep=200, return_mode="median")
    return 2 * source.numel() * 4 / ms * 1e3


def _step(function, inputs, grads):
    """One forward + backward: the outputs (the sum first, with a residual) get ``grads``."""

    def run():
        for tensor in inputs:
            if tensor is not None:
                tensor.grad = None
        outputs = function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, grads)
        return outputs

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8 * 2048)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_norms.py needs a CUDA device")
    from triton.testing import do_bench

    ceiling = copy_bandwidth(do_bench)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype).requires_grad_()

    lines = [
        f"#### Fused norms, forward + backward, {args.rows} x {args.width}, bf16 on an fp32 stream - "
        f"{environment()}",
        "",
        f"Copy ceiling: {ceiling / 1e9:.0f} GB/s.",
        "",
        "| variant | eager ms | fused ms | speedup | eager GPU ms | fused GPU ms | GPU speedup | "
        "fused GB/s (GPU) | of ceiling | max out diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (eager, fused, residual, bias) in VARIANTS.items():
        rows, width = args.rows, args.width
        inputs = [
            randn(rows, width, dtype=LOW),
            randn(rows, width) if residual else None,
            randn(width),
            randn(width) if bias else None,
        ]
        grads = [randn(rows, width).detach()] if residual else []
        grads.append(randn(rows, width, dtype=LOW).detach())
        times, kernel_times, outs = {}, {}, {}
        for label, function in (("eager", eager), ("fused", fused)):
            run = _step(function, inputs, grads)
            outs[label] = run()[-1].detach().float()
            times[label] = do_bench(run, warmup=25, rep=200, return_mode="median")
            kernel_times[label] = device_ms(run, torch.device("cuda"))
        gbps = minimum_bytes(rows, width, residual, bias) / kernel_times["fused"] / 1e6
        diff = (outs["fused"] - outs["eager"]).abs().max().item()
        speedup = times["eager"] / times["fused"]
        kernel_speedup = kernel_times["eager"] / kernel_times["fused"]
        lines.append(
            f"| {name} | {times['eager']:.3f} | {times['fused']:.3f} | {speedup:.2f}x | "
            f"{kernel_times['eager']:.3f} | {kernel_times['fused']:.3f} | {kernel_speedup:.2f}x | "
            f"{gbps:.0f} | "
            f"{gbps * 1e9 / ceiling:.0%} | {diff:.1e} |"
        )
    publish("\n".join(lines) + "\n", args.markdown)


if __name__ == "__main__":
    main()
