"""A language model's head and its FP32 cross-entropy, chunk by chunk: `chunked_linear_cross_entropy`.

``F.cross_entropy(F.linear(h, W, b).float().view(-1, V), t)`` holds the whole [rows, V] logits:
for Llama at 8 x 2048 tokens and V = 32000 that is 1 GB in bf16, 2 GB more for the float32 copy,
and as much again for their gradients, all alive at the step's memory peak. Here the rows are
taken ``chunk_rows`` at a time: each chunk's logits are one cuBLAS matmul in the input's dtype,
the cross-entropy kernel (``amp_fx.kernels.cross_entropy.cross_entropy_forward_with_grad``: float32
math) turns them into the loss and, in their own buffer, the unscaled gradient ``softmax - onehot``,
and two more matmuls fold that gradient into the gradients of the hidden states and of the head's
weight (and bias), accumulated in float32. So the forward computes the gradients, as Liger-Kernel's
fused linear cross-entropy does, never holding more than one chunk of logits; the backward only
scales them by the upstream gradient (and 1 / valid rows for a mean) and rounds them once to
their parameters' dtypes.

With ``softcap=c`` (Gemma2's "final logit softcapping") the loss reads ``c * tanh(logits / c)``:
per chunk those capped logits are computed in float32 from the chunk's logits (one more
chunk-sized buffer, float32), the kernel reads them, and the logits' gradient
``(softmax - onehot) * (1 - tanh**2)`` is computed in float32 and rounded once to the input's
dtype, over the chunk's logits, for the same two matmuls.

The gradients are kept in float32 between forward and backward (rows x d for the hidden states,
V x d for the weight): far smaller than the logits, and unscaled, so fp16's range never sees the
loss scale before the one rounding at the end. Without gradients (``torch.no_grad()``, or no
input requiring one) the forward computes the loss only, still chunk by chunk.

The custom op ``amp_fx::chunked_linear_cross_entropy`` has a fake implementation and autograd, so
it works eagerly (without the custom op's dispatch: `amp_fx.ops.dispatch.fused_op`) and under
``torch.compile(fullgraph=True)``. On CUDA the kernel is Triton's and
the matmuls accumulate in float32 straight into float32 outputs; elsewhere the kernel is the
pure-torch reference and the matmuls run on float32 copies (the same products, exact in float32).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from amp_fx.ops.dispatch import fused_op
from amp_fx.ops.head_matmuls import mask_padding, matmul_fp32, padded_classes, padded_target

__all__ = ["chunked_linear_cross_entropy", "chunked_linear_cross_entropy_sum", "default_chunk_rows"]

_REDUCTIONS = ("mean", "sum")

# The logits of one chunk take at most this many bytes (rounded down to a power of two of rows):
# for GPT-2 (V = 50257, fp16) 2048 rows, for Llama (V = 32000, bf16) 4096 rows. Large enough that
# each chunk's matmuls run at cuBLAS's full rate, small next to the [rows, V] logits it replaces.
CHUNK_BYTES = 256 * 2**20
# A softcap's tanh derivative is computed over this many slices of a chunk's rows (module docstring).
_DERIVATIVE_SLABS = 8


def default_chunk_rows(num_classes: int, dtype: torch.dtype) -> int:
    """Rows per chunk: a power of two whose logits fit in `CHUNK_BYTES` (at least 1).

    >>> default_chunk_rows(50257, torch.float16), default_chunk_rows(32000, torch.bfloat16)
    (2048, 4096)
    """
    rows = max(1, CHUNK_BYTES // (max(1, num_classes) * dtype.itemsize))
    return 1 << (rows.bit_length() - 1)


def _accumulate_fp32(total: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``total + a @ b`` in float32 (``a @ b`` accumulated in float32, never rounded low).

    The product gets a buffer of its own: ``addmm``'s float32-output overload does not take a
    float32 ``total`` with fp16/bf16 factors on every torch version."""
    product = matmul_fp32(a, b)
    return product if total is None else total.add_(product)


