"""Rotary position embeddings in plain torch: the family's contract (``amp_fx.kernels.rotary``,
which has the math) computed with torch ops in fp32, on any device; the definition the Triton
kernels are tested against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.kernels.range_stats.reference import record_outputs_
from amp_fx.kernels.rotary.arguments import check_rotary_tensors

__all__ = ["rotary_backward", "rotary_forward"]


def _turn(x: Tensor, interleaved: bool) -> Tensor:
    """``rotate_half(x)`` (or its interleaved twin): each pair (a, b) becomes (-b, a)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _turn_back(x: Tensor, interleaved: bool) -> Tensor:
    """The transpose of `_turn`: each pair (a, b) becomes (b, -a)."""
    if interleaved:
        return torch.stack((x[..., 1::2], -x[..., 0::2]), -1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), -1)


def _rotate(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype, transposed: bool
) -> Tensor:
    # Written as the chain it replaces, with fp32 tables so every product and sum is fp32 (x's
    # values are exact in fp32; negation is exact): a' = a*c1 - b*s1, b' = b*c2 + a*s2, each
    # product and the sum rounded once, as the contract says, with no fp32 copy of x.
    width = cos.shape[-1]
    c, s = cos.float(), sin.float()
    part = x if width == x.shape[-1] else x[..., :width]
    if transposed:
        rotated = part * c + _turn_back(part * s, interleaved)
    else:
        rotated = part * c + _turn(part, interleaved) * s
    out = torch.empty_like(x, dtype=out_dtype)  # x's layout, as the fake implementation's
    if part is x:  # nothing passed through
        return out.copy_(rotated)
    out[..., :width] = rotated
    out[..., width:] = x[..., width:]
    return out


def rotary_forward(
    xs: Sequence[Tensor],
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    out_dtypes: Sequence[torch.dtype],
    record: KernelRecord | None = None,
) -> list[Tensor]:
    """Each x of ``xs``: ``x * cos + rotate_half(x) * sin`` on its first ``cos.shape[-1]`` features
    (the rest passed through), in fp32, rounded once to its ``out_dtypes`` entry: the contract of
    ``amp_fx.kernels.rotary`` (with ``record``, the outputs' range statistics recorded).

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.bfloat16)
        >>> cos, sin = torch.tensor([0.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 1.0])
        >>> rotary_forward([x], cos, sin, False, [torch.bfloat16])  # a quarter turn: (a, b) -> (-b, a)
        [tensor([[-3., -4.,  1.,  2.,  5.]], dtype=torch.bfloat16)]
        >>> rotary_forward([x, x], cos, sin, True, [torch.bfloat16, torch.float32])[1]
        tensor([[-2.,  1., -4.,  3.,  5.]])
    """
    check_rotary_tensors(xs, cos, sin, interleaved, out_dtypes)
    outs = [
        _rotate(x, cos, sin, interleaved, d, transposed=False) for x, d in zip(xs, out_dtypes, strict=True)
    ]
    record_outputs_(record, outs)
    return outs


def rotary_backward(
    grad_outs: Sequence[Tensor],
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    out_dtypes: Sequence[torch.dtype],
) -> list[Tensor]:
    """The gradients of `rotary_forward` w.r.t. its xs, given the gradients of its outputs: the
    transposed rotation, in fp32, rounded once to each ``out_dtypes`` entry (the xs' dtypes).

    Example:
        >>> g = torch.tensor([[-3.0, -4.0, 1.0, 2.0, 5.0]])
        >>> cos, sin = torch.zeros(4), torch.ones(4)
        >>> rotary_backward([g], cos, sin, False, [torch.float32])  # the quarter turn undone
        [tensor([[1., 2., 3., 4., 5.]])]
    """
    check_rotary_tensors(grad_outs, cos, sin, interleaved, out_dtypes)
    return [
        _rotate(g, cos, sin, interleaved, d, transposed=True)
        for g, d in zip(grad_outs, out_dtypes, strict=True)
    ]
