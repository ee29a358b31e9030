"""`cast_if_floating`: the guarded cast that converted graphs call where a value's dtype is not
known statically (a model input without ``example_inputs``, the output of untraced code).

It appears in generated code as ``amp_fx_ops_casts_cast_if_floating(x, torch.float16)``; the
passes create it (`amp_fx.passes.shared.casts.make_cast`), the graph runs it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cast_if_floating"]


def cast_if_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value.to(dtype)`` for a floating tensor other than float64, else `value` unchanged.

    Autocast's rule for which tensors it casts, used where the graph cannot know a value's dtype
    statically. Dtype checks are resolved at compile time by ``torch.compile`` (no graph break).

    >>> cast_if_floating(torch.ones(2), torch.float16).dtype
    torch.float16
    >>> cast_if_floating(torch.arange(2), torch.float16).dtype
    torch.int64
    """
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.to(dtype)
    return value
