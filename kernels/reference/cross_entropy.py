"""Pure-torch cross-entropy over rows (``cross_entropy_forward`` / ``cross_entropy_backward``; the
Triton twins are in ``amp_fx.kernels.cross_entropy``). For logits x (N, C) in fp16, bf16 or fp32
and int64 class indices t (N,), in fp32::

    lse_i  = logsumexp(x_i)                              (returned, and saved for the backward)
    loss_i = lse_i - x_i,t_i                             (0 where t_i == ignore_index)
    dx_ij  = g_i * exp(x_ij - lse_i) - g_i * [j == t_i]  (0 where t_i == ignore_index)
    dx     = dx.to(x.dtype)                              (rounded once)

A target outside [0, C) that is not ``ignore_index`` gives that row a NaN loss and NaN gradients
(torch raises instead, which would need a host synchronization).

``cross_entropy_forward_with_grad`` fuses the two for an upstream gradient of 1: it returns the
losses and writes ``dx`` with g_i = 1 (``softmax(x_i) - onehot(t_i)``, unscaled) over the logits,
for `amp_fx.ops.losses.linear_cross_entropy`, whose backward applies the real g_i after its matmuls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.arguments import check_cross_entropy_arguments, check_logits_overwritable

__all__ = ["cross_entropy_backward", "cross_entropy_forward", "cross_entropy_forward_with_grad"]


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy of ``logits`` (N, C; fp16, bf16 or fp32) against class indices
    ``target`` (N,; int64), in fp32 (module docstring for the math).

    Returns ``(losses, lse)``, both float32 (N,): each row's loss (0 where ``target ==
    ignore_index``, NaN where the target is outside [0, C)) and its logsumexp.

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
    """Gradient of the per-row losses w.r.t. ``logits``: ``grad_losses[i] * (softmax(logits[i]) -
    onehot(target[i]))`` in fp32, rounded once to the logits' dtype; exactly 0 for ignored rows,
    NaN for rows whose target is out of range. ``lse`` is the forward's. Written to ``out`` when
    given (contiguous, the logits' shape and dtype; ``out=logits`` overwrites the logits).

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
    over ``logits`` (contiguous): ``softmax(logits[i]) - onehot(target[i])`` in fp32, rounded once
    to their dtype; exactly 0 for ignored rows, NaN for rows whose target is out of range.

    Returns the float32 (N,) losses. A caller scales the gradient by the real upstream gradient
    later (a fused linear + loss scales the matmuls' outputs instead of this [N, C] tensor).

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
