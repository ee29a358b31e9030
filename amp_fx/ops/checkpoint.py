"""A region of a captured graph that runs through a module's activation-checkpointing function.

Hugging Face layers checkpoint themselves in their ``forward`` (``gradient_checkpointing_enable``
sets ``gradient_checkpointing`` and ``_gradient_checkpointing_func`` on them). Captured whole,
their ops are inlined into one graph; `amp_fx.passes.checkpoint_regions` cuts each layer's ops out
into a submodule and calls it through this wrapper, so the backward recomputes the layer as the
original model's does, and peak memory drops as it does eagerly.

Example:
    >>> from functools import partial
    >>> from torch.utils.checkpoint import checkpoint
    >>> region = CheckpointedRegion(nn.Linear(2, 2), partial(checkpoint, use_reentrant=False))
    >>> region(torch.ones(1, 2, requires_grad=True)).shape
    torch.Size([1, 2])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointedRegion"]


class CheckpointedRegion(nn.Module):
    """Runs ``region`` through ``checkpoint`` (called as ``checkpoint(region, *args)``) when
    gradients are recorded, and plainly otherwise (there is no backward to recompute for)."""

    def __init__(self, region: nn.Module, checkpoint: Callable[..., Any]) -> None:
        super().__init__()
        self.region = region
        self.checkpoint = checkpoint

    def forward(self, *args: Any) -> Any:
        if torch.is_grad_enabled():
            return self.checkpoint(self.region, *args)
        return self.region(*args)
