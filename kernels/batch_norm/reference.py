"""BatchNorm + residual add + ReLU in plain torch: the family's contract (``amp_fx.kernels.batch_norm``,
which has the math) computed with torch ops, on any device; the definition the Triton kernels are
tested against. Statistics in fp32; outputs rounded once to their dtype."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.batch_norm.arguments import (
    check_batch_norm_act_arguments,
    check_batch_norm_act_backward_arguments,
)

__all__ = ["batch_norm_act_backward", "batch_norm_act_forward", "update_batch_norm_running_stats_"]


@torch.no_grad()
def update_batch_norm_running_stats_(
    running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, momentum: float, num_values: int
) -> None:
    """F.batch_norm's training update of the running statistics, in place, computed in fp32 and
    rounded once to the buffers' dtype: stat = (1 - momentum) * stat + momentum * batch stat, with
    the biased batch variance ``var`` made unbiased (x M / (M - 1), M = ``num_values``).

    Example:
        >>> running_mean, running_var = torch.zeros(1), torch.ones(1)
        >>> update_batch_norm_running_stats_(running_mean, running_var, torch.tensor([2.0]),
        ...                                  torch.tensor([1.0]), 0.5, 2)
        >>> running_mean, running_var
        (tensor([1.]), tensor([1.5000]))
    """
    unbiased_var = var * (num_values / (num_values - 1))
    running_mean.copy_(momentum * mean + (1.0 - momentum) * running_mean.float())
    running_var.copy_(momentum * unbiased_var + (1.0 - momentum) * running_var.float())


def _per_channel(values: Tensor, input: Tensor) -> Tensor:
    """A (C,) vector shaped to broadcast along dim 1 of ``input``."""
    return values.reshape((1, -1) + (1,) * (input.dim() - 2))


def _batch_norm_scale_and_bias(
    weight: Tensor | None, bias: Tensor | None, invstd: Tensor
) -> tuple[Tensor, Tensor]:
    """fp32 (C,) scale = weight * invstd and bias (zeros when None)."""
    scale = invstd if weight is None else weight.float() * invstd
    shift = torch.zeros_like(invstd) if bias is None else bias.float()
    return scale, shift


def _like_input(values: Tensor, input: Tensor) -> Tensor:
    """``values`` in input's dtype and strides (channels_last stays channels_last), rounded once."""
    return torch.empty_like(input).copy_(values)


def batch_norm_act_forward(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    relu: bool,
    *,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    momentum: float = 0.1,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm over dim 1 of ``input`` (N, C, ...), then ``+ residual``, then ReLU:
    ``(out, mean, invstd, var)``, the running statistics updated in place when given
    (`update_batch_norm_running_stats_`); the contract is ``amp_fx.kernels.batch_norm``'s.

    Example:
        >>> x = torch.tensor([[1.0], [3.0]], dtype=torch.float16)
        >>> out, mean, invstd, var = batch_norm_act_forward(x, None, None, None, 0.0, relu=True)
        >>> out.flatten(), mean, var
        (tensor([0., 1.], dtype=torch.float16), tensor([2.]), tensor([1.]))
    """
    if validate:
        check_batch_norm_act_arguments(
            input, weight, bias, residual, running_mean=running_mean, running_var=running_var
        )
    x = input.float()
    dims = [d for d in range(input.dim()) if d != 1]
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    invstd = torch.rsqrt(var + eps)
    if running_mean is not None:
        num_values = input.numel() // input.shape[1]
        update_batch_norm_running_stats_(running_mean, running_var, mean, var, momentum, num_values)
    scale, shift = _batch_norm_scale_and_bias(weight, bias, invstd)
    y = (x - _per_channel(mean, input)) * _per_channel(scale, input) + _per_channel(shift, input)
    if residual is not None:
        y = y + residual.float()
    if relu:
        # Not torch.clamp_min(y, 0): NaN stays NaN, as torch.relu keeps it.
        y = torch.where(y < 0, 0.0, y)
    return _like_input(y, input), mean, invstd, var


def batch_norm_act_backward(
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    out: Tensor | None,
    has_residual: bool,
    relu: bool,
    *,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``batch_norm_act_forward``: ``(grad_input, grad_weight, grad_bias,
    grad_residual)``; the contract is ``amp_fx.kernels.batch_norm``'s.

    Example:
        >>> x = torch.tensor([[1.0], [3.0]])
        >>> out, mean, invstd, _ = batch_norm_act_forward(x, None, None, None, 0.0, relu=False)
        >>> grads = batch_norm_act_backward(torch.tensor([[1.0], [2.0]]), x, None, None, mean, invstd,
        ...                                 None, has_residual=False, relu=False)
        >>> grads[0].flatten(), grads[1], grads[2]
        (tensor([0., 0.]), tensor([1.]), tensor([3.]))
    """
    if validate:
        check_batch_norm_act_backward_arguments(
            grad_out, input, weight, bias, mean, invstd, out, has_residual, relu
        )
    x = input.float()
    dims = [d for d in range(input.dim()) if d != 1]
    num_values = input.numel() // input.shape[1]
    scale, shift = _batch_norm_scale_and_bias(weight, bias, invstd)
    centered = x - _per_channel(mean, input)
    dy = grad_out.float()
    if relu:
        if out is None:
            out = (centered * _per_channel(scale, input) + _per_channel(shift, input)).to(input.dtype)
        dy = torch.where(out <= 0, 0.0, dy)
    sum_dy = dy.sum(dims)
    sum_dy_centered = (dy * centered).sum(dims)
    grad_weight = invstd * sum_dy_centered
    correction = centered * _per_channel(invstd * grad_weight / num_values, input)
    grad_input = (dy - _per_channel(sum_dy / num_values, input) - correction) * _per_channel(scale, input)
    grad_residual = _like_input(dy, input) if has_residual else input.new_empty((0,))
    return (
        _like_input(grad_input, input),
        grad_weight.to(torch.float32 if weight is None else weight.dtype),
        sum_dy.to(torch.float32 if bias is None else bias.dtype),
        grad_residual,
    )
