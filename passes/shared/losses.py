"""Which cross-entropy calls the fused loss kernel computes, for `fuse_losses` and `fuse_linear_loss`.

>>> arguments = dict(zip(CROSS_ENTROPY_PARAMETERS, (torch.fx.Graph().placeholder("x"), None)))
>>> is_fusable_loss(CROSS_ENTROPY_DEFAULTS | arguments)
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["CROSS_ENTROPY_DEFAULTS", "CROSS_ENTROPY_PARAMETERS", "is_fusable_loss"]


# F.cross_entropy's parameters after (input, target), with their defaults, and all of them in order.
CROSS_ENTROPY_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
    "label_smoothing": 0.0,
}


CROSS_ENTROPY_PARAMETERS = ("input", "target", *CROSS_ENTROPY_DEFAULTS)


def is_fusable_loss(arguments: dict[str, Any]) -> bool:
    """Whether a cross-entropy call with these arguments (every parameter of F.cross_entropy, by
    name) is one the fused kernel computes; anything else keeps the cast and torch's float32 loss."""
    return (
        set(CROSS_ENTROPY_PARAMETERS) <= set(arguments)
        and isinstance(arguments["input"], torch.fx.Node)
        and "target" in arguments
        and arguments["weight"] is None
        and arguments["size_average"] is None
        and arguments["reduce"] is None
        and arguments["label_smoothing"] == 0.0
        and arguments["reduction"] in ("mean", "sum", "none")
        and isinstance(arguments["ignore_index"], int)
    )
