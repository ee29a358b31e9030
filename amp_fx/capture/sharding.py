"""Capturing a call of a model sharded with FSDP2 (`amp_fx.training.fsdp.fully_shard_converted`).

Where FSDP2 shards a converted model, each group's parameters are FP32 ``DTensor`` shards until the
group's forward pre-hook gathers them. A capture records the whole call's ops at once, so while
torch.export runs (`sharded_capture`):

- FSDP2's forward hooks are off: torch.export runs the model's Python, module calls included, and
  the hooks would gather and free parameters on the capture's fake tensors;
- each sharded parameter is a tensor of its full shape, in the dtype FSDP2 gathers it in, with no
  storage (torch.export reads shapes and dtypes only): the graph is the one the gathered model
  computes, and no rank ever holds the whole model.

The rewritten graph is then cut at the sharded modules (`amp_fx.passes.shard_regions`), so each
group's ops run inside its own call and FSDP2 gathers one block at a time.

>>> sharded_modules(nn.Linear(2, 2))
{}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from amp_fx.training.distributed import is_dtensor, is_fsdp_module

__all__ = ["GATHER_DTYPE_ATTR", "is_sharded", "sharded_modules", "sharded_capture"]

# In a module's __dict__: the module is an FSDP2 group of `fully_shard_converted`, gathered in this
# dtype (None: its parameters' own, FP32).
GATHER_DTYPE_ATTR = "_amp_fx_gather_dtype"


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 shards ``module`` or a part of it: its graphs must read parameters at each call."""
    return any(is_fsdp_module(sub) for sub in module.modules())


def sharded_modules(module: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of the FSDP2 groups of `fully_shard_converted` strictly inside
    ``module`` (its own group, if it is one, is gathered whenever it runs)."""
    return {name: sub for name, sub in module.named_modules() if name and GATHER_DTYPE_ATTR in sub.__dict__}


def _gather_dtypes(module: nn.Module) -> dict[str, tuple[nn.Module, str, torch.dtype]]:
    """Qualified name -> (owning module, attribute, gather dtype) of each parameter held sharded now."""
    groups = sharded_modules(module)
    sharded: dict[str, tuple[nn.Module, str, torch.dtype]] = {}
    for name, owner in module.named_modules():
        for attribute, param in owner._parameters.items():
            if not is_dtensor(param):
                continue
            qualified = f"{name}.{attribute}" if name else attribute
            group = max((g for g in groups if qualified.startswith(f"{g}.")), key=len, default=None)
            if group is None:
                raise TypeError(
                    f"{type(module).__name__} is part of a module FSDP2 shards and holds its parameter "
                    f"{qualified} sharded when called on its own: call the sharded module that "
                    "encloses it (its forward gathers the parameters)"
                )
            dtype = groups[group].__dict__[GATHER_DTYPE_ATTR] or param.dtype
            sharded[qualified] = (owner, attribute, dtype)
    return sharded


def _storageless(param: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    # Made one at a time and freed at once: the peak is one parameter, never the model.
    tensor = torch.empty(param.shape, dtype=dtype, device=param.to_local().device)
    tensor.untyped_storage().resize_(0)
    return nn.Parameter(tensor, requires_grad=param.requires_grad)


def _bound_to(hook: object) -> object:
    """The object whose method ``hook`` is, through wrappers: a group of several modules (FSDP2's
    ``fully_shard([...])``) hooks each through a wrapper of its state's method."""
    while hook is not None:
        if (owner := getattr(hook, "__self__", None)) is not None:
            return owner
        hook = getattr(hook, "__wrapped__", None)
    return None


@contextlib.contextmanager
def _fsdp_hooks_off(module: nn.Module) -> Iterator[None]:
    saved = []
    for sub in module.modules():
        if not is_fsdp_module(sub):
            continue
        state = sub._get_fsdp_state()
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks):
            saved.append((hooks, dict(hooks)))
            for key, hook in list(hooks.items()):
                if _bound_to(hook) is state:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, entries in saved:
            hooks.clear()
            hooks.update(entries)


@contextlib.contextmanager
def sharded_capture(module: nn.Module) -> Iterator[None]:
    """While open, ``module`` and its parts can be captured although FSDP2 shards them (module
    docstring); a no-op for a module nothing in which is sharded."""
    sharded = _gather_dtypes(module)
    originals = {name: owner._parameters[attribute] for name, (owner, attribute, _) in sharded.items()}
    try:
        for name, (owner, attribute, dtype) in sharded.items():
            owner._parameters[attribute] = _storageless(originals[name], dtype)
        with _fsdp_hooks_off(module):
            yield
    finally:
        for name, (owner, attribute, _) in sharded.items():
            owner._parameters[attribute] = originals[name]
