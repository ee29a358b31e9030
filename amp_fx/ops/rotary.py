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
the call works under autograd and ``torch.export`` (eager calls skip the custom ops' dispatch:
`amp_fx.ops.dispatch.fused_op`); under ``torch.compile`` the chain is traced instead, for Inductor
to fuse with its neighbours (`amp_fx.ops.dispatch.gives_expression`). The ops run the Triton kernels
on CUDA tensors of at most 4 dimensions; on a CPU an eager call computes the chain. Gradients flow to x
and, when they require it, to cos and sin (plain torch math: position tables rarely need one).

A call whose tensors do not fit the kernels' contract (odd or mismatched widths, cos not
broadcastable to x without enlarging it, float64) computes the chain it replaces with torch ops,
so the call always has the chain's value. Under `amp_fx.watch` the forward kernel records the
range statistics of the outputs it writes (`amp_fx.ops.range_record.kernel_record`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

# amp_fx.kernels loads Triton only when a CUDA tensor's kernels are asked for.
from amp_fx.kernels import implementation_for, reference
from amp_fx.kernels.arguments import KERNEL_DTYPES
from amp_fx.kernels.rotary.arguments import rotary_width_problem
from amp_fx.ops.dispatch import fused_op, gives_expression
from amp_fx.ops.range_record import kernel_record, records_in_kernel

__all__ = [
    "tables_fit",
    "rotary_chain",
    "rotary_embedding",
    "rotary_embedding_backward",
    "rotary_embedding_op",
    "rotary_embedding_pair",
    "rotary_embedding_pair_backward",
    "rotary_embedding_pair_op",
]

# The Triton kernels index at most this many dimensions; larger tensors run the reference.
_TRITON_MAX_DIMS = 4


def _implementation(*xs: Tensor):
    return implementation_for(xs) if all(x.dim() <= _TRITON_MAX_DIMS for x in xs) else reference


@fused_op("amp_fx::rotary_embedding")
def rotary_embedding_op(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    """x's first ``cos.shape[-1]`` features rotated by (cos, sin) in fp32, the rest passed through,
    in ``out_dtype`` (the contract of ``amp_fx.kernels.rotary``)."""
    record = kernel_record(x.device, [(None, out_dtype)])
    return _implementation(x).rotary_forward([x], cos, sin, interleaved, [out_dtype], record)[0]


@rotary_embedding_op.register_fake
def _rotary_embedding_fake(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    return torch.empty_like(x, dtype=out_dtype)


@fused_op("amp_fx::rotary_embedding_backward")
def rotary_embedding_backward(
    grad_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    """The gradient of `rotary_embedding_op` w.r.t. x: the transposed rotation, in ``out_dtype``."""
    return _implementation(grad_out).rotary_backward([grad_out], cos, sin, interleaved, [out_dtype])[0]


@rotary_embedding_backward.register_fake
def _rotary_embedding_backward_fake(
    grad_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> Tensor:
    return torch.empty_like(grad_out, dtype=out_dtype)


@fused_op("amp_fx::rotary_embedding_pair")
def rotary_embedding_pair_op(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """`rotary_embedding_op` of a query and a key sharing cos and sin: one launch when they differ
    only in their head counts."""
    record = kernel_record(q.device, [(0, q_dtype), (1, k_dtype)])
    q_out, k_out = _implementation(q, k).rotary_forward(
        [q, k], cos, sin, interleaved, [q_dtype, k_dtype], record
    )
    return q_out, k_out


@rotary_embedding_pair_op.register_fake
def _rotary_embedding_pair_fake(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q, dtype=q_dtype), torch.empty_like(k, dtype=k_dtype)


@fused_op("amp_fx::rotary_embedding_pair_backward")
def rotary_embedding_pair_backward(
    grad_q: Tensor,
    grad_k: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """The gradients of `rotary_embedding_pair_op` w.r.t. q and k, in one launch."""
    dq, dk = _implementation(grad_q, grad_k).rotary_backward(
        [grad_q, grad_k], cos, sin, interleaved, [q_dtype, k_dtype]
    )
    return dq, dk


@rotary_embedding_pair_backward.register_fake
def _rotary_embedding_pair_backward_fake(
    grad_q: Tensor,
    grad_k: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(grad_q, dtype=q_dtype), torch.empty_like(grad_k, dtype=k_dtype)


def _rotate_pairs(x: Tensor, interleaved: bool) -> Tensor:
    """``rotate_half(x)`` (or its interleaved twin): each pair (a, b) becomes (-b, a)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _table_grads(ctx, grads: list[Tensor | None], xs: list[Tensor]) -> tuple[Tensor | None, Tensor | None]:
    """d(x*cos + rot(x)*sin)/dcos = x, /dsin = rot(x), summed over what cos and sin broadcast over
    and over the tensors rotated (plain torch math: position tables rarely need a gradient)."""
    cos, sin = ctx.saved_tensors[:2]
    width = cos.shape[-1]
    grad_cos = grad_sin = None
    for grad, x in zip(grads, xs, strict=True):
        if grad is None:
            continue
        g, rotated = grad[..., :width].float(), x[..., :width].float()
        if ctx.needs_input_grad[ctx.cos_index]:
            term = (g * rotated).sum_to_size(cos.shape)
            grad_cos = term if grad_cos is None else grad_cos + term
        if ctx.needs_input_grad[ctx.cos_index + 1]:
            term = (g * _rotate_pairs(rotated, ctx.interleaved)).sum_to_size(sin.shape)
            grad_sin = term if grad_sin is None else grad_sin + term
    return (
        None if grad_cos is None else grad_cos.to(cos.dtype),
        None if grad_sin is None else grad_sin.to(sin.dtype),
    )


def _save(ctx, xs: tuple[Tensor, ...], cos: Tensor, sin: Tensor, interleaved: bool) -> None:
    ctx.cos_index = len(xs)
    table_grads = ctx.needs_input_grad[ctx.cos_index] or ctx.needs_input_grad[ctx.cos_index + 1]
    ctx.save_for_backward(cos, sin, *(xs if table_grads else ()))
    ctx.table_grads = table_grads
    ctx.interleaved = interleaved
    ctx.x_dtypes = tuple(x.dtype for x in xs)


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    x, cos, sin, interleaved, _ = inputs
    _save(ctx, (x,), cos, sin, interleaved)


def _backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    cos, sin = ctx.saved_tensors[:2]
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = rotary_embedding_backward(grad_out, cos, sin, ctx.interleaved, ctx.x_dtypes[0])
    tables = _table_grads(ctx, [grad_out], list(ctx.saved_tensors[2:])) if ctx.table_grads else (None, None)
    return grad_x, *tables, None, None


rotary_embedding_op.register_autograd(_backward, setup_context=_setup_context)


def _pair_setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, cos, sin, interleaved, _, _ = inputs
    _save(ctx, (q, k), cos, sin, interleaved)


def _pair_backward(ctx, grad_q: Tensor | None, grad_k: Tensor | None) -> tuple[Tensor | None, ...]:
    cos, sin = ctx.saved_tensors[:2]
    q_dtype, k_dtype = ctx.x_dtypes
    dq = dk = None
    if grad_q is not None and grad_k is not None:
        dq, dk = rotary_embedding_pair_backward(grad_q, grad_k, cos, sin, ctx.interleaved, q_dtype, k_dtype)
    elif grad_q is not None:
        dq = rotary_embedding_backward(grad_q, cos, sin, ctx.interleaved, q_dtype)
    elif grad_k is not None:
        dk = rotary_embedding_backward(grad_k, cos, sin, ctx.interleaved, k_dtype)
    tables = (
        _table_grads(ctx, [grad_q, grad_k], list(ctx.saved_tensors[2:])) if ctx.table_grads else (None, None)
    )
    return (
        dq if ctx.needs_input_grad[0] else None,
        dk if ctx.needs_input_grad[1] else None,
        *tables,
        None,
        None,
        None,
    )


rotary_embedding_pair_op.register_autograd(_pair_backward, setup_context=_pair_setup_context)


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


def tables_fit(
    x_shape: Sequence[Any], cos_shape: Sequence[Any], sin_shape: Sequence[Any], rotary_dim: int | None
) -> bool:
    """Whether cos and sin of these shapes fit the kernels for an x of ``x_shape``: the rotated
    width (x's, or ``min(rotary_dim, x's)``), even, and broadcast to x's rotated features without
    enlarging them. `amp_fx.passes.fuse_rotary` asks it where shapes are known.

    Example:
        >>> tables_fit((2, 4, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16), None)
        True
        >>> tables_fit((2, 4, 8, 16), (8, 1), (8, 1), None)  # one angle for every feature
        False
    """
    if len(x_shape) == 0 or len(cos_shape) == 0:
        return False
    width = x_shape[-1]
    if rotary_dim is not None:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0:
            return False
        width = min(rotary_dim, width)
    shapes = (torch.Size(x_shape), torch.Size(cos_shape), torch.Size(sin_shape))
    return cos_shape[-1] == width and rotary_width_problem(*shapes) is None


def _fits_kernels(
    x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int | None, dtype: torch.dtype | None
) -> bool:
    """Whether the kernels compute this call: dtypes, shapes and devices only, so torch.compile
    decides it while tracing."""
    if not all(isinstance(t, Tensor) for t in (x, cos, sin)) or gives_expression(x):
        return False
    # Other dtypes (float64) compute the chain.
    if any(t.dtype not in KERNEL_DTYPES for t in (x, cos, sin)) or (
        dtype is not None and dtype not in KERNEL_DTYPES
    ):
        return False
    if cos.device != x.device or sin.device != x.device:
        return False
    return tables_fit(x.shape, cos.shape, sin.shape, rotary_dim)


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
    return rotary_embedding_op(x, cos, sin, interleaved, _out_dtype(x, cos, sin, dtype))


def _out_dtype(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype``, or where None the dtype the chain computes in (x's, cos' and sin' promoted)."""
    return (
        dtype
        if dtype is not None
        else torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    )


def rotary_embedding_pair(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    chunked: bool = False,
    dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
) -> tuple[Tensor, Tensor]:
    """`rotary_embedding` of a query and a key that share cos and sin, ``dtypes`` one each: on
    CUDA one kernel launch each way for both when they differ only in their head counts. Either
    falls back to `rotary_chain` as `rotary_embedding` does.

    Example:
        >>> q = torch.randn(2, 4, 3, 8, dtype=torch.bfloat16)
        >>> k = torch.randn(2, 2, 3, 8, dtype=torch.bfloat16)
        >>> cos, sin = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
        >>> q_out, k_out = rotary_embedding_pair(q, k, cos, sin, dtypes=(torch.bfloat16, None))
        >>> q_out.dtype, k_out.dtype
        (torch.bfloat16, torch.float32)
        >>> torch.equal(k_out, rotary_chain(k, cos, sin))
        True
    """
    q_dtype, k_dtype = dtypes
    options = {"rotary_dim": rotary_dim, "interleaved": interleaved, "chunked": chunked}
    if not (
        _fits_kernels(q, cos, sin, rotary_dim, q_dtype) and _fits_kernels(k, cos, sin, rotary_dim, k_dtype)
    ):
        return rotary_embedding(q, cos, sin, dtype=q_dtype, **options), rotary_embedding(
            k, cos, sin, dtype=k_dtype, **options
        )
    return rotary_embedding_pair_op(
        q, k, cos, sin, interleaved, _out_dtype(q, cos, sin, q_dtype), _out_dtype(k, cos, sin, k_dtype)
    )


# A watched graph asks these functions' kernel to record the range statistics of what it writes.
records_in_kernel(rotary_embedding, rotary_embedding_pair)
