"""The cross-entropy kernels' argument checks, shared by the reference and the Triton kernels
(metadata only: they never read a value, so they never synchronize with the device)."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.arguments import KERNEL_DTYPES, byte_ranges_overlap, check_dtype

__all__ = ["check_cross_entropy_arguments", "check_logits_overwritable", "linear_head_fits"]


def check_cross_entropy_arguments(
    logits: Tensor,
    target: Tensor,
    ignore_index: int,
    *,
    lse: Tensor | None = None,
    grad_losses: Tensor | None = None,
    out: Tensor | None = None,
) -> None:
    """Validate the arguments of ``cross_entropy_forward`` / ``cross_entropy_backward`` (metadata
    only: never reads a value, so it never synchronizes); raise TypeError/ValueError."""
    if not isinstance(logits, Tensor) or not isinstance(target, Tensor):
        raise TypeError("logits and target must be tensors")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be 2-D (rows, classes) with at least one class, got shape {tuple(logits.shape)}; "
            "flatten the leading dimensions with logits.reshape(-1, logits.shape[-1])"
        )
    check_dtype("logits have", logits.dtype)
    num_rows = logits.shape[0]
    if target.dtype != torch.int64 or tuple(target.shape) != (num_rows,):
        raise ValueError(
            f"target must be int64 class indices of shape ({num_rows},), got {target.dtype} of shape "
            f"{tuple(target.shape)}; pass target.long() with one class index per row of logits"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be a Python int, got {ignore_index!r}")
    for name, value in (("target", target), ("lse", lse), ("grad_losses", grad_losses)):
        if value is None:
            continue
        if value.device != logits.device:
            raise ValueError(
                f"{name} is on {value.device} but logits are on {logits.device}; "
                f"move it with .to({logits.device})"
            )
        if name != "target" and (value.dtype != torch.float32 or tuple(value.shape) != (num_rows,)):
            raise ValueError(
                f"{name} must be float32 of shape ({num_rows},), got {value.dtype} of shape "
                f"{tuple(value.shape)}"
            )
    if out is not None and (
        out.dtype != logits.dtype
        or tuple(out.shape) != tuple(logits.shape)
        or out.device != logits.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {logits.dtype} tensor of the logits' shape {tuple(logits.shape)} on "
            f"{logits.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}; leave out=None to allocate the gradient"
        )
    # out=logits is an in-place update, each element read before it is written by the same program;
    # an out that overlaps the logits elsewhere would have programs overwrite rows others still read.
    if (
        out is not None
        and out is not logits
        and byte_ranges_overlap(out, logits)
        and (out.data_ptr() != logits.data_ptr() or out.stride() != logits.stride())
    ):
        raise ValueError(
            "out overlaps the logits without being the logits themselves; pass out=logits to write the "
            "gradient over them, or a tensor of its own"
        )


def check_logits_overwritable(logits: Tensor) -> None:
    """``cross_entropy_forward_with_grad`` writes the gradient over the logits: they must be one
    contiguous block (raise ValueError otherwise)."""
    if not logits.is_contiguous():
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} and strides {logits.stride()} are not contiguous; "
            "cross_entropy_forward_with_grad writes the gradient over them: pass logits.contiguous()"
        )


def linear_head_fits(input: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor) -> bool:
    """Whether a head ``F.linear(input, weight, bias)`` and its class indices ``target`` are what
    the fused linear + loss ops feed ``cross_entropy_forward_with_grad``: input (*, d), weight
    (V, d) with V > 0 and bias (V,) or None of one dtype the kernels take and on one device,
    target int64 on that device. How target's shape matches input's rows is each op's to check.
    Metadata only, so torch.compile decides it while tracing.

    Example:
        >>> h, head, t = torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long)
        >>> linear_head_fits(h, head, None, t), linear_head_fits(h, head.double(), None, t)
        (True, False)
    """
    if not (isinstance(input, Tensor) and isinstance(weight, Tensor) and isinstance(target, Tensor)):
        return False
    if bias is not None and not (
        isinstance(bias, Tensor)
        and bias.shape == (weight.shape[0],)
        and bias.dtype == input.dtype
        and bias.device == input.device
    ):
        return False
    return (
        input.dim() >= 1
        and weight.dim() == 2
        and weight.shape[0] > 0
        and input.shape[-1] == weight.shape[1]
        and input.dtype in KERNEL_DTYPES
        and weight.dtype == input.dtype
        and weight.device == input.device
        and target.dtype == torch.int64
        and target.device == input.device
    )
