"""The rotary kernels' argument checks, shared by the reference and the Triton kernels (metadata
only: they never read a value, so they never synchronize with the device)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.arguments import check_dtype

__all__ = ["check_rotary_arguments", "check_rotary_tensors", "rotary_width_problem"]


def _broadcasts_within(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without enlarging it: no more dimensions, and each
    of its trailing ones 1 or target's. Python comparisons only: every call of the ops runs it
    (``torch.broadcast_shapes`` costs tens of microseconds)."""
    if len(shape) > len(target):
        return False
    aligned = target[len(target) - len(shape) :]
    return all(size == 1 or size == other for size, other in zip(shape, aligned, strict=True))


def rotary_width_problem(x_shape: torch.Size, cos_shape: torch.Size, sin_shape: torch.Size) -> str | None:
    """Why cos and sin of these shapes do not fit the contract for an x of ``x_shape`` (None when
    they do): R = cos.shape[-1] even, 0 < R <= D, and cos, sin broadcastable to x[..., :R]
    without enlarging it. Every call of the kernels asks, with the same few shapes: the answer is
    kept per shapes (symbolic sizes, which do not hash, are checked every time).

    Example:
        >>> q, table = torch.Size([2, 4, 8, 16]), torch.Size([1, 1, 8, 16])
        >>> rotary_width_problem(q, table, table)
        >>> rotary_width_problem(q, torch.Size([8, 5]), torch.Size([8, 5]))
        'cos has 5 features, an odd number; rotary embeddings rotate pairs'
    """
    try:
        return _known_width_problem(x_shape, cos_shape, sin_shape)
    except TypeError:  # unhashable: symbolic sizes, or lists
        return _width_problem(x_shape, cos_shape, sin_shape)


def _width_problem(x_shape: Sequence[int], cos_shape: Sequence[int], sin_shape: Sequence[int]) -> str | None:
    if len(x_shape) == 0 or len(cos_shape) == 0 or len(sin_shape) == 0:
        return "x, cos and sin must have at least one dimension (the features)"
    width = cos_shape[-1]
    if sin_shape[-1] != width:
        return f"cos has {width} features but sin has {sin_shape[-1]}; they must match"
    if width % 2:
        return f"cos has {width} features, an odd number; rotary embeddings rotate pairs"
    if not 0 < width <= x_shape[-1]:
        return f"cos has {width} features; it must have between 2 and x's {x_shape[-1]}"
    rotated = (*x_shape[:-1], width)
    for name, shape in (("cos", cos_shape), ("sin", sin_shape)):
        if not _broadcasts_within(shape, rotated):
            return (
                f"{name} of shape {tuple(shape)} does not broadcast to x[..., :{width}] of shape "
                f"{rotated}; unsqueeze it at x's head dimension "
                "(cos.unsqueeze(1) for [batch, heads, seq, dim])"
            )
    return None


_known_width_problem = functools.lru_cache(maxsize=256)(_width_problem)


def check_rotary_arguments(
    x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, out_dtype: torch.dtype
) -> None:
    """Validate the arguments of ``rotary_forward`` / ``rotary_backward``; raise TypeError/ValueError.

    Example:
        >>> check_rotary_arguments(torch.ones(2, 8), torch.ones(8), torch.ones(8), False, torch.bfloat16)
    """
    if not (isinstance(x, Tensor) and isinstance(cos, Tensor) and isinstance(sin, Tensor)):
        raise TypeError("x, cos and sin must be tensors")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")
    check_dtype("x has", x.dtype)
    check_dtype("cos has", cos.dtype)
    check_dtype("sin has", sin.dtype)
    check_dtype("out_dtype is", out_dtype)
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(
            f"cos ({cos.device}) and sin ({sin.device}) must be on x's device {x.device}; "
            "move them with .to()"
        )
    problem = rotary_width_problem(x.shape, cos.shape, sin.shape)
    if problem is not None:
        raise ValueError(problem)


def check_rotary_tensors(
    xs: Sequence[Tensor], cos: Tensor, sin: Tensor, interleaved: bool, out_dtypes: Sequence[torch.dtype]
) -> None:
    """Validate the arguments of ``rotary_forward`` / ``rotary_backward``: one or two tensors (a
    query and a key) sharing cos and sin, one output dtype each; raise TypeError/ValueError.

    Example:
        >>> check_rotary_tensors([torch.ones(2, 8)], torch.ones(8), torch.ones(8), False, [torch.float32])
    """
    if not isinstance(xs, (list, tuple)) or not 1 <= len(xs) <= 2:
        raise TypeError(
            f"xs must be a list of one or two tensors (a query and a key), got {type(xs).__name__}"
        )
    if not isinstance(out_dtypes, (list, tuple)) or len(out_dtypes) != len(xs):
        raise ValueError(f"out_dtypes must give one dtype per tensor of xs ({len(xs)}), got {out_dtypes!r}")
    for x, out_dtype in zip(xs, out_dtypes, strict=True):
        check_rotary_arguments(x, cos, sin, interleaved, out_dtype)
