"""Running a converted model's original code in FP32: Apex's ``amp.disable_casts`` for the torch.export
front end.

Inside `running_original_in_fp32`, a `amp_fx.capture.captured_model.CapturedModel` runs its original
model's code with its low-precision weights upcast, no casts and no autocast (`run_original_in_fp32`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES

__all__ = ["FP32_BLOCKS", "IN_FP32_CALL", "run_original_in_fp32", "running_original_in_fp32"]

# `running_original_in_fp32` blocks open, and whether such a call is already running its code.
FP32_BLOCKS: list[bool] = []
IN_FP32_CALL: list[bool] = []


@contextlib.contextmanager
def running_original_in_fp32() -> Iterator[None]:
    """Inside the block, converted models of this front end run the original model's code in
    FP32 (low-precision weights upcast, no casts, no autocast): Apex's ``amp.disable_casts``.

    >>> from amp_fx.capture.captured_model import captured_model
    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(nn.Linear(4, 2), preset("O2", torch.bfloat16, "cpu"))
    >>> with running_original_in_fp32():
    ...     model(torch.randn(3, 4)).dtype
    torch.float32
    """
    FP32_BLOCKS.append(True)
    try:
        yield
    finally:
        FP32_BLOCKS.pop()


def run_original_in_fp32(
    module: nn.Module, device_type: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call ``module``'s original forward with its low-precision parameters and buffers upcast to
    FP32 and autocast off on ``device_type``; the converted model's own forward, called inside
    (``IN_FP32_CALL``), runs the original code."""
    upcast = {
        name: tensor.float()
        for name, tensor in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
        if tensor.dtype in LOW_PRECISION_DTYPES
    }
    IN_FP32_CALL.append(True)
    try:
        with torch.autocast(device_type, enabled=False):
            return torch.func.functional_call(module, upcast, args, kwargs)
    finally:
        IN_FP32_CALL.pop()
