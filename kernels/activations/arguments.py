"""The activation kernels' argument checks, shared by the reference and the Triton kernels
(metadata only: they never read a value, so they never synchronize with the device)."""

from __future__ import annotations

from torch import Tensor

from amp_fx.kernels.activations import ACTIVATIONS
from amp_fx.kernels.arguments import check_dtype

__all__ = ["check_activation_arguments"]


def check_activation_arguments(activation: str, **tensors: Tensor) -> None:
    """Validate an activation kernel's arguments: a known ``activation`` and 2-D ``tensors`` (by
    name) of one shape, dtype and device; raise TypeError/ValueError naming the problem.

    Example:
        >>> import torch
        >>> check_activation_arguments("relu", input=torch.ones(2, 2))
        Traceback (most recent call last):
        ...
        ValueError: activation 'relu' is not one of silu, gelu, gelu_tanh; ...
    """
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}; "
            "these kernels compute those three only (run other activations with torch)"
        )
    first_name, first = next(iter(tensors.items()))
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D (rows, columns), got shape {tuple(tensor.shape)}; "
                f"flatten the leading dimensions with {name}.flatten(0, -2)"
            )
        check_dtype(f"{name} has", tensor.dtype)
        if tensor.shape != first.shape or tensor.dtype != first.dtype or tensor.device != first.device:
            raise ValueError(
                f"{name} is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device} but {first_name} is "
                f"{first.dtype} {tuple(first.shape)} on {first.device}; pass tensors of one shape, "
                "dtype and device (no broadcasting)"
            )
