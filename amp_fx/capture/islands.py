"""Autocast islands of the torch.export front end: the modules an island's code calls (each
captured on its own) and the one notice a call's islands give, grouped by cause."""

from __future__ import annotations

import logging

from torch import nn

# The notice keeps the logger name users and tests filter on: it was captured_model's.
logger = logging.getLogger("amp_fx.capture.captured_model")

__all__ = ["called_children", "log_islands"]


def called_children(module: nn.Module) -> list[nn.Module]:
    """The children an island's code calls: ModuleList/ModuleDict are never called, their items are.

    >>> [type(m).__name__ for m in called_children(nn.Sequential(nn.ModuleList([nn.ReLU()]), nn.Tanh()))]
    ['ReLU', 'Tanh']
    """
    children = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            children += called_children(child)
        else:
            children.append(child)
    return children


def log_islands(model: nn.Module, islands: list[tuple[nn.Module, str]]) -> None:
    """One notice for the islands one call made, modules with the same cause listed together."""
    names = {id(module): name or "<model>" for name, module in model.named_modules()}
    by_reason: dict[str, list[str]] = {}
    for module, reason in islands:
        name = names.get(id(module), type(module).__name__)
        cause = reason.replace(type(module).__name__, "<module>")
        by_reason.setdefault(cause, []).append(f"{name} ({type(module).__name__})")
    lines = [f"  {', '.join(modules)}: {cause}" for cause, modules in by_reason.items()]
    logger.warning(
        "%s: %d module(s) run in autocast islands for calls like this one; their own code runs under "
        "torch.autocast and the modules they call are captured on their own "
        "(amp_fx.capture_summary(model) tells more):\n%s",
        type(model).__name__,
        len(islands),
        "\n".join(lines),
    )
