"""The norm kernels' argument checks, shared by the reference and the Triton kernels (metadata
only: they never read a value, so they never synchronize with the device)."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.arguments import check_dtype

__all__ = ["check_norm_forward_arguments", "check_norm_backward_arguments", "rows_are_contiguous"]


def rows_are_contiguous(tensor: Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous runs of memory (any row stride)."""
    return tensor.dim() == 2 and (tensor.stride(1) == 1 or tensor.shape[1] <= 1)


def _check_rows(name: str, tensor: Tensor, like: Tensor | None = None) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if like is None and (tensor.dim() != 2 or tensor.shape[1] == 0):
        raise ValueError(
            f"{name} must be 2-D (rows, D) with D > 0, got shape {tuple(tensor.shape)}; "
            "flatten the leading dimensions with x.reshape(-1, x.shape[-1])"
        )
    check_dtype(f"{name} has", tensor.dtype)
    if like is not None and (tensor.shape != like.shape or tensor.device != like.device):
        raise ValueError(
            f"{name} must have x's shape {tuple(like.shape)} on {like.device}, got {tuple(tensor.shape)} "
            f"on {tensor.device}"
        )
    if not rows_are_contiguous(tensor):
        raise ValueError(
            f"{name}'s rows are not contiguous (strides {tensor.stride()}); pass {name}.contiguous()"
        )


def _check_vector(name: str, vector: Tensor | None, x: Tensor) -> None:
    if vector is None:
        return
    if not isinstance(vector, Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(vector).__name__}")
    check_dtype(f"{name} has", vector.dtype)
    if vector.dim() != 1 or vector.shape[0] != x.shape[1] or vector.device != x.device:
        raise ValueError(
            f"{name} must be a ({x.shape[1]},) vector on {x.device}, got shape {tuple(vector.shape)} "
            f"on {vector.device}; pass {name}.reshape(-1) for a normalized shape of several dimensions"
        )
    if vector.shape[0] > 1 and vector.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {vector.stride()}; pass {name}.contiguous()")


def _check_optional_dtype(name: str, dtype: torch.dtype | None) -> None:
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{name} must be a torch.dtype or None, got {dtype!r}")
        check_dtype(f"{name} is", dtype)


def check_norm_forward_arguments(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    residual: Tensor | None,
    weight_offset: float,
    mid_dtype: torch.dtype | None,
    product_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    sum_dtype: torch.dtype | None,
) -> None:
    """Validate ``norm_forward``'s arguments; raise TypeError/ValueError naming the fix."""
    _check_rows("x", x)
    if residual is not None:
        _check_rows("residual", residual, like=x)
    _check_vector("weight", weight, x)
    _check_vector("bias", bias, x)
    for name, value in (("eps", eps), ("weight_offset", weight_offset)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a Python float, got {value!r}")
    for name, dtype in (
        ("mid_dtype", mid_dtype),
        ("product_dtype", product_dtype),
        ("out_dtype", out_dtype),
        ("sum_dtype", sum_dtype),
    ):
        _check_optional_dtype(name, dtype)
    if sum_dtype is not None and residual is None:
        raise ValueError("sum_dtype is for a residual add: pass residual=..., or leave sum_dtype=None")


def check_norm_backward_arguments(
    grad_out: Tensor,
    grad_sum: Tensor | None,
    normalized: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    subtract_mean: bool,
    grad_dtype: torch.dtype,
    residual_grad_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
) -> None:
    """Validate ``norm_backward``'s arguments; raise TypeError/ValueError naming the fix."""
    _check_rows("normalized", normalized)
    _check_rows("grad_out", grad_out, like=normalized)
    if grad_sum is not None:
        _check_rows("grad_sum", grad_sum, like=normalized)
    _check_vector("weight", weight, normalized)
    rows = normalized.shape[0]
    for name, stat in (("rstd", rstd), ("mean", mean if subtract_mean else rstd)):
        if not isinstance(stat, Tensor) or stat.dtype != torch.float32 or tuple(stat.shape) != (rows,):
            raise ValueError(f"{name} must be the forward's float32 ({rows},) tensor, got {stat!r:.80}")
    for name, dtype in (
        ("grad_dtype", grad_dtype),
        ("residual_grad_dtype", residual_grad_dtype),
        ("bias_dtype", bias_dtype),
    ):
        _check_optional_dtype(name, dtype)
    if grad_dtype is None:
        raise ValueError("grad_dtype is required: the dtype of the forward's x")
