"""What the passes know of a graph value's dtype: whether it is only assumed, and which casts
are exact.

`propagate_dtypes` notes an assumed dtype on a model input (no ``example_inputs``) and on what
follows it; casts of such a value stay guarded and are never removed as no-ops.

    >>> is_exact_widening(torch.float16, torch.float32), is_exact_widening(torch.float32, torch.float16)
    (True, False)
"""

from __future__ import annotations

import torch
import torch.fx

from amp_fx.core.node_info import node_info

__all__ = [
    "ASSUMED_DTYPE_NOTE",
    "UNKNOWN_INPUT_DTYPE_NOTE",
    "DERIVED_ASSUMED_DTYPE_NOTE",
    "dtype_is_assumed",
    "is_exact_widening",
]


# The note `propagate_dtypes` leaves on a model input whose dtype it assumed (no example_inputs).
ASSUMED_DTYPE_NOTE = "dtype assumed float32 (no example_inputs)"


# ... on an optional model input (a default such as ``targets=None``): its users see it cast at
# entry like any input, but it may as well be integer.
UNKNOWN_INPUT_DTYPE_NOTE = "dtype unknown: optional input, may be integer (no example_inputs)"


# ... and on a value whose dtype follows such an input's through dtype-agnostic ops (a view of
# integer targets is integer too).
DERIVED_ASSUMED_DTYPE_NOTE = "dtype follows a model input whose dtype is assumed"


def dtype_is_assumed(node: torch.fx.Node) -> bool:
    """True for a value whose recorded dtype is an assumption, not a fact (a model input without
    ``example_inputs``, or a view of one): it may be an integer tensor, so its casts must be
    guarded and are never no-ops to remove."""
    notes = node_info(node).notes
    return any(
        note in notes for note in (ASSUMED_DTYPE_NOTE, UNKNOWN_INPUT_DTYPE_NOTE, DERIVED_ASSUMED_DTYPE_NOTE)
    )


_EXACT_WIDENINGS = {
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def is_exact_widening(source: torch.dtype, wide: torch.dtype) -> bool:
    """True when every `source` value is exactly representable in `wide` (the round trip is exact).

    >>> is_exact_widening(torch.float16, torch.float32), is_exact_widening(torch.float32, torch.float16)
    (True, False)
    """
    return wide in _EXACT_WIDENINGS.get(source, ())
