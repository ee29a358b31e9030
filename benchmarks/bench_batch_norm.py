"""Training-mode BatchNorm (+ residual add) (+ ReLU) on ResNet-50's activations: torch against
amp_fx's fused kernels.

Forward + backward, for every distinct BatchNorm shape of a torchvision ResNet-50 at batch 256,
224 x 224 (channels_last fp16 activations, fp32 BatchNorm parameters, as at O2):

    torch  y = F.batch_norm(x, ..., training=True); y += identity; F.relu(y, inplace=True)
           (torchvision's Bottleneck: the ReLU after the add, in place)
    fused  amp_fx.ops.batch_norm.batch_norm_act(x, ..., residual=identity, relu=...)

Per shape: median ms (``triton.testing.do_bench``, gradients of the input, the parameters and the
residual) of eager calls, which include each call's host cost (Python, dispatch, launches: a
small BatchNorm is host-bound), and of the same forward + backward captured once in a CUDA graph
and replayed (GPU time only: what the kernels cost when the host keeps up); the fused path's
effective GB/s in the graph, counting the passes it makes over the activations (forward: read x;
read x [+ identity], write y. Backward: read x, dy [+ y]; read x, dy [+ y], write dx [+ the
identity's gradient]; y is read only with a residual and ReLU), and the largest differences from
torch of the output and the input gradient, and the input gradient's norm-wise relative error
(torch rounds the normalized value before the add, the fused path once after it, so a sum that
rounds to the other side of 0 flips one ReLU mask entry: the max difference can be O(1) at a few
elements while the norm-wise error stays at fp16's rounding). Then the total over ResNet-50's 53
BatchNorms, each shape weighted by how many of them it has (convolutions and the rest of the step
not included), eager and in CUDA graphs. GPU only::

    python benchmarks/bench_batch_norm.py --markdown BENCHMARKS.md
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from reporting import environment, publish

from amp_fx.ops.batch_norm import batch_norm_act
from amp_fx.testing import normwise_error


@dataclass(frozen=True)
class BatchNormShape:
    channels: int
    size: int  # height = width
    residual: bool
    relu: bool
    count: int  # BatchNorms of this shape in ResNet-50
    where: str


# torchvision's ResNet-50 (Bottleneck, stride on the 3x3 conv). Each stage's first block has a 1x1
# conv1 at the previous stage's resolution, its 3x3 conv2 at the new one, and a downsample
# BatchNorm with no ReLU (its output is the identity of the residual add). 53 BatchNorms in all.
RESNET50_BATCH_NORMS = [
    BatchNormShape(64, 112, False, True, 1, "stem bn1"),
    BatchNormShape(64, 56, False, True, 6, "layer1 bn1, bn2"),
    BatchNormShape(256, 56, True, True, 3, "layer1 bn3"),
    BatchNormShape(256, 56, False, False, 1, "layer1 downsample"),
    BatchNormShape(128, 56, False, True, 1, "layer2.0 bn1"),
    BatchNormShape(128, 28, False, True, 7, "layer2 bn1, bn2"),
    BatchNormShape(512, 28, True, True, 4, "layer2 bn3"),
    BatchNormShape(512, 28, False, False, 1, "layer2 downsample"),
    BatchNormShape(256, 28, False, True, 1, "layer3.0 bn1"),
    BatchNormShape(256, 14, False, True, 11, "layer3 bn1, bn2"),
    BatchNormShape(1024, 14, True, True, 6, "layer3 bn3"),
    BatchNormShape(1024, 14, False, False, 1, "layer3 downsample"),
    BatchNormShape(512, 14, False, True, 1, "layer4.0 bn1"),
    BatchNormShape(512, 7, False, True, 5, "layer4 bn1, bn2"),
    BatchNormShape(2048, 7, True, True, 3, "layer4 bn3"),
    BatchNormShape(2048, 7, False, False, 1, "layer4 downsample"),
]


def torch_batch_norm(x, weight, bias, running_mean, running_var, residual, relu):
    y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True, momentum=0.1, eps=1e-5)
    if residual is not None:
        y += residual
    return F.relu(y, inplace=True) if relu else y


def fused_batch_norm(x, weight, bias, running_mean, running_var, residual, relu):
    return batch_norm_act(x, weight, bias, running_mean, running_var, 0.1, 1e-5, residual=residual, relu=relu)


def _forward_backward(fn, shape: BatchNormShape, tensors: dict):
    leaves = [tensors["x"], tensors["weight"], tensors["bias"]]
    if shape.residual:
        leaves.append(tensors["residual"])

    def run() -> tuple[torch.Tensor, ...]:
        y = fn(
            tensors["x"],
            tensors["weight"],
            tensors["bias"],
            tensors["running_mean"],
            tensors["running_var"],
            tensors["residual"] if shape.residual else None,
            shape.relu,
        )
        grads = torch.autograd.grad(y, leaves, tensors["grad"])
        return (y, *grads)

    return run


def _captured(run) -> torch.cuda.CUDAGraph:
    """``run`` captured in a CUDA graph, after warm-up calls on a side stream (compiles the Triton
    kernels and lets the allocator settle, as torch's CUDA graph notes ask)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph


def _passes(shape: BatchNormShape) -> int:
    """Activation-sized reads and writes of the fused forward + backward."""
    reads_out = shape.residual and shape.relu
    forward = 1 + (2 + shape.residual)  # statistics; apply (x [+ identity], write y)
    backward = (2 + reads_out) + (3 + reads_out + shape.residual)  # reduce; dx [+ identity's grad]
    return forward + backward


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_batch_norm.py needs a CUDA device")
    from triton.testing import do_bench

    generator = torch.Generator(device="cuda").manual_seed(0)
    lines = [
        f"#### BatchNorm (+ residual) (+ ReLU) forward + backward, ResNet-50 shapes at batch {args.batch}, "
        f"channels_last fp16, fp32 parameters - {environment()}",
        "",
        "| shape (N, C, H, W) | residual | relu | in ResNet-50 | torch ms | fused ms | fused / torch | "
        "torch graph ms | fused graph ms | graph fused / torch | fused graph GB/s (passes) | "
        "max out diff | max dx diff | dx norm-wise error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total_torch = total_fused = total_torch_graph = total_fused_graph = 0.0
    for shape in RESNET50_BATCH_NORMS:
        size = (args.batch, shape.channels, shape.size, shape.size)

        def activation(scale: float, offset: float, size=size) -> torch.Tensor:
            values = torch.randn(size, device="cuda", generator=generator) * scale + offset
            return values.to(torch.float16).contiguous(memory_format=torch.channels_last)

        tensors = {
            "x": activation(2.0, 0.5).requires_grad_(True),
            "residual": activation(1.0, 0.0).requires_grad_(True),
            "grad": activation(1.0, 0.0),
            "weight": (torch.rand(shape.channels, device="cuda", generator=generator) + 0.5).requires_grad_(
                True
            ),
            "bias": torch.randn(shape.channels, device="cuda", generator=generator).requires_grad_(True),
            "running_mean": torch.zeros(shape.channels, device="cuda"),
            "running_var": torch.ones(shape.channels, device="cuda"),
        }
        torch_run = _forward_backward(torch_batch_norm, shape, tensors)
        fused_run = _forward_backward(fused_batch_norm, shape, tensors)
        expected, ours = torch_run(), fused_run()
        out_diff = (ours[0].float() - expected[0].float()).abs().max().item()
        dx_diff = (ours[1].float() - expected[1].float()).abs().max().item()
        dx_error = normwise_error(ours[1], expected[1])
        del expected, ours
        torch_ms = do_bench(torch_run, warmup=10, rep=50, return_mode="median")
        fused_ms = do_bench(fused_run, warmup=10, rep=50, return_mode="median")
        graph_ms = []
        for run in (torch_run, fused_run):
            graph = _captured(run)
            graph_ms.append(do_bench(graph.replay, warmup=10, rep=50, return_mode="median"))
            del graph
        torch_graph_ms, fused_graph_ms = graph_ms
        total_torch += shape.count * torch_ms
        total_fused += shape.count * fused_ms
        total_torch_graph += shape.count * torch_graph_ms
        total_fused_graph += shape.count * fused_graph_ms
        passes = _passes(shape)
        gbps = passes * tensors["x"].numel() * tensors["x"].element_size() / fused_graph_ms / 1e6
        lines.append(
            f"| {size} | {'yes' if shape.residual else 'no'} | {'yes' if shape.relu else 'no'} | "
            f"{shape.count} ({shape.where}) | {torch_ms:.3f} | {fused_ms:.3f} | {fused_ms / torch_ms:.2f}x | "
            f"{torch_graph_ms:.3f} | {fused_graph_ms:.3f} | {fused_graph_ms / torch_graph_ms:.2f}x | "
            f"{gbps:.0f} ({passes}) | {out_diff:.1e} | {dx_diff:.1e} | {dx_error:.1e} |"
        )
        del tensors, torch_run, fused_run
        torch.cuda.empty_cache()
    count = sum(shape.count for shape in RESNET50_BATCH_NORMS)
    lines += [
        "",
        f"All {count} BatchNorms of ResNet-50 (each shape x its count above), forward + backward: "
        f"eager torch {total_torch:.2f} ms, fused {total_fused:.2f} ms ({total_fused / total_torch:.2f}x); "
        f"in CUDA graphs (GPU time) torch {total_torch_graph:.2f} ms, fused {total_fused_graph:.2f} ms "
        f"({total_fused_graph / total_torch_graph:.2f}x).",
    ]
    text = "\n".join(lines) + "\n"
    publish(text, args.markdown)


if __name__ == "__main__":
    main()
