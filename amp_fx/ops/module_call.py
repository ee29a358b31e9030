"""A region of a captured graph that runs through its module's ``__call__``, hooks included.

A model captured whole inlines its transformer blocks into one graph, so hooks registered on a
block (FSDP2's, which gather the block's parameters before its forward and free them after) would
never run. `amp_fx.passes.shard_regions` cuts each such block's ops out into a region and calls it
through this wrapper: the block's own ``__call__`` runs, its forward being the region for that
call, so every hook of the block runs around exactly the ops the block computed.

Example:
    >>> import torch
    >>> layer = nn.Linear(2, 2)
    >>> seen = []
    >>> _ = layer.register_forward_pre_hook(lambda module, args: seen.append("pre-forward"))
    >>> call = ModuleCall(layer, lambda x: x * 2)
    >>> call(torch.ones(1, 2)), seen
    (tensor([[2., 2.]]), ['pre-forward'])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ModuleCall"]

# FSDP2's warning that a module returned a view, whose pre-backward hook an in-place update drops.
_VIEW_OUTPUT_WARNING = "FSDP2-wrapped module .* returned a view tensor"


class ModuleCall(nn.Module):
    """Runs ``region(*args)`` as ``module(*args)``'s forward: ``module``'s hooks run around it."""

    def __init__(self, module: nn.Module, region: Callable[..., Any]) -> None:
        super().__init__()
        self.region = region
        # Not a submodule: the graph holding this call is not part of the model it calls into.
        self.__dict__["target"] = module

    def forward(self, *args: Any) -> Any:
        module = self.__dict__["target"]
        own = module.__dict__.get("forward")
        # An instance attribute, not setattr: a GraphModule assigned would become a submodule.
        module.__dict__["forward"] = self.region
        try:
            with warnings.catch_warnings():
                # Its outputs may be views; none is updated in place (`shard_regions` copies those).
                warnings.filterwarnings("ignore", message=_VIEW_OUTPUT_WARNING, category=UserWarning)
                return module(*args)
        finally:
            if own is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = own
