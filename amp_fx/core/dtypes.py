"""The facts every layer shares, written once: opt levels, low-precision dtypes, dtype names,
a model's device type, and how much of a user's value an error message echoes.

    >>> check_opt_level("O2"), dtype_name(torch.bfloat16), short_dtype_name(torch.bfloat16)
    ('O2', 'bfloat16', 'bf16')
    >>> len(short_repr("O" * 1_000_000)) < 100
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "LOW_PRECISION_DTYPES",
    "OPT_LEVELS",
    "check_opt_level",
    "default_device_type",
    "dtype_name",
    "short_dtype_name",
    "short_repr",
]

# Apex's opt levels: O0 pure FP32, O1 casts per op, O2 low weights with FP32 masters, O3 pure low.
OPT_LEVELS = ("O0", "O1", "O2", "O3")
# The dtypes mixed precision lowers to.
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)

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


def check_opt_level(opt_level: Any) -> str:
    """Return `opt_level` if it is one of "O0".."O3"; else raise naming the accepted spellings.

    A TypeError for a value that is not a str, a ValueError for an unknown one (with a hint when
    the letter O was typed as a zero or lower case).

    >>> check_opt_level("O1")
    'O1'
    """
    spellings = ", ".join(map(repr, OPT_LEVELS))
    if not isinstance(opt_level, str):
        raise TypeError(
            f"opt_level must be a str, one of {spellings}; got {type(opt_level).__name__} "
            f"{short_repr(opt_level)}"
        )
    if opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    stripped = opt_level.strip()
    if len(stripped) == 2 and stripped[1] in "0123" and stripped[0] in "oO0":
        hint = f"; did you mean 'O{stripped[1]}' (capital letter O)?"
    raise ValueError(f"unknown opt_level {short_repr(opt_level)}: use one of {spellings}{hint}")


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


def default_device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter or buffer; "cpu" for a model with neither.

    >>> default_device_type(torch.nn.Linear(2, 2))
    'cpu'
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device.type
    return "cpu"
