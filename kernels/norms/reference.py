"""RMSNorm and LayerNorm (with an optional residual add) in plain torch: the family's contract
(``amp_fx.kernels.norms``, which has the math) computed with torch ops, on any device; the
definition the Triton kernels are tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.norms.arguments import check_norm_backward_arguments, check_norm_forward_arguments
from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.kernels.range_stats.reference import record_outputs_

__all__ = ["norm_backward", "norm_forward"]


def _rounded(value: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``value`` (fp32) rounded to ``dtype`` and back, as a cast in the replaced chain rounded it."""
    return value if dtype is None or dtype == torch.float32 else value.to(dtype).float()


def _weight_row(weight: Tensor, weight_offset: float) -> Tensor:
    """w' in fp32: the weight plus the offset, computed in the weight's dtype as torch would."""
    if weight_offset == 0.0:
        return weight.float()
    return _rounded(weight.float() + weight_offset, weight.dtype)


def _normalized(s: Tensor, eps: float, subtract_mean: bool, mid_dtype: torch.dtype | None):
    """(n, mean, rstd) of the fp32 rows ``s``; n in ``mid_dtype`` when given (its values rounded
    there: a product with an fp32 tensor computes in fp32 from them, as from the rounded fp32)."""
    mean = s.mean(dim=1, keepdim=True) if subtract_mean else None
    centered = s - mean if subtract_mean else s
    rstd = centered.pow(2).mean(dim=1, keepdim=True).add_(eps).rsqrt_()
    n = centered * rstd
    return (n if mid_dtype is None else n.to(mid_dtype)), mean, rstd


def norm_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    residual: Tensor | None = None,
    subtract_mean: bool = False,
    weight_offset: float = 0.0,
    mid_dtype: torch.dtype | None = None,
    product_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    sum_dtype: torch.dtype | None = None,
    record: KernelRecord | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """RMSNorm (or LayerNorm with ``subtract_mean``) of the rows of ``x`` (+ ``residual``):
    ``(out, summed, mean, rstd)``, the contract of ``amp_fx.kernels.norms``; where ``record``
    asks, the range statistics of out and the sum too.

    Example:
        >>> x = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16)
        >>> out, summed, mean, rstd = norm_forward(x, torch.ones(2), None, 0.0)
        >>> out, summed, mean, rstd
        (tensor([[0.8477, 1.1328]], dtype=torch.bfloat16), None, None, tensor([0.2828]))
    """
    check_norm_forward_arguments(
        x, weight, bias, eps, residual, weight_offset, mid_dtype, product_dtype, out_dtype, sum_dtype
    )
    summed = None
    if residual is not None:
        promoted = torch.promote_types(x.dtype, residual.dtype)
        if sum_dtype is None or sum_dtype == promoted:
            summed = x + residual  # torch adds in fp32 and rounds once to the promoted dtype
        else:
            summed = (x.float() + residual.float()).to(sum_dtype)
        s = summed.float()
    else:
        s = x.float()
    n, mean, rstd = _normalized(s, eps, subtract_mean, mid_dtype)
    y = n
    if weight is not None:
        y = y * _weight_row(weight, weight_offset)
    if bias is not None:
        y = y + bias.float()
    # Rounded to the product's dtype, then converted (a conversion between two of the kernel
    # dtypes goes through fp32, so rounding to an fp32 product is none).
    if product_dtype != torch.float32:
        y = y.to(product_dtype)
    out = y.to(out_dtype or x.dtype)
    record_outputs_(record, [out, summed])
    return out, summed, None if mean is None else mean.view(-1), rstd.view(-1)


def norm_backward(
    grad_out: Tensor,
    grad_sum: Tensor | None,
    normalized: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    *,
    bias_dtype: torch.dtype | None = None,
    subtract_mean: bool = False,
    weight_offset: float = 0.0,
    mid_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype,
    residual_grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of `norm_forward`: ``(grad_x, grad_residual, grad_weight, grad_bias)``, the
    contract of ``amp_fx.kernels.norms``.

    Example:
        >>> x = torch.tensor([[3.0, 4.0]])
        >>> out, _, mean, rstd = norm_forward(x, None, None, 0.0)
        >>> norm_backward(torch.ones(1, 2), None, x, None, mean, rstd, grad_dtype=torch.float32)[0]
        tensor([[ 0.0453, -0.0339]])
    """
    check_norm_backward_arguments(
        grad_out, grad_sum, normalized, weight, mean, rstd, subtract_mean, grad_dtype,
        residual_grad_dtype, bias_dtype,
    )  # fmt: skip
    s = normalized.float()
    rstd = rstd[:, None]
    centered = s - mean[:, None] if subtract_mean else s
    n = centered * rstd
    dy = grad_out.float()
    dn = dy * _weight_row(weight, weight_offset) if weight is not None else dy
    width = s.shape[1]
    correction = n * ((dn * n).sum(dim=1, keepdim=True) / width)
    if subtract_mean:
        correction = correction + dn.sum(dim=1, keepdim=True) / width
    ds = rstd * (dn - correction)
    if grad_sum is not None:
        ds = ds + grad_sum.float()
    grad_weight = None
    if weight is not None:
        # n rounded to mid_dtype: the product with fp32 dy computes in fp32 from its values.
        grad_weight = (dy * (n if mid_dtype is None else n.to(mid_dtype))).sum(dim=0).to(weight.dtype)
    grad_bias = dy.sum(dim=0).to(bias_dtype) if bias_dtype is not None else None
    grad_x = ds.to(grad_dtype)
    grad_residual = None
    if residual_grad_dtype is not None:
        # A tensor of its own even where both gradients are ds in one dtype (the contract).
        grad_residual = ds.to(residual_grad_dtype, copy=residual_grad_dtype == grad_dtype)
    return grad_x, grad_residual, grad_weight, grad_bias
