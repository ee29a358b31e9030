"""Rotary position embeddings: amp_fx's fused call against the eager torch chain it replaces.

Forward + backward of q and k at Llama-0.5B's attention shapes (batch 8, sequence 2048, 12 query
and 4 key/value heads of 128 features, bf16), q and k the transposed views of their projections
as Llama makes them, cos and sin fp32 [1, seq, 128] as Hugging Face computes them from position
ids (``--cos-batch`` gives them the batch dimension), unsqueezed at the head dimension:

    eager_chain    q * cos + rotate_half(q) * sin, then .to(bf16): what an unfused O2 graph runs
                   (the products and the sum in fp32) and what torch.autocast runs
    compiled_chain the same chain under torch.compile (Inductor's fused kernel), with --compile
    fused          amp_fx.ops.rotary.rotary_embedding(q, cos, sin, dtype=bf16), and the same for k:
                   one kernel per tensor each way
    fused_pair     amp_fx.ops.rotary.rotary_embedding_pair(q, k, cos, sin, ...): q and k in one
                   launch each way, what fuse_rotary puts in the graph where both chains share
                   cos and sin

Per row: median ms (``triton.testing.do_bench``: wall-clock, bounded by host time at small sizes),
the kernels' time per step from torch.profiler (GPU ms), effective GB/s of that counting the fused
kernels' minimum traffic (forward reads q and k and writes their results, backward reads the gradients and
writes dq and dk: 4 x (q + k) bytes, plus cos and sin once each way), the same as a share of the
measured copy ceiling (a device-to-device copy of q + k, bytes read + written), and the largest
differences from ``eager_chain`` (outputs, gradients). GPU only::

    python benchmarks/bench_rotary.py --compile
"""

from __future__ import annotations

import argparse

import torch
from kernel_breakdown import device_ms
from reporting import environment, publish
from triton.testing import do_bench

from amp_fx.ops.rotary import rotary_embedding, rotary_embedding_pair


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def eager_chain(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotary_embedding(x, cos, sin, dtype=x.dtype)


def _projection(batch: int, seq: int, heads: int, dim: int, dtype: torch.dtype, generator) -> torch.Tensor:
    """A leaf [batch, seq, heads, dim] (a projection's output) seen as [batch, heads, seq, dim]."""
    base = torch.randn(batch, seq, heads, dim, device="cuda", generator=generator).to(dtype)
    return base.requires_grad_(True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--q-heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--cos-batch", action="store_true", help="cos and sin [batch, seq, dim], not [1, ...]"
    )
    parser.add_argument("--compile", action="store_true", help="add the torch.compile'd chain")
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_rotary.py needs a CUDA device")
    dtype = torch.bfloat16
    generator = torch.Generator(device="cuda").manual_seed(0)
    q_base = _projection(args.batch, args.seq, args.q_heads, args.head_dim, dtype, generator)
    k_base = _projection(args.batch, args.seq, args.kv_heads, args.head_dim, dtype, generator)
    table_batch = args.batch if args.cos_batch else 1
    angles = torch.randn(table_batch, args.seq, args.head_dim // 2, device="cuda", generator=generator)
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    grad_q = torch.randn(q_base.transpose(1, 2).shape, device="cuda", generator=generator).to(dtype)
    grad_k = torch.randn(k_base.transpose(1, 2).shape, device="cuda", generator=generator).to(dtype)

    def step(embed, pair=False):
        def run():
            q_base.grad = k_base.grad = None
            q, k = q_base.transpose(1, 2), k_base.transpose(1, 2)
            if pair:
                q_out, k_out = rotary_embedding_pair(q, k, cos, sin, dtypes=(dtype, dtype))
            else:
                q_out, k_out = embed(q, cos, sin), embed(k, cos, sin)
            torch.autograd.backward([q_out, k_out], [grad_q, grad_k])
            return q_out, k_out

        return run

    variants = {"eager_chain": step(eager_chain)}
    if args.compile:
        variants["compiled_chain"] = step(torch.compile(eager_chain))
    variants["fused"] = step(fused)
    variants["fused_pair"] = step(None, pair=True)

    qk_bytes = (q_base.numel() + k_base.numel()) * q_base.element_size()
    table_bytes = 2 * 2 * cos.numel() * cos.element_size()  # cos and sin, read once each way
    moved = 4 * qk_bytes + table_bytes
    source = torch.empty(qk_bytes // 2, dtype=dtype, device="cuda")
    target = torch.empty_like(source)
    copy_ms = do_bench(lambda: target.copy_(source), warmup=25, rep=200, return_mode="median")
    ceiling = 2 * qk_bytes / copy_ms / 1e6
    reference = step(eager_chain)()
    reference_grads = (q_base.grad.clone(), k_base.grad.clone())
    lines = [
        f"#### Rotary embeddings forward + backward, q {tuple(grad_q.shape)} k {tuple(grad_k.shape)} bf16, "
        f"cos/sin {tuple(cos.shape)} fp32 - {environment()}",
        "",
        f"Copy ceiling: {ceiling:.0f} GB/s ({copy_ms:.3f} ms for q + k bytes read and written).",
        "",
        "| variant | ms | GPU ms | GB/s (4 x (q + k) bytes + tables, of GPU ms) | of ceiling | "
        "vs eager_chain | max out diff | max grad diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    times: dict[str, float] = {}
    for name, run in variants.items():
        outputs = run()
        out_diff = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(outputs, reference, strict=True)
        )
        grads = (q_base.grad, k_base.grad)
        grad_diff = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference_grads, strict=True)
        )
        times[name] = do_bench(run, warmup=25, rep=200, return_mode="median")
        kernel_ms = device_ms(run, torch.device("cuda"))
        gbps = moved / kernel_ms / 1e6
        lines.append(
            f"| {name} | {times[name]:.3f} | {kernel_ms:.3f} | {gbps:.0f} | {gbps / ceiling:.0%} | "
            f"{times[name] / times['eager_chain']:.2f}x | {out_diff:.1e} | {grad_diff:.1e} |"
        )
    publish("\n".join(lines) + "\n", args.markdown)


if __name__ == "__main__":
    main()
