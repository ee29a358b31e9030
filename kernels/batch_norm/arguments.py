"""The BatchNorm + act kernels' argument checks, shared by the reference and the Triton kernels
(metadata only: they never read a value, so they never synchronize with the device)."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.arguments import KERNEL_DTYPES, byte_ranges_overlap, check_dtype

__all__ = [
    "check_batch_norm_act_arguments",
    "check_batch_norm_act_backward_arguments",
    "check_triton_batch_norm_layout",
]


def check_batch_norm_act_arguments(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    *,
    grad_out: Tensor | None = None,
    mean: Tensor | None = None,
    invstd: Tensor | None = None,
    out: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
) -> None:
    """Validate the arguments of ``batch_norm_act_forward`` / ``batch_norm_act_backward`` (metadata
    only: never reads a value, so it never synchronizes); raise TypeError/ValueError."""
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a tensor, got {type(input).__name__}")
    if input.dim() < 2 or input.shape[1] == 0:
        raise ValueError(
            f"input must be (N, C, ...) with at least one channel, got shape {tuple(input.shape)}"
        )
    check_dtype("input has", input.dtype)
    num_channels = input.shape[1]
    if input.numel() // num_channels == 0:
        raise ValueError(f"input of shape {tuple(input.shape)} has no values per channel")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if not isinstance(param, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(param).__name__}")
        if tuple(param.shape) != (num_channels,) or param.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"{name} must be a 1-D float tensor of {num_channels} channels, got {param.dtype} of "
                f"shape {tuple(param.shape)}"
            )
        if param.device != input.device:
            raise ValueError(f"{name} is on {param.device} but input is on {input.device}; move it")
    for name, value in (("residual", residual), ("grad_out", grad_out), ("out", out)):
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(value).__name__}")
        if value.shape != input.shape or value.dtype != input.dtype or value.device != input.device:
            raise ValueError(
                f"{name} must match input ({input.dtype} {tuple(input.shape)} on {input.device}), got "
                f"{value.dtype} {tuple(value.shape)} on {value.device}"
            )
    _check_running_stats(input, running_mean, running_var)
    for name, value in (("mean", mean), ("invstd", invstd)):
        if value is None:
            continue
        if (
            value.dtype != torch.float32
            or tuple(value.shape) != (num_channels,)
            or value.device != input.device
        ):
            raise ValueError(
                f"{name} must be float32 of shape ({num_channels},) on {input.device}, got {value.dtype} of "
                f"shape {tuple(value.shape)} on {value.device}; pass the forward's statistics"
            )


def check_triton_batch_norm_layout(name: str, tensor: Tensor) -> None:
    """The Triton BatchNorm kernels' own layout rule: they read a channels_last (N, C, H, W) or a
    contiguous (M, C) tensor as a row-major [M, C] matrix, through its data pointer."""
    if tensor.dim() == 4:
        if tensor.is_contiguous(memory_format=torch.channels_last):
            return
    elif tensor.dim() == 2 and tensor.is_contiguous():
        return
    layout = "contiguous 2-D" if tensor.dim() == 2 else f"{tensor.dim()}-D, strides {tensor.stride()}"
    raise ValueError(
        f"the Triton BatchNorm kernels read (N, C, H, W) tensors in torch.channels_last or contiguous "
        f"(M, C) tensors, got {name} {layout}; call .contiguous(memory_format=torch.channels_last) or "
        f"use amp_fx.kernels.reference"
    )


def check_batch_norm_act_backward_arguments(
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    out: Tensor | None,
    has_residual: bool,
    relu: bool,
) -> None:
    """Validate the arguments of ``batch_norm_act_backward`` (metadata only); raise TypeError/ValueError."""
    check_batch_norm_act_arguments(
        input, weight, bias, None, grad_out=grad_out, mean=mean, invstd=invstd, out=out
    )
    if relu and has_residual and out is None:
        raise ValueError("with a residual and relu=True the backward needs the forward's output (out)")


def _check_running_stats(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None) -> None:
    """Both running statistics or neither; contiguous (C,) float buffers of one dtype on input's
    device (the kernels update them in place), and more than one value per channel (the unbiased
    variance divides by M - 1)."""
    if running_mean is None and running_var is None:
        return
    if running_mean is None or running_var is None:
        raise ValueError("pass both running_mean and running_var, or neither")
    num_channels = input.shape[1]
    for name, value in (("running_mean", running_mean), ("running_var", running_var)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(value).__name__}")
        if (
            tuple(value.shape) != (num_channels,)
            or value.dtype not in KERNEL_DTYPES
            or value.device != input.device
            or not value.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous 1-D float tensor of {num_channels} channels on "
                f"{input.device}, got {value.dtype} of shape {tuple(value.shape)} on {value.device}"
            )
    if running_mean.dtype != running_var.dtype:
        raise ValueError(
            f"running_mean ({running_mean.dtype}) and running_var ({running_var.dtype}) must have one "
            f"dtype; convert one of them"
        )
    if byte_ranges_overlap(running_mean, running_var):
        # Both are read and then written per channel: one would overwrite the other's old value.
        raise ValueError("running_mean and running_var share memory; give each a buffer of its own")
    if input.numel() // num_channels < 2:
        raise ValueError(
            f"updating the running statistics needs more than 1 value per channel, got input of shape "
            f"{tuple(input.shape)}"
        )
