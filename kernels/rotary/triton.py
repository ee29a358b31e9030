"""Fused rotary position embeddings of fp16/bf16/fp32 tensors, computed in fp32.

What: the family's contract, ``amp_fx.kernels.rotary``, which has the math.

Why fused: ``q * cos + rotate_half(q) * sin`` from torch parts is six kernels (two slices copied by
the concatenation, a negation, two products and a sum), each reading and writing a tensor of q's
size, and at O2 the products run in fp32 (cos and sin are fp32), so half of that traffic is fp32;
the backward repeats it. Here one kernel reads q once and writes the result once, each way, in
the dtypes the graph asks for, and cos and sin (one row per position, shared by every head) are
read once per position from cache.

How: the tensor is seen as 4-D (A0, A1, A2, D) with its own strides, cos and sin as views
broadcast to (A0, A1, A2, R) (stride 0 where they broadcast). The wrapper puts the leading
dimension along which cos and sin do not change (the heads) at A1, so one program takes one
(i0, i2) position and loops over its heads BLOCK_H at a time: a [BLOCK_H, R/2] tile of pairs (a, b)
and the cos/sin values at both features of each pair, then the D - R pass-through features.
Loads and stores follow each tensor's strides, so the transposed q of a [batch, heads, seq, dim]
view is read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.devices import on_device
from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.rotary.arguments import check_rotary_arguments
from amp_fx.kernels.rounding import round_to_dtype

__all__ = ["rotary_backward", "rotary_forward"]

# Elements of pairs per tile: 2048 pairs (4096 features) with 4 warps is 32 pairs per thread, enough
# loads in flight per program for a memory-bound kernel without spilling.
_PAIRS_PER_TILE = 2048
_NUM_WARPS = 4
_MAX_DIMS = 4


@triton.jit
def _rotary_kernel(
    x_ptr,  # input (A0, A1, A2, D), any strides: element (i0, i1, i2, f) at x_ptr + i0*xs0 + ... + f*xs3
    xs0,
    xs1,
    xs2,
    xs3,
    out_ptr,  # OUT_DTYPE* (A0, A1, A2, D) out, with its own strides
    os0,
    os1,
    os2,
    os3,
    cos_ptr,  # (A0, A1, A2, R) broadcast view: stride 0 along the dimensions cos is shared over
    cs0,
    cs1,
    cs2,
    cs3,
    sin_ptr,  # as cos, with its own strides
    ss0,
    ss1,
    ss2,
    ss3,
    size1,  # A1: the dimension each program loops over (the heads)
    size2,  # A2
    width,  # D: features of x
    rotary_width,  # R: features rotated (even, <= D)
    INTERLEAVED: tl.constexpr,  # pairs (2j, 2j + 1) instead of (j, j + R/2)
    TRANSPOSED: tl.constexpr,  # the backward: rotation by -sin
    OUT_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    position = tl.program_id(0).to(tl.int64)
    i0 = position // size2
    i2 = position % size2
    x_row = x_ptr + i0 * xs0 + i2 * xs2
    out_row = out_ptr + i0 * os0 + i2 * os2
    cos_row = cos_ptr + i0 * cs0 + i2 * cs2
    sin_row = sin_ptr + i0 * ss0 + i2 * ss2

    half = rotary_width // 2
    pairs = tl.arange(0, BLOCK_PAIRS)[None, :]
    if INTERLEAVED:
        feature_a = 2 * pairs
        feature_b = feature_a + 1
    else:
        feature_a = pairs
        feature_b = pairs + half
    heads = tl.arange(0, BLOCK_H)[:, None]
    for head_start in range(0, size1, BLOCK_H):
        head = (head_start + heads).to(tl.int64)
        mask = (head < size1) & (pairs < half)
        a = tl.load(x_row + head * xs1 + feature_a * xs3, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + head * xs1 + feature_b * xs3, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_row + head * cs1 + feature_a * cs3, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_row + head * cs1 + feature_b * cs3, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_row + head * ss1 + feature_a * ss3, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_row + head * ss1 + feature_b * ss3, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSED:
            new_a = a * c1 + b * s2
            new_b = b * c2 - a * s1
        else:
            new_a = a * c1 - b * s1
            new_b = b * c2 + a * s2
        tl.store(out_row + head * os1 + feature_a * os3, round_to_dtype(new_a, OUT_DTYPE), mask=mask)
        tl.store(out_row + head * os1 + feature_b * os3, round_to_dtype(new_b, OUT_DTYPE), mask=mask)
        # Features past R pass through (partial rotary, GPT-NeoX and Phi), converted to OUT_DTYPE.
        for pass_start in range(rotary_width, width, BLOCK_PASS):
            feature = pass_start + tl.arange(0, BLOCK_PASS)[None, :]
            pass_mask = (head < size1) & (feature < width)
            value = tl.load(x_row + head * xs1 + feature * xs3, mask=pass_mask, other=0.0).to(tl.float32)
            tl.store(out_row + head * os1 + feature * os3, round_to_dtype(value, OUT_DTYPE), mask=pass_mask)


def _four_dims(t: Tensor) -> Tensor:
    return t.reshape((1,) * (_MAX_DIMS - t.dim()) + tuple(t.shape)) if t.dim() < _MAX_DIMS else t


def _rotate(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype, transposed: bool
) -> Tensor:
    check_rotary_arguments(x, cos, sin, interleaved, out_dtype)
    if x.dim() > _MAX_DIMS:
        raise ValueError(
            f"the Triton rotary kernels take at most {_MAX_DIMS} dimensions, x has {x.dim()}; "
            "use amp_fx.kernels.reference.rotary_forward/rotary_backward"
        )
    out = torch.empty_like(x, dtype=out_dtype)
    if out.numel() == 0:
        return out
    rotary_width = cos.shape[-1]
    rotated_shape = (*x.shape[:-1], rotary_width)
    views = [_four_dims(t) for t in (x, out, cos.expand(rotated_shape), sin.expand(rotated_shape))]
    x4, _, cos4, sin4 = views
    # The loop dimension: the largest leading one cos and sin are shared over (the heads).
    shared = [d for d in range(_MAX_DIMS - 1) if cos4.stride(d) == 0 and sin4.stride(d) == 0]
    loop = max(shared, key=lambda d: x4.shape[d]) if shared else 1
    outer, inner = (d for d in range(_MAX_DIMS - 1) if d != loop)
    x4, out4, cos4, sin4 = (t.permute(outer, loop, inner, _MAX_DIMS - 1) for t in views)
    size0, size1, size2, width = x4.shape
    block_pairs = triton.next_power_of_2(max(rotary_width // 2, 1))
    block_h = max(1, min(triton.next_power_of_2(size1), _PAIRS_PER_TILE // block_pairs))
    block_pass = max(16, min(triton.next_power_of_2(max(width - rotary_width, 1)), 2 * block_pairs))
    with on_device(x.device):
        _rotary_kernel[(size0 * size2,)](
            x4, *x4.stride(),
            out4, *out4.stride(),
            cos4, *cos4.stride(),
            sin4, *sin4.stride(),
            size1, size2, width, rotary_width,
            INTERLEAVED=interleaved,
            TRANSPOSED=transposed,
            OUT_DTYPE=triton_dtype(out_dtype),
            BLOCK_H=block_h,
            BLOCK_PAIRS=block_pairs,
            BLOCK_PASS=block_pass,
            num_warps=_NUM_WARPS,
        )  # fmt: skip
    return out


def rotary_forward(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype) -> Tensor:
    """x's first ``cos.shape[-1]`` features rotated by (cos, sin), the rest passed through, in fp32,
    rounded once to ``out_dtype``: the contract of ``amp_fx.kernels.rotary``. One launch.

    Example:
        >>> q = torch.randn(8, 12, 2048, 128, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
        >>> cos = torch.randn(8, 1, 2048, 128, device="cuda"); sin = torch.randn_like(cos)  # doctest: +SKIP
        >>> rotary_forward(q, cos, sin, False, torch.bfloat16).shape  # doctest: +SKIP
        torch.Size([8, 12, 2048, 128])
    """
    return _rotate(x, cos, sin, interleaved, out_dtype, transposed=False)


def rotary_backward(
    grad_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    """The gradient of `rotary_forward` w.r.t. x (the transposed rotation), in ``out_dtype``.

    Example:
        >>> grad_q = rotary_backward(grad_out, cos, sin, False, torch.bfloat16)  # doctest: +SKIP
    """
    return _rotate(grad_out, cos, sin, interleaved, out_dtype, transposed=True)
