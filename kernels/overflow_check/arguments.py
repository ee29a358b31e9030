"""The overflow check's argument checks, shared by the reference and the Triton kernel (metadata
only: they never read a value)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from amp_fx.kernels.arguments import KERNEL_DTYPES, check_scalar_tensor, check_tensor_list

__all__ = ["check_grads"]


def check_grads(
    grads: Sequence[Tensor], found_inf: Tensor, grad_multiplier: Tensor | None, sq_norm_out: Tensor | None
) -> None:
    """Validate the arguments of ``check_finite_and_norm_``; raise TypeError/ValueError."""
    check_tensor_list("grads", grads, KERNEL_DTYPES)
    if not isinstance(found_inf, Tensor):
        raise TypeError("found_inf must be a float32 tensor of one element")
    device = found_inf.device
    for name, value in (
        ("found_inf", found_inf),
        ("grad_multiplier", grad_multiplier),
        ("sq_norm_out", sq_norm_out),
    ):
        check_scalar_tensor(name, value, device)
    for i, grad in enumerate(grads):
        if grad.device != device:
            raise ValueError(
                f"grads[{i}] is on {grad.device} but found_inf is on {device}; keep them on one device"
            )