@fused_op("amp_fx::chunked_linear_cross_entropy")
def chunked_linear_cross_entropy_sum(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    chunk_rows: int,
    input_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Sum over rows of the FP32 cross-entropy of ``F.linear(input, weight, bias)`` (input (N, d),
    weight (V, d), target (N,) int64), computed ``chunk_rows`` rows at a time: ``(loss_sum,
    valid_rows, grad_input, grad_weight, grad_bias)``. The loss sum and the number of rows whose
    target is not ``ignore_index`` are float32 scalars; the gradients of the loss sum are float32
    (N, d), (V, d) and (V,), each computed only where its flag asks (else an empty tensor). With
    ``softcap`` c the loss reads the capped logits ``c * tanh(logits / c)`` (module docstring)."""
    from amp_fx.kernels import implementation_for

    num_rows, num_classes = input.shape[0], weight.shape[0]
    kernels = implementation_for([input])
    # Classes padded to 16 bytes a row: cuBLAS runs unaligned products several times slower.
    weight, bias = padded_classes(weight, bias)
    target = padded_target(target, num_classes, weight.shape[0], ignore_index)
    loss_sum = input.new_zeros((), dtype=torch.float32)
    grad_input = (
        input.new_empty(input.shape, dtype=torch.float32)
        if input_grad
        else input.new_empty(0, dtype=torch.float32)
    )
    grad_weight = grad_bias = None
    for start in range(0, num_rows, chunk_rows):
        rows = input[start : start + chunk_rows]
        rows_target = target[start : start + chunk_rows]
        # One chunk of logits in the input's dtype; the kernel reads them and leaves softmax -
        # onehot (float32 math, rounded once) in their place (with a softcap, the capped logits'
        # gradient: `_softcapped_loss_and_grad`).
        logits = F.linear(rows, weight, bias).contiguous()
        if softcap is None:
            mask_padding(logits, num_classes)
            loss_sum += kernels.cross_entropy_forward_with_grad(logits, rows_target, ignore_index).sum()
        else:
            loss_sum += _softcapped_loss_and_grad(
                kernels, logits, rows_target, ignore_index, softcap, num_classes
            )
        if input_grad:
            grad_input[start : start + rows.shape[0]] = matmul_fp32(logits, weight)
        if weight_grad:
            grad_weight = _accumulate_fp32(grad_weight, logits.t(), rows)
        if bias_grad:
            column_sums = logits[:, :num_classes].float().sum(dim=0)
            grad_bias = column_sums if grad_bias is None else grad_bias.add_(column_sums)
    valid_rows = (target != ignore_index).sum().to(torch.float32)

    def zeros_or_empty(grad: Tensor | None, wanted: bool, shape: torch.Size) -> Tensor:
        if grad is not None:
            return grad
        return input.new_zeros(shape if wanted else (0,), dtype=torch.float32)

    if grad_weight is not None:
        grad_weight = grad_weight[:num_classes]
    grad_weight = zeros_or_empty(grad_weight, weight_grad, (num_classes, weight.shape[1]))
    grad_bias = zeros_or_empty(grad_bias, bias_grad, (num_classes,))
    return loss_sum, valid_rows, grad_input, grad_weight, grad_bias


def _softcapped_loss_and_grad(
    kernels: ModuleType, logits: Tensor, target: Tensor, ignore_index: int, softcap: float, num_classes: int
) -> Tensor:
    """The loss sum of the capped logits ``c * tanh(logits / c)`` of one chunk, and over ``logits``
    their gradient ``(softmax - onehot) * (1 - tanh**2)``: float32 math, rounded once."""
    # The capped logits in float32: the one chunk-sized float32 buffer; the kernel leaves
    # softmax - onehot (float32, unrounded) in it.
    capped = logits.to(torch.float32, copy=True).div_(softcap).tanh_().mul_(softcap)
    mask_padding(capped, num_classes)  # after the cap: tanh would make -inf a finite -c
    loss_sum = kernels.cross_entropy_forward_with_grad(capped, target, ignore_index).sum()
    # The tanh's derivative from the logits (the same float32 ops, so the same tanh), a few rows at
    # a time so that no second chunk-sized float32 buffer is made; the product is rounded once.
    step = max(1, -(-logits.shape[0] // _DERIVATIVE_SLABS))
    for start in range(0, logits.shape[0], step):
        rows = slice(start, start + step)
        derivative = logits[rows].to(torch.float32, copy=True).div_(softcap).tanh_().square_().neg_().add_(1)
        logits[rows] = derivative.mul_(capped[rows])
    return loss_sum


@chunked_linear_cross_entropy_sum.register_fake
def _chunked_fake(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    chunk_rows: int,
    input_grad: bool,
    weight_grad: bool,
    bias_grad: bool,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    def grad(wanted: bool, shape: torch.Size | tuple[int, ...]) -> Tensor:
        return input.new_empty(shape if wanted else (0,), dtype=torch.float32)

    scalar = input.new_empty((), dtype=torch.float32)
    return (
        scalar,
        input.new_empty((), dtype=torch.float32),
        grad(input_grad, input.shape),
        grad(weight_grad, weight.shape),
        grad(bias_grad, (weight.shape[0],)),
    )


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    input, weight, bias = inputs[:3]
    _, valid_rows, grad_input, grad_weight, grad_bias = output
    ctx.save_for_backward(grad_input, grad_weight, grad_bias)
    ctx.dtypes = (input.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.mark_non_differentiable(valid_rows, grad_input, grad_weight, grad_bias)


@once_differentiable  # the saved gradients are constants of the backward
def _backward(ctx, grad_loss_sum: Tensor, *unused: Tensor | None) -> tuple:
    saved = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    # One multiply by the upstream gradient in float32, then the one rounding to each dtype.
    grads = tuple(
        (grad * grad_loss_sum).to(dtype) if need and dtype is not None else None
        for grad, dtype, need in zip(saved, ctx.dtypes, needs, strict=True)
    )
    return (*grads, None, None, None, None, None, None, None)


chunked_linear_cross_entropy_sum.register_autograd(_backward, setup_context=_setup_context)


def _runs_fused(input: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, reduction: str) -> bool:
    """Whether the chunked op computes this call (dtypes, ranks, devices, Python values only, so
    torch.compile decides it while tracing): one class index per row, in any shape."""
    # Imported on first use, as the kernels are.
    from amp_fx.kernels.cross_entropy.arguments import linear_head_fits

    return (
        linear_head_fits(input, weight, bias, target)
        and target.numel() * weight.shape[1] == input.numel()
        and reduction in _REDUCTIONS
    )


def chunked_linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias).float().view(-1, V), target.view(-1),
    ignore_index=ignore_index, reduction=reduction)`` in value (a float32 scalar), without ever
    holding the [rows, V] logits: rows are taken ``chunk_rows`` at a time (default
    `default_chunk_rows`) and the gradients are computed in the forward (module docstring).

    Chunked when input (*, d), weight (V, d) and bias (V,) share one dtype (fp16, bf16 or fp32) and
    device, target holds one int64 class index per row and reduction is "mean" or "sum"; any other
    call returns exactly the torch expression above. As in torch, a mean over rows that are all
    ignored is NaN and its gradients are zeros; unlike torch, a target outside [0, V) that is not
    ignore_index makes the loss NaN instead of raising (no host synchronization).

    ``softcap`` c (a positive number; None for none) caps the logits as Gemma2's final logit
    softcapping does: the loss is that of ``c * tanh(logits.float() / c)``, computed in float32
    per chunk (the default ``chunk_rows`` then bounds those float32 logits by `CHUNK_BYTES`).

    Example:
        >>> h = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
        >>> head = torch.randn(50, 16, dtype=torch.bfloat16, requires_grad=True)
        >>> target = torch.randint(0, 50, (10,))
        >>> loss = chunked_linear_cross_entropy(h, head, None, target, chunk_rows=4)
        >>> loss.backward(); loss.dtype, head.grad.dtype
        (torch.float32, torch.bfloat16)
        >>> expected = F.cross_entropy(F.linear(h, head).float().view(-1, 50), target)
        >>> torch.allclose(loss, expected)
        True
        >>> capped = chunked_linear_cross_entropy(h, head, None, target, chunk_rows=4, softcap=30.0)
        >>> expected = F.linear(h, head).float().div(30.0).tanh().mul(30.0)
        >>> torch.allclose(capped, F.cross_entropy(expected.view(-1, 50), target))
        True
    """
    if chunk_rows is not None and (
        isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1
    ):
        raise ValueError(f"chunk_rows must be a positive int or None for the default, got {chunk_rows!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf")
    ):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    if not _runs_fused(input, weight, bias, target, reduction):
        logits = F.linear(input, weight, bias).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        )
    rows = input.reshape(-1, input.shape[-1])
    if chunk_rows is None:
        # Capped logits are float32: a chunk of them within CHUNK_BYTES.
        chunk_rows = default_chunk_rows(weight.shape[0], input.dtype if softcap is None else torch.float32)
    grad_on = torch.is_grad_enabled()
    loss_sum, valid_rows, *_ = chunked_linear_cross_entropy_sum(
        rows,
        weight,
        bias,
        target.reshape(-1),
        ignore_index,
        chunk_rows,
        grad_on and input.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
        None if softcap is None else float(softcap),
    )
    if reduction == "sum":
        return loss_sum
    # torch's mean: 0 / 0 = NaN when every row is ignored, with zero gradients; dividing by at
    # least 1 and choosing NaN after keeps the backward's gradients zeros, not 0 * inf.
    mean = loss_sum / valid_rows.clamp(min=1)
    return torch.where(valid_rows > 0, mean, torch.full_like(mean, float("nan")))
