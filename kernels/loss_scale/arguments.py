"""The loss-scale update's argument checks, shared by the reference, the Triton kernel and
`amp_fx.LossScaler` (which refuses bad configuration up front); metadata and Python numbers only."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.arguments import INT32_MAX, check_range

__all__ = ["FLOAT32_MAX", "check_loss_scale_arguments", "check_scale_bound", "check_tracker_count"]


# The scale and its bounds are float32: a bound is compared after rounding to float32 (as
# torch.clamp does), so a bound beyond float32's range has no float32 value to round to.
FLOAT32_MAX = torch.finfo(torch.float32).max


def check_scale_bound(name: str, value: float | None) -> None:
    """Raise ValueError for a min/max scale that is not None nor a positive float32-representable number."""
    if value is not None and not 0.0 < value <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be None or in (0, {FLOAT32_MAX:.4e}] (the scale is a float32 tensor), got {value}"
        )


def check_tracker_count(name: str, value: int, low: int) -> None:
    """Raise ValueError for a tracker count (or its limit) that is not an int in [low, 2**31 - 1]:
    the growth and hysteresis trackers are int32 tensors, so the counts they hold or count to must
    fit in one."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT32_MAX:
        raise ValueError(
            f"{name} must be an int in [{low}, 2**31 - 1] (the trackers are int32), got {value!r}"
        )


def check_loss_scale_arguments(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_infs: Sequence[Tensor],
    inv_scale_out: Tensor | None,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
) -> None:
    """Validate the arguments of ``update_loss_scale_`` (metadata and Python numbers only, no host sync)."""
    if not isinstance(scale, Tensor):
        raise TypeError(f"scale must be a float32 tensor of one element, got {type(scale).__name__}")
    device = scale.device
    state = [("scale", scale, torch.float32), ("inv_scale_out", inv_scale_out, torch.float32)]
    state += [
        ("growth_tracker", growth_tracker, torch.int32),
        ("hysteresis_tracker", hysteresis_tracker, torch.int32),
    ]
    if not isinstance(found_infs, (list, tuple)) or len(found_infs) == 0:
        raise TypeError(
            "found_infs must be a non-empty list of float32 one-element tensors (the overflow flags)"
        )
    state += [(f"found_infs[{i}]", f, torch.float32) for i, f in enumerate(found_infs)]
    for name, tensor, dtype in state:
        if tensor is None and name == "inv_scale_out":
            continue
        if not isinstance(tensor, Tensor) or tensor.dtype != dtype or tensor.numel() != 1:
            got = f"{tensor.dtype} with {tensor.numel()} elements" if isinstance(tensor, Tensor) else tensor
            raise ValueError(f"{name} must be a {dtype} tensor of one element, got {got}")
        if tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device} but scale is on {device}; move it with .to({device})"
            )
    for name, value in (("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a Python float, got {value!r}")
    check_range("growth_factor", growth_factor, 1.0, float("inf"))
    check_range("backoff_factor", backoff_factor, 0.0, 1.0)
    check_tracker_count("growth_interval", growth_interval, 1)
    check_tracker_count("hysteresis", hysteresis, 1)
    check_scale_bound("min_scale", min_scale)
    check_scale_bound("max_scale", max_scale)
