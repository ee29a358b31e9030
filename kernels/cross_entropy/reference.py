"""Cross-entropy over rows in plain torch: the family's contract (``amp_fx.kernels.cross_entropy``,
which has the math) computed with torch ops, on any device; the definition the Triton kernels are
tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.cross_entropy.arguments import check_cross_entropy_arguments, check_logits_overwritable

__all__ = ["cross_entropy_backward", "cross_entropy_forward", "cross_entropy_forward_with_grad"]


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
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    in_range = (target >= 0) & (target < x.shape[1])
    # Out-of-range targets read column 0 and are replaced by NaN: never an out-of-bounds gather.
    target_logit = x.gather(1, torch.where(in_range, target, 0).unsqueeze(1)).squeeze(1)
    losses = torch.where(in_range, lse - target_logit, float("nan"))
    losses = torch.where(target == ignore_index, 0.0, losses)
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
    x = logits.float()
    in_range = (target >= 0) & (target < x.shape[1])
    grad_loss = torch.where(in_range, grad_losses, float("nan")).unsqueeze(1)
    is_target = torch.arange(x.shape[1], device=x.device) == target.unsqueeze(1)
    # g * p - g at the target, in the order torch's log_softmax backward computes it.
    grad = grad_loss * torch.exp(x - lse.unsqueeze(1)) - torch.where(is_target, grad_loss, 0.0)
    grad = torch.where((target == ignore_index).unsqueeze(1), 0.0, grad)
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
    losses, lse = cross_entropy_forward(logits, target, ignore_index)
    unit = torch.ones_like(losses)
    cross_entropy_backward(unit, logits, target, lse, ignore_index, out=logits)
    return losses
