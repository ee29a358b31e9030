"""2-D max pooling on channels_last activations: amp_fx.ops.max_pool.max_pool2d against F.max_pool2d.

ResNet-50's stem max-pool (a (256, 64, 112, 112) fp16 channels_last tensor, 3x3, stride 2,
padding 1: 0.82 ms forward and 1.83 ms backward per step in eager torch on an H200) and a few
other shapes. Per shape and variant: median ms (``triton.testing.do_bench``) of the forward, of
the backward alone (``torch.autograd.grad`` on a kept graph) and of forward + backward; effective
GB/s counting the bytes every implementation must move (forward: read the input, write the
output; backward: read the output gradient, write the input gradient; the offsets or indices
each implementation keeps come on top), and the largest differences from torch (output; input
gradient against torch's float32 backward rounded once). GPU only::

    python benchmarks/bench_max_pool.py --markdown BENCHMARKS.md

Without a GPU, ``--sm90-compile-check`` compiles every kernel variant of a few windows for sm_90
(``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` and Triton's bundled ptxas) and prints
registers and spills per kernel.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from reporting import environment, publish

from amp_fx.ops.max_pool import max_pool2d


@dataclass(frozen=True)
class PoolShape:
    name: str
    size: tuple[int, int, int, int]  # (N, C, H, W)
    kernel_size: int
    stride: int
    padding: int
    dtype: torch.dtype


SHAPES = [
    PoolShape("resnet50 stem", (256, 64, 112, 112), 3, 2, 1, torch.float16),
    PoolShape("resnet50 stem bf16", (256, 64, 112, 112), 3, 2, 1, torch.bfloat16),
    PoolShape("2x2/2 (vgg-like)", (64, 256, 56, 56), 2, 2, 0, torch.float16),
    PoolShape("3x3/1 pad 1 (inception-like)", (64, 192, 28, 28), 3, 1, 1, torch.float16),
]
VARIANTS = {"torch": F.max_pool2d, "amp_fx": max_pool2d}


def _timings(pool, x: torch.Tensor, shape: PoolShape, grad_out: torch.Tensor) -> dict[str, float]:
    from triton.testing import do_bench

    window = (shape.kernel_size, shape.stride, shape.padding)

    def forward() -> torch.Tensor:
        return pool(x, *window)

    kept = forward()

    def backward() -> None:
        torch.autograd.grad(kept, x, grad_out, retain_graph=True)

    def forward_backward() -> None:
        torch.autograd.grad(forward(), x, grad_out)

    return {
        "forward": do_bench(forward, warmup=25, rep=200, return_mode="median"),
        "backward": do_bench(backward, warmup=25, rep=200, return_mode="median"),
        "forward+backward": do_bench(forward_backward, warmup=25, rep=200, return_mode="median"),
    }


def _differences(x: torch.Tensor, shape: PoolShape, grad_out: torch.Tensor) -> tuple[float, float]:
    """Largest |difference| of amp_fx's output from torch's, and of its input gradient from torch's
    float32 backward rounded once to the dtype."""
    window = (shape.kernel_size, shape.stride, shape.padding)
    out = max_pool2d(x, *window)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    expected = F.max_pool2d(x, *window)
    x32 = x.detach().float().requires_grad_()
    (grad32,) = torch.autograd.grad(F.max_pool2d(x32, *window), x32, grad_out.float())
    out_diff = (out.float() - expected.float()).abs().max().item()
    grad_diff = (grad.float() - grad32.to(x.dtype).float()).abs().max().item()
    return out_diff, grad_diff


def sm90_compile_check() -> list[str]:
    """Compile the forward and backward kernels for sm_90 (no GPU needed): one line per variant
    with ptxas's register and spill counts."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from amp_fx.kernels.max_pool import triton as max_pool
    from amp_fx.kernels.pointer_table import triton_dtype

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    windows = {
        "3x3/2 pad 1": ((3, 3), (2, 2), (1, 1), (1, 1)),
        "2x2/2": ((2, 2), (2, 2), (0, 0), (1, 1)),
        "3x3/1 dilation 2": ((3, 3), (1, 1), (1, 1), (2, 2)),
        "5x5/3 pad 2": ((5, 5), (3, 3), (2, 2), (1, 1)),
    }
    sizes = ("channels", "height", "width", "out_height", "out_width")
    lines = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        pointer = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
        block_pixels, block_channels, _ = max_pool._launch_shape(256 * 56 * 56, 64, max_pool.LAUNCH)
        for label, (kernel, stride, padding, dilation) in windows.items():
            constants = {
                **max_pool._window_constants(kernel, stride, padding, dilation),
                "DTYPE": triton_dtype(dtype),
                "BLOCK_PIXELS": block_pixels,
                "BLOCK_CHANNELS": block_channels,
            }
            windows_h = max_pool._windows_reaching(kernel[0], stride[0], dilation[0])
            windows_w = max_pool._windows_reaching(kernel[1], stride[1], dilation[1])
            backward_constants = {
                **constants,
                "WINDOWS_H": windows_h,
                "WINDOWS_W": windows_w,
                "UNROLL_ROWS": windows_h * windows_w <= max_pool._MAX_UNROLLED_WINDOWS,
            }
            forward_signature = {
                "x_ptr": pointer,
                "out_ptr": pointer,
                "offsets_ptr": "*u8",
                "num_out_pixels": "i32",
            }
            backward_signature = {
                "grad_out_ptr": pointer,
                **{f"grad_out_stride_{d}": "i32" for d in "nchw"},
                "offsets_ptr": "*u8",
                "grad_in_ptr": pointer,
                "num_in_pixels": "i32",
            }
            kernels = (
                ("forward", max_pool._max_pool2d_forward_kernel, forward_signature, constants),
                ("backward", max_pool._max_pool2d_backward_kernel, backward_signature, backward_constants),
            )
            for direction, kernel_fn, signature, kernel_constants in kernels:
                signature = {
                    **signature,
                    **dict.fromkeys(sizes, "i32"),
                    **dict.fromkeys(kernel_constants, "constexpr"),
                }
                # Pointers 16-byte aligned and a channel count divisible by 16 (C = 64), as Triton
                # specializes them at a real launch.
                attrs = {
                    (i,): [["tt.divisibility", 16]]
                    for i, (name, kind) in enumerate(signature.items())
                    if kind.startswith("*") or name == "channels"
                }
                source = ASTSource(
                    fn=kernel_fn, signature=signature, constexprs=kernel_constants, attrs=attrs
                )
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as handle:
                    handle.write(compiled.asm["ptx"])
                result = subprocess.run(
                    [ptxas, "-v", "--gpu-name=sm_90a", handle.name, "-o", os.devnull],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                os.unlink(handle.name)
                info = "; ".join(
                    line.split("info    : ")[-1].strip()
                    for line in result.stderr.splitlines()
                    if "registers" in line or "spill" in line
                )
                name = str(dtype).removeprefix("torch.")
                lines.append(f"{name} {label} {direction}: {info}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    parser.add_argument(
        "--shapes", default=None, help="comma-separated indices into SHAPES (default: all), e.g. 0,2"
    )
    parser.add_argument(
        "--sm90-compile-check",
        action="store_true",
        help="compile every kernel variant for sm_90 (no GPU needed) and print registers and spills",
    )
    args = parser.parse_args(argv)
    if args.sm90_compile_check:
        print("\n".join(sm90_compile_check()))
        return
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("bench_max_pool.py needs a CUDA device")

    generator = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        f"#### Max-pool 2-D, channels_last - {environment()}",
        "",
        "GB/s: forward (input + output bytes) / ms, backward (output + input bytes) / ms.",
        "",
        "| shape | variant | fwd ms | fwd GB/s | bwd ms | bwd GB/s | fwd+bwd ms | vs torch | "
        "max out diff | max grad diff |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in shapes:
        x = torch.randn(shape.size, device="cuda", generator=generator).to(shape.dtype)
        x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        out = F.max_pool2d(x, shape.kernel_size, shape.stride, shape.padding)
        grad_out = torch.randn(out.shape, device="cuda", generator=generator).to(shape.dtype)
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
        moved = (x.numel() + out.numel()) * x.element_size()
        out_diff, grad_diff = _differences(x, shape, grad_out)
        times = {name: _timings(pool, x, shape, grad_out) for name, pool in VARIANTS.items()}
        label = (
            f"{shape.name} {tuple(shape.size)} {str(shape.dtype).removeprefix('torch.')} "
            f"{shape.kernel_size}x{shape.kernel_size}/{shape.stride} pad {shape.padding}"
        )
        for name, t in times.items():
            ratio = t["forward+backward"] / times["torch"]["forward+backward"]
            diffs = f"{out_diff:.3g} | {grad_diff:.3g}" if name == "amp_fx" else "- | -"
            lines.append(
                f"| {label} | {name} | {t['forward']:.3f} | {moved / t['forward'] / 1e6:.0f} | "
                f"{t['backward']:.3f} | {moved / t['backward'] / 1e6:.0f} | {t['forward+backward']:.3f} | "
                f"{ratio:.2f}x | {diffs} |"
            )
    table = "\n".join(lines) + "\n"
    publish(table, args.markdown)


if __name__ == "__main__":
    main()
