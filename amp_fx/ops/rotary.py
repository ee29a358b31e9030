"""Rotary position embeddings in one call: `rotary_embedding`, what `amp_fx.passes.fuse_rotary`
puts in place of a graph's ``q * cos + rotate_half(q) * sin`` chain.

From torch parts a rotary embedding is six elementwise kernels per tensor each way, and at O2
(fp32 cos and sin against fp16/bf16 q) its products and sum run in fp32, writing fp32
intermediates of q's size. `rotary_embedding` reads q once in its own dtype, computes in fp32 and
writes the result once, in the dtype the graph asks for (``dtype``: the cast after the chain that
the fusion folds in, else the dtype the chain computes in); the backward is the transposed
rotation, written once in q's dtype (``amp_fx.kernels.rotary`` has the math).

The kernels are wrapped as the custom ops ``amp_fx::rotary_embedding`` (x, cos, sin, interleaved,
out_dtype) and ``amp_fx::rotary_embedding_backward``, with fake implementations and autograd, so
the call works under autograd, ``torch.compile`` and ``torch.export``. They run the Triton kernels
on CUDA tensors of at most 4 dimensions and the pure-torch reference elsewhere. Gradients flow to
x and, when they require it, to cos and sin (plain torch math: position tables rarely need one).

A call whose tensors do not fit the kernels' contract (odd or mismatched widths, cos not
broadcastable to x without enlarging it, float64) computes the chain it replaces with torch ops,
so the call always has the chain's value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.arguments import PARAM_DTYPES
from amp_fx.kernels.rotary.arguments import rotary_width_problem

__all__ = ["rotary_embedding", "rotary_embedding_op", "rotary_embedding_backward", "rotary_chain"]

# The Triton kernels index at most this many dimensions; larger tensors run the reference.
_TRITON_MAX_DIMS = 4


def _implementation(x: Tensor):
    # Imported on first use: convert imports this module, and Triton need not load until it runs.
    from amp_fx.kernels import implementation_for, reference

    return implementation_for([x]) if x.dim() <= _TRITON_MAX_DIMS else reference


@torch.library.custom_op("amp_fx::rotary_embedding", mutates_args=())
def rotary_embedding_op(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    """x's first ``cos.shape[-1]`` features rotated by (cos, sin) in fp32, the rest passed through,
    in ``out_dtype`` (the contract of ``amp_fx.kernels.rotary``)."""
    return _implementation(x).rotary_forward(x, cos, sin, interleaved, out_dtype)


@rotary_embedding_op.register_fake
def _rotary_embedding_fake(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    return torch.empty_like(x, dtype=out_dtype)


@torch.library.custom_op("amp_fx::rotary_embedding_backward", mutates_args=())
def rotary_embedding_backward(
    grad_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    """The gradient of `rotary_embedding_op` w.r.t. x: the transposed rotation, in ``out_dtype``."""
    return _implementation(grad_out).rotary_backward(grad_out, cos, sin, interleaved, out_dtype)


@rotary_embedding_backward.register_fake
def _rotary_embedding_backward_fake(
    grad_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    return torch.empty_like(grad_out, dtype=out_dtype)


def _rotate_pairs(x: Tensor, interleaved: bool) -> Tensor:
    """``rotate_half(x)`` (or its interleaved twin): each pair (a, b) becomes (-b, a)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    x, cos, sin, interleaved, _ = inputs
    table_grads = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    ctx.save_for_backward(cos, sin, x if table_grads else None)
    ctx.interleaved = interleaved
    ctx.x_dtype = x.dtype


def _backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
    cos, sin, x = ctx.saved_tensors
    grad_x = grad_cos = grad_sin = None
    if ctx.needs_input_grad[0]:
        grad_x = rotary_embedding_backward(grad_out, cos, sin, ctx.interleaved, ctx.x_dtype)
    if x is not None:
        # d(x*cos + rot(x)*sin)/dcos = x, /dsin = rot(x), summed over what cos and sin broadcast over.
        width = cos.shape[-1]
        grad = grad_out[..., :width].float()
        rotated = x[..., :width].float()
        if ctx.needs_input_grad[1]:
            grad_cos = (grad * rotated).sum_to_size(cos.shape).to(cos.dtype)
        if ctx.needs_input_grad[2]:
            grad_sin = (grad * _rotate_pairs(rotated, ctx.interleaved)).sum_to_size(sin.shape).to(sin.dtype)
    return grad_x, grad_cos, grad_sin, None, None


