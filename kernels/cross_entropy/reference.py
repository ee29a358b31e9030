"""Cross-entropy over rows in plain torch: the family's contract (``amp_fx.kernels.cross_entropy``,
which has the math) computed with torch ops, on any device; the definition the Triton kernels are
tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.cross_entropy.arguments import check_cross_entropy_arguments, check_logits_overwritable

__all__ = ["cross_entropy_backward", "cross_entropy_forward", "cross_entropy_forward_with_grad"]


def _losses(x: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(losses, lse, out_of_range, ignored)`` of the fp32 logits ``x``: what the forward and the
    gradient share (each computed once where both run, in `cross_entropy_forward_with_grad`)."""
    lse = torch.logsumexp(x, dim=1)
    out_of_range = (target < 0) | (target >= x.shape[1])
    # Out-of-range targets read column 0 and are replaced by NaN: never an out-of-bounds gather.
    target_logit = x.gather(1, target.masked_fill(out_of_range, 0).unsqueeze(1)).squeeze(1)
    ignored = target == ignore_index
    losses = (lse - target_logit).masked_fill_(out_of_range, float("nan")).masked_fill_(ignored, 0.0)
    return losses, lse, out_of_range, ignored


def _gradient(
    grad_losses: Tensor, x: Tensor, target: Tensor, lse: Tensor, out_of_range: Tensor, ignored: Tensor
) -> Tensor:
    """The fp32 gradient of the losses w.r.t. ``x``: g * p - g at the target, in the order torch's
    log_softmax backward computes it (the - g added at the target alone: a + (-b) is a - b)."""
    grad_loss = grad_losses.masked_fill(out_of_range, float("nan")).unsqueeze(1)
    grad = (x - lse.unsqueeze(1)).exp_().mul_(grad_loss)
    grad.scatter_add_(1, target.masked_fill(out_of_range, 0).unsqueeze(1), -grad_loss)
    return grad.masked_fill_(ignored.unsqueeze(1), 0.0)


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy of ``logits`` (N, C; fp16, bf16 or fp32) against class indices
    ``target`` (N,; int64), in fp32: ``(losses, lse)``, the contract of
    ``amp_fx.kernels.cross_entropy``.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]], dtype=torch.float16)
        >>> losses, lse = cross_entropy_forward(logits, torch.tensor([1, -100]), -100)
        >>> losses, lse
        (tensor([0.6931, 0.0000]), tensor([0.6931, 3.1269]))
    """
    check_cross_entropy_arguments(logits, target, ignore_index)
    losses, lse, _, _ = _losses(logits.float(), target, ignore_index)
    return losses, lse


def cross_entropy_backward(
    grad_losses: Tensor,
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    out: Tensor | None = None,
) -> Tensor:
    """Gradient of the per-row losses w.r.t. ``logits``, in the logits' dtype: the contract of
    ``amp_fx.kernels.cross_entropy``.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]], dtype=torch.float16)
        >>> target = torch.tensor([1, -100])
        >>> losses, lse = cross_entropy_forward(logits, target, -100)
        >>> cross_entropy_backward(torch.ones(2), logits, target, lse, -100)
        tensor([[ 0.5000, -0.5000],
                [ 0.0000,  0.0000]], dtype=torch.float16)
    """
    check_cross_entropy_arguments(logits, target, ignore_index, lse=lse, grad_losses=grad_losses, out=out)
    out_of_range = (target < 0) | (target >= logits.shape[1])
    grad = _gradient(grad_losses, logits.float(), target, lse, out_of_range, target == ignore_index)
    if out is not None:
        return out.copy_(grad)
    # Contiguous whatever the logits' strides, as the Triton kernel and the op's fake allocate it.
    return grad.to(logits.dtype).contiguous()


def cross_entropy_forward_with_grad(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """``cross_entropy_forward``'s losses, with the gradient for an upstream gradient of 1 written
    over ``logits``: the contract of ``amp_fx.kernels.cross_entropy``.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]], dtype=torch.float16)
        >>> cross_entropy_forward_with_grad(logits, torch.tensor([1, -100]), -100)
        tensor([0.6931, 0.0000])
        >>> logits
        tensor([[ 0.5000, -0.5000],
                [ 0.0000,  0.0000]], dtype=torch.float16)
    """
    check_cross_entropy_arguments(logits, target, ignore_index)
    check_logits_overwritable(logits)
    x = logits.float()
    losses, lse, out_of_range, ignored = _losses(x, target, ignore_index)
    logits.copy_(_gradient(torch.ones_like(losses), x, target, lse, out_of_range, ignored))
    return losses
