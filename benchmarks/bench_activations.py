"""MLP activations on low-precision activations: amp_fx's fused fp32 calls against the eager chains.

Forward + backward at two shapes (``--shapes`` picks):

    llama  SwiGLU, bf16, 8 x 2048 rows x 4096 (a 0.5B Llama's intermediate size)
    gpt2   gelu_new, fp16, 16 x 1024 rows x 3072 (GPT-2's 4 x 768)

Variants per shape:

    eager     what an O2 graph ran before fusion: ``F.silu(gate) * up`` in bf16, or the gelu_new
              chain (``0.5 * x * (1 + tanh(...(x + 0.044715 * pow(x.float(), 3))))`` with its
              fp32 island and the cast back to fp16)
    fused     ``amp_fx.ops.activations.fp32_gated_activation`` / ``fp32_activation`` (Triton)
    compiled  the eager chain under ``torch.compile`` (Inductor's own fusion), for reference

Per row: median ms (``triton.testing.do_bench``), GB/s counting the fused kernels' minimum traffic
(gated: forward reads gate and up and writes the output, backward reads the gradient, gate and up
and writes two gradients: 8 tensors; alone: 2 + 3 = 5), that as a share of the measured ceiling (a
device-to-device copy of a tensor of that size, bytes read + written), and the largest difference
from the float64 result relative to its largest value (output, input gradient). GPU only::

    python benchmarks/bench_activations.py --markdown BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from reporting import environment, publish

from amp_fx.ops.activations import fp32_activation, fp32_gated_activation

# name -> (rows, columns, dtype, gated)
SHAPES = {
    "llama": (8 * 2048, 4096, torch.bfloat16, True),
    "gpt2": (16 * 1024, 3072, torch.float16, False),
}


def gelu_new_o2(x: torch.Tensor) -> torch.Tensor:
    """The gelu_new chain as an unfused O2 graph runs it: pow in fp32, the result cast back."""
    cubic = 0.044715 * torch.pow(x.float(), 3.0)
    out = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + cubic)))
    return out.to(x.dtype)


def _variants(gated: bool) -> dict[str, Callable[..., torch.Tensor]]:
    if gated:
        eager = lambda gate, up: F.silu(gate) * up  # noqa: E731
        return {
            "eager": eager,
            "fused": lambda gate, up: fp32_gated_activation(gate, up, "silu"),
            "compiled": torch.compile(eager),
        }
    return {
        "eager": gelu_new_o2,
        "fused": lambda x: fp32_activation(x, "gelu_tanh"),
        "compiled": torch.compile(gelu_new_o2),
    }


def _exact(inputs: list[torch.Tensor], grad: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    wide = [t.detach().double().requires_grad_() for t in inputs]
    out = F.silu(wide[0]) * wide[1] if gated else F.gelu(wide[0], approximate="tanh")
    out.backward(grad.double())
    return out.detach(), wide[0].grad


def _forward_backward(
    function: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor
) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        for tensor in inputs:
            tensor.grad = None
        out = function(*inputs)
        out.backward(grad)
        return out

    return run


def _copy_ms(numel: int, dtype: torch.dtype) -> float:
    from triton.testing import do_bench

    source = torch.empty(numel, dtype=dtype, device="cuda")
    target = torch.empty_like(source)
    return do_bench(lambda: target.copy_(source), warmup=25, rep=200, return_mode="median")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_activations.py needs a CUDA device")
    from triton.testing import do_bench

    generator = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        f"#### MLP activations forward + backward - {environment()}",
        "",
        "| shape | variant | ms | GB/s | of copy ceiling | vs eager | max out err | max grad err |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.shapes:
        rows, columns, dtype, gated = SHAPES[name]
        count = 2 if gated else 1
        inputs = [
            (torch.randn(rows, columns, device="cuda", generator=generator) * 2).to(dtype).requires_grad_()
            for _ in range(count)
        ]
        grad = torch.randn(rows, columns, device="cuda", generator=generator).to(dtype)
        exact_out, exact_grad = _exact(inputs, grad, gated)
        tensors_moved = 8 if gated else 5
        moved = tensors_moved * rows * columns * grad.element_size()
        ceiling = 2 * rows * columns * grad.element_size() / _copy_ms(rows * columns, dtype) / 1e6
        times: dict[str, float] = {}
        for variant, function in _variants(gated).items():
            run = _forward_backward(function, inputs, grad)
            out = run()
            out_err = ((out.double() - exact_out).abs().max() / exact_out.abs().max()).item()
            grad_err = ((inputs[0].grad.double() - exact_grad).abs().max() / exact_grad.abs().max()).item()
            times[variant] = do_bench(run, warmup=25, rep=200, return_mode="median")
            gbps = moved / times[variant] / 1e6
            lines.append(
                f"| {name} {rows}x{columns} {str(dtype).removeprefix('torch.')} | {variant} | "
                f"{times[variant]:.3f} | {gbps:.0f} | {gbps / ceiling:.0%} | "
                f"{times[variant] / times['eager']:.2f}x | {out_err:.1e} | {grad_err:.1e} |"
            )
        lines.append(f"| {name} | copy ceiling | | {ceiling:.0f} | 100% | | | |")
        del inputs, grad, exact_out, exact_grad
        torch.cuda.empty_cache()
    publish("\n".join(lines) + "\n", args.markdown)


if __name__ == "__main__":
    main()
