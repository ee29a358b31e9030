"""Hugging Face's gradient checkpointing around a capture: which layers checkpoint themselves, and
their checkpoint function switched off while torch.export records their ops
(`amp_fx.passes.checkpoint_regions` puts checkpointing back on the rewritten graph).

>>> checkpointed_layers(nn.Linear(2, 2).train())
{}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["checkpointed_layers", "checkpointing_off"]


def checkpointed_layers(module: nn.Module) -> dict[str, Callable[..., Any]]:
    """Qualified name -> checkpoint function of the layers that checkpoint themselves in training
    (Hugging Face's ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``): the
    innermost flagged modules, as a flagged model (GPT2Model) leaves the checkpointing to its layers."""
    if not module.training:
        return {}
    flagged = {
        name: sub._gradient_checkpointing_func
        for name, sub in module.named_modules()
        if getattr(sub, "gradient_checkpointing", False) is True
        and callable(getattr(sub, "_gradient_checkpointing_func", None))
    }
    # The module itself is left out: its class's own wrapper checkpoints the call that runs this
    # graph (transformers wraps the forward of every subclass of a checkpointing layer, ours too).
    return {
        name: function
        for name, function in flagged.items()
        if name and not any(other.startswith(f"{name}.") for other in flagged)
    }


def _run_plainly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


@contextlib.contextmanager
def checkpointing_off(module: nn.Module) -> Iterator[None]:
    # torch.export records the layers' ops, not the checkpoint machinery (`checkpoint_regions`
    # puts it back on the rewritten graph); the flags stay on, so the code checkpointing changes
    # (Hugging Face turns the cache off) is what is captured.
    flagged = [sub for sub in module.modules() if callable(sub.__dict__.get("_gradient_checkpointing_func"))]
    functions = [sub.__dict__["_gradient_checkpointing_func"] for sub in flagged]
    for sub in flagged:
        sub._gradient_checkpointing_func = _run_plainly
    try:
        yield
    finally:
        for sub, function in zip(flagged, functions, strict=True):
            sub._gradient_checkpointing_func = function
