"""The kernel families: every subpackage of ``amp_fx.kernels``, found when this module is imported,
so that a new family is a new folder and nothing else of ``amp_fx.kernels`` changes.

A family's ``__init__`` states its contract (the math, the kernels' signatures) and lists its
kernels in ``KERNELS``; ``reference.py`` and ``triton.py`` beside it implement them, and
``arguments.py`` holds the checks both run. ``amp_fx.kernels.reference`` and
``amp_fx.kernels.triton_ops`` gather the kernels of every family under one name each
(`kernels_of`). ``advance_step_``, the step counter every optimizer kernel shares
(``amp_fx.kernels.optimizer_step``), is the one kernel of no family.

Example:
    >>> [family.__name__ for family in FAMILIES][:2]
    ['amp_fx.kernels.activations', 'amp_fx.kernels.adam']
    >>> "adam_step_" in KERNEL_NAMES and "batch_norm_act_backward" in KERNEL_NAMES
    True
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any

from amp_fx.kernels.optimizer_step import advance_step_

__all__ = ["FAMILIES", "KERNEL_NAMES", "kernels_of"]

FAMILIES: tuple[ModuleType, ...] = tuple(
    importlib.import_module(f"amp_fx.kernels.{info.name}")
    for info in pkgutil.iter_modules(importlib.import_module("amp_fx.kernels").__path__)
    if info.ispkg
)
KERNEL_NAMES: tuple[str, ...] = ("advance_step_", *(name for family in FAMILIES for name in family.KERNELS))


def kernels_of(implementation: str) -> dict[str, Callable[..., Any]]:
    """Every kernel by name: each family's ``KERNELS`` from its ``implementation`` module
    (``"reference"`` or ``"triton"``), and ``advance_step_``.

    Example:
        >>> kernels = kernels_of("reference")
        >>> kernels["adam_step_"].__module__
        'amp_fx.kernels.adam.reference'
    """
    kernels: dict[str, Callable[..., Any]] = {"advance_step_": advance_step_}
    for family in FAMILIES:
        module = importlib.import_module(f"{family.__name__}.{implementation}")
        kernels.update((name, getattr(module, name)) for name in family.KERNELS)
    return kernels
