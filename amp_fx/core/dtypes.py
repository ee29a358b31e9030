"""The dtype facts every layer shares, written once: low-precision dtypes, dtype names, a model's
device type, and how much of a user's value an error message echoes. Opt levels have their own
table, `amp_fx.core.opt_levels`.

    >>> dtype_name(torch.bfloat16), short_dtype_name(torch.bfloat16)
    ('bfloat16', 'bf16')
    >>> len(short_repr("O" * 1_000_000)) < 100
    True
    >>> low_precision_dtype("bf16"), low_precision_dtype("half")
    (torch.bfloat16, torch.float16)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "LOW_PRECISION_DTYPES",
    "LOW_PRECISION_DTYPE_NAMES",
    "default_device_type",
    "dtype_name",
    "low_precision_dtype",
    "short_dtype_name",
    "short_repr",
]

# The dtypes mixed precision lowers to.
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)

# Every spelling of a low-precision dtype that convert, preset, AmpTrainer, AmpPrecision and
# amp.initialize accept (each also with a "torch." prefix, and as the torch.dtype itself).
LOW_PRECISION_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# An error echoes at most this many characters of a user's value: enough to recognise it, and a
# megabyte string does not become a megabyte message.
REPR_LIMIT = 60

_SHORT_DTYPE_NAMES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def short_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(value)``, cut to about `limit` characters for error messages.

    >>> short_repr("O2")
    "'O2'"
    >>> short_repr("x" * 100, limit=10)
    "'xxxxxxxx... (102 characters)"
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}... ({len(text)} characters)"


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name without the module: ``torch.bfloat16`` -> ``"bfloat16"`` (node names, to_dict).

    >>> dtype_name(torch.float16)
    'float16'
    """
    return str(dtype).removeprefix("torch.")


def short_dtype_name(dtype: torch.dtype | None) -> str:
    """The report's short name: ``torch.bfloat16`` -> ``"bf16"``; None (not a tensor, or unknown) -> ``"-"``.

    >>> short_dtype_name(torch.float16), short_dtype_name(torch.complex64), short_dtype_name(None)
    ('fp16', 'complex64', '-')
    """
    if dtype is None:
        return "-"
    return _SHORT_DTYPE_NAMES.get(dtype, dtype_name(dtype))


def low_precision_dtype(dtype: Any, what: str = "dtype") -> torch.dtype:
    """torch.float16 or torch.bfloat16 from the dtype or any name in `LOW_PRECISION_DTYPE_NAMES`
    (case-insensitive, with or without "torch."): the one parser of every entry point's ``dtype``.

    >>> low_precision_dtype(torch.float16), low_precision_dtype("torch.bfloat16"), low_precision_dtype("FP16")
    (torch.float16, torch.bfloat16, torch.float16)
    >>> low_precision_dtype("float32")
    Traceback (most recent call last):
    ...
    ValueError: dtype must be torch.float16 or torch.bfloat16 ...
    """
    if isinstance(dtype, str):
        found = LOW_PRECISION_DTYPE_NAMES.get(dtype.strip().lower().removeprefix("torch."))
        if found is not None:
            return found
    elif isinstance(dtype, torch.dtype) and dtype in LOW_PRECISION_DTYPES:
        return dtype
    names = ", ".join(repr(name) for name in LOW_PRECISION_DTYPE_NAMES)
    raise ValueError(
        f"{what} must be torch.float16 or torch.bfloat16 (or its name: {names}), got {short_repr(dtype)}; "
        "for float32 training use opt_level 'O0'"
    )


def default_device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter or buffer; "cpu" for a model with neither.

    >>> default_device_type(torch.nn.Linear(2, 2))
    'cpu'
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device.type
    return "cpu"