rotary_embedding_op.register_autograd(_backward, setup_context=_setup_context)


def rotary_chain(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    chunked: bool = False,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """The torch chain `rotary_embedding` stands for, op by op (what a call that does not fit the
    kernels computes)::

        r = x if rotary_dim is None else x[..., :rotary_dim]
        y = r * cos + rotate_half(r) * sin          # rotate_half: cat((-r2, r1), -1), or
                                                    # stack((-r[..., 1::2], r[..., ::2]), -1).flatten(-2)
        y = y if rotary_dim is None else cat((y, x[..., rotary_dim:]), -1)
        y if dtype is None else y.to(dtype)

    ``chunked``: the halves are ``r.chunk(2, -1)`` (the first one the larger for an odd width)
    rather than ``r[..., :w // 2]``, ``r[..., w // 2:]``.

    Example:
        >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
        >>> rotary_chain(x, torch.zeros(2), torch.ones(2), rotary_dim=2)
        tensor([[-2.,  1.,  3.,  4.]])
    """
    rotated = x if rotary_dim is None else x[..., :rotary_dim]
    if chunked and not interleaved:
        first, second = rotated.chunk(2, -1)
        turned = torch.cat((-second, first), -1)
    else:
        turned = _rotate_pairs(rotated, interleaved)
    out = rotated * cos + turned * sin
    if rotary_dim is not None:
        out = torch.cat((out, x[..., rotary_dim:]), -1)
    return out if dtype is None else out.to(dtype)


def _fits_kernels(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None, dtype: torch.dtype | None
) -> bool:
    """Whether the kernels compute this call: dtypes, shapes and devices only, so torch.compile
    decides it while tracing."""
    if not all(isinstance(t, Tensor) for t in (x, cos, sin)) or x.dim() == 0 or cos.dim() == 0:
        return False
    if any(t.dtype not in PARAM_DTYPES for t in (x, cos, sin)) or (
        dtype is not None and dtype not in PARAM_DTYPES
    ):
        return False
    if cos.device != x.device or sin.device != x.device:
        return False
    width = x.shape[-1]
    if rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0:
            return False
        width = min(rotary_dim, width)
    return cos.shape[-1] == width and rotary_width_problem(x.shape, cos.shape, sin.shape) is None


def rotary_embedding(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    chunked: bool = False,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """`rotary_chain`'s value in one call: ``x * cos + rotate_half(x) * sin`` on the first
    ``rotary_dim`` features (all when None), the rest passed through, computed in fp32 and rounded
    once to ``dtype`` (None: the dtype the chain computes in, x's, cos' and sin's promoted).

    Fused (one kernel each way) when x, cos and sin are fp16, bf16 or fp32 on one device, cos and
    sin have the rotated width (even) and broadcast to the rotated features without enlarging
    them. Any other call returns `rotary_chain` (and its errors). Against the chain a fused call
    rounds once where the chain may round after each op (low-precision cos and sin).

    Example:
        >>> q = torch.randn(2, 4, 3, 8, dtype=torch.bfloat16, requires_grad=True)
        >>> cos, sin = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
        >>> out = rotary_embedding(q, cos, sin, dtype=torch.bfloat16)
        >>> out.dtype, out.shape
        (torch.bfloat16, torch.Size([2, 4, 3, 8]))
        >>> expected = rotary_chain(q.detach(), cos, sin, dtype=torch.bfloat16)
        >>> torch.equal(out, expected)
        True
        >>> out.sum().backward(); q.grad.dtype
        torch.bfloat16
    """
    if not _fits_kernels(x, cos, sin, rotary_dim, dtype):
        return rotary_chain(
            x, cos, sin, rotary_dim=rotary_dim, interleaved=interleaved, chunked=chunked, dtype=dtype
        )
    out_dtype = (
        dtype
        if dtype is not None
        else torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    )
    return rotary_embedding_op(x, cos, sin, interleaved, out_dtype)
