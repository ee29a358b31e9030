"""amp_fx's kernels, one subpackage per family; installed as `amp_fx.kernels`.

Each family (``amp_fx.kernels.families.FAMILIES``) keeps its contract in its ``__init__`` (the
math, the kernels' signatures), its pure-torch ``reference`` and its ``triton`` kernels beside it,
and the ``arguments`` checks both run: ``overflow_check``, ``adam``, ``sgd``, ``loss_scale``
(behind the optimizers and `amp_fx.LossScaler`), ``cross_entropy``, ``batch_norm``, ``max_pool``,
``activations``, ``norms``, ``rotary`` (behind the ops of the same names in ``amp_fx.ops``),
``range_stats`` (behind ``amp_fx.ops.range_record``, what `amp_fx.watch` records with). Shared
pieces: ``arguments`` (dtype, layout and update checks), ``optimizer_step`` (the skip rule and step
counter), and for the Triton kernels ``pointer_table``, ``optimizer_launch`` (the optimizers' launch
per dtype group), ``rounding`` and ``devices``.

Two modules gather every family's kernels under one name space:

- ``reference``: plain torch; runs on any device and is what the optimizers use without CUDA.
- ``triton_ops``: Triton kernels, one launch per dtype group; run on CUDA tensors, or on CPU
  tensors under ``TRITON_INTERPRET=1`` (slow; for tests). None when Triton is not installed.
  Loaded on first use: importing the reference or a family's argument checks (what convert and
  the passes read) does not load Triton.

``implementation_for(tensors)`` picks one: Triton for CUDA tensors, or for all with
``AMP_FX_FORCE_TRITON=1``. The fused norms, activations and rotary embeddings of ``amp_fx.ops``
compute their torch expression where the reference would run, unless ``AMP_FX_FORCE_TRITON`` is
set (`kernels_run_for`).

Example:
    >>> import torch
    >>> from amp_fx.kernels import implementation_for, reference
    >>> implementation_for([torch.zeros(2)]) is reference  # CPU tensors, AMP_FX_FORCE_TRITON unset
    True
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from torch import Tensor

from amp_fx.kernels import reference

__all__ = ["reference", "triton_ops", "implementation_for", "kernels_run_for"]

FORCE_TRITON_ENV = "AMP_FX_FORCE_TRITON"


def implementation_for(tensors: Iterable[Tensor]) -> ModuleType:
    """The module to run these tensors' kernels with: ``triton_ops`` for CUDA tensors (or when the
    environment sets ``AMP_FX_FORCE_TRITON=1``, e.g. to test the kernels on CPU under
    ``TRITON_INTERPRET=1``), else ``reference``.

    Example:
        >>> import torch
        >>> implementation_for([]).__name__
        'amp_fx.kernels.reference'
    """
    first = next(iter(tensors), None)
    if os.environ.get(FORCE_TRITON_ENV) != "1" and (first is None or not first.is_cuda):
        return reference
    triton = _triton_ops()
    return reference if triton is None else triton


def kernels_run_for(tensor: Tensor) -> bool:
    """Whether a fused norm, activation or rotary embedding of ``amp_fx.ops`` calls this package's
    kernels for ``tensor`` when run eagerly: on CUDA, or wherever ``AMP_FX_FORCE_TRITON`` is set
    ("1": Triton, "0": the reference off CUDA, as tests and the host-cost benchmark ask). Else (a
    CPU) the op computes its torch expression: the reference is the same math in torch ops, with
    more host time than torch's own chain (BENCHMARKS.md, "Host time on the CPU").

    Example:
        >>> import torch
        >>> kernels_run_for(torch.zeros(2))  # a CPU tensor, AMP_FX_FORCE_TRITON unset
        False
    """
    return tensor.is_cuda or os.environ.get(FORCE_TRITON_ENV) in ("0", "1")


@functools.cache
def _triton_ops() -> ModuleType | None:
    """``amp_fx.kernels.triton_ops``, imported at the first call that wants it; None without Triton
    (e.g. macOS or Windows: no Triton wheel; the reference serves everything)."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("amp_fx.kernels.triton_ops")


def __getattr__(name: str) -> Any:
    # ``amp_fx.kernels.triton_ops`` (None without Triton) loads Triton only when it is asked for.
    if name == "triton_ops":
        return _triton_ops()
    raise AttributeError(f"module 'amp_fx.kernels' has no attribute {name!r}")
