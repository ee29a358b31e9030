"""Apex's O1 outside the model: its FP32 functions run in FP32 wherever the user calls them.

Apex's O1 patched torch while amp was initialized: ``F.cross_entropy``, ``F.softmax``,
``torch.exp``, ``Tensor.sum`` ... (its ``FP32_FUNCS``) cast fp16 inputs to FP32 wherever they were
called, so the loss an Apex script computes from the model's fp16 output, outside the model, was
FP32, as it is under ``torch.autocast``. amp_fx converts the model itself, so without this the
loss would be computed in fp16: the scaled loss overflows and the first steps are skipped.

While the current `amp.initialize` session patches torch functions (O1, ``patch_torch_functions``),
each function of ``torch.nn.functional``, ``torch`` and ``torch.Tensor`` whose op torch.autocast
runs in FP32 (`amp_fx.core.op_lists`: the ``fp32``, ``fp32_set_opt_dtype`` and
``fp32_append_dtype`` lists and the composites made of them only, such as ``cross_entropy`` on
CUDA; per the device type of its inputs, as autocast decides) is wrapped to upcast its fp16/bf16
floating inputs to float32; ``amp.register_float_function`` adds an op, ``register_half_function``
and ``register_promote_function`` remove one. The wrapper does nothing, and calls the function as
it is:

- where no input is fp16/bf16, or a call of a ``softmax``-like op passes its own ``dtype``;
- inside a converted model: a call from a torch.fx graph's code (the graph's casts decide), or under
  an enabled ``torch.autocast`` for the device (autocast decides, e.g. in an autocast island);
- inside ``amp.disable_casts()`` (Apex's switch for its patches);
- once another session (O0, O2, O3, ``enabled=False``) is current, or none: the patches are then
  removed (`restore`).

So `amp_fx.convert(model, "O1")` is untouched (its graphs' calls pass through; with no O1 session
nothing is patched), and the functions are torch's own again after an O2 ``initialize``.

    >>> import torch
    >>> from amp_fx.amp._fp32_functions import fp32_ops
    >>> "cross_entropy_loss" in fp32_ops("cpu"), "softmax" in fp32_ops("cpu"), "softmax" in fp32_ops("cuda")
    (True, False, True)
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from amp_fx.amp import _state
from amp_fx.amp._model import casts_disabled
from amp_fx.amp._registry import registered_functions
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.op_lists import DEVICE_TYPES, autocast_op_lists, canonical_op_name
from amp_fx.core.rules import Rule

logger = logging.getLogger("amp_fx.amp")

# autocast's lists whose ops compute in float32 from low-precision inputs.
_FP32_LISTS = ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype")
# Composites (on no list, their implementation calls listed ops) made of FP32 ops only, so that
# autocast computes them in float32: cross_entropy = log_softmax + nll_loss; softmin = softmax.
_FP32_COMPOSITES = frozenset({"cross_entropy_loss", "softmin"})
# Tensor's operator methods, by the op they run.
_OPERATOR_METHODS = {"__pow__": "pow", "__rpow__": "pow"}
# Where the functions user code calls live.
_NAMESPACES: tuple[ModuleType | type, ...] = (F, torch, torch.Tensor)
# fx names the code it generates for a graph "<eval_with_key>.N".
_GRAPH_CODE = "<eval_with_key>"

# (namespace, name) -> the function there before patching; empty when nothing is patched.
_ORIGINALS: dict[tuple[Any, str], Any] = {}
_session: Any = None
# device type -> ops whose floating inputs are upcast, for the patched session.
_ops: dict[str, frozenset[str]] = {}
_set_opt_dtype: frozenset[str] = frozenset()


def fp32_ops(device_type: str) -> frozenset[str]:
    """The ops torch.autocast computes in float32 on ``device_type`` (canonical op names)."""
    lists = autocast_op_lists(device_type)
    ops = frozenset().union(*(getattr(lists, name) for name in _FP32_LISTS))
    return ops | (_FP32_COMPOSITES & lists.composite)


def _op_of(namespace: Any, name: str) -> str | None:
    if name in _OPERATOR_METHODS and namespace is torch.Tensor:
        return _OPERATOR_METHODS[name]
    # In-place variants (exp_) cannot store float32 results in a low-precision tensor: autocast
    # leaves them alone too.
    if name.startswith("_") or name.endswith("_"):
        return None
    return canonical_op_name(name)


def _low_precision_device(leaves: list[Any]) -> str | None:
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dtype in LOW_PRECISION_DTYPES:
            return leaf.device.type
    return None


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION_DTYPES:
        return value.float()
    return value


def _called_from_graph_code() -> bool:
    # Two frames up: past the wrapper, its caller.
    return sys._getframe(2).f_code.co_filename.startswith(_GRAPH_CODE)


def _wrap(function: Callable[..., Any], op: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def fp32_function(*args: Any, **kwargs: Any) -> Any:
        if _state._current is not _session:
            restore()  # amp's state was reset or replaced without initialize: back to torch's own
            return function(*args, **kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        device = _low_precision_device(leaves)
        if (
            device is None
            or op not in _ops.get(device, ())
            or casts_disabled()
            or torch.is_autocast_enabled(device)
            or (op in _set_opt_dtype and any(isinstance(leaf, torch.dtype) for leaf in leaves))
            or (not torch.compiler.is_compiling() and _called_from_graph_code())
        ):
            return function(*args, **kwargs)
        args, kwargs = pytree.tree_map(_upcast, (args, kwargs))
        return function(*args, **kwargs)

    fp32_function.__amp_fx_fp32_original__ = function  # type: ignore[attr-defined]
    return fp32_function


def patch(session: Any) -> None:
    """Patch torch's FP32 functions for ``session`` (the current one; module docstring)."""
    global _session, _ops, _set_opt_dtype
    restore()
    registered = registered_functions()
    added = {op for op, rule in registered.items() if rule is Rule.FP32}
    removed = {op for op, rule in registered.items() if rule is not Rule.FP32}
    _ops = {device: (fp32_ops(device) | added) - removed for device in DEVICE_TYPES}
    _set_opt_dtype = frozenset().union(*(autocast_op_lists(d).fp32_set_opt_dtype for d in DEVICE_TYPES))
    wanted = frozenset().union(*_ops.values())
    _session = session
    for namespace in _NAMESPACES:
        for name in [*dir(namespace), *(_OPERATOR_METHODS if namespace is torch.Tensor else ())]:
            op = _op_of(namespace, name)
            if op not in wanted:
                continue
            function = getattr(namespace, name, None)
            if not callable(function) or isinstance(function, type):
                continue
            _ORIGINALS[(namespace, name)] = namespace.__dict__.get(name, _INHERITED)
            setattr(namespace, name, _wrap(function, op))
    logger.debug("O1: %d torch functions run their FP32 ops in FP32", len(_ORIGINALS))


# Marks a Tensor method inherited from torch._C.TensorBase: restoring deletes the override.
_INHERITED = object()


def restore() -> None:
    """Give torch its own functions back (nothing patched afterwards)."""
    global _session
    for (namespace, name), original in _ORIGINALS.items():
        if original is _INHERITED:
            delattr(namespace, name)
        else:
            setattr(namespace, name, original)
    _ORIGINALS.clear()
    _session = None


def patched() -> bool:
    """Whether torch's FP32 functions are patched now."""
    return bool(_ORIGINALS)
