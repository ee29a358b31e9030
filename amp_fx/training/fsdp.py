"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a converted model: sharded FP32 masters.

`fully_shard_converted` shards an `amp_fx.convert`-ed GraphModule so that each rank holds
1/world_size of every parameter, in FP32: those shards are the master weights (the fused
optimizers update FP32 parameters in place, so no second FP32 copy exists), and FSDP2's
all-gather hands the forward the dtype in which the graph reads each parameter. How the opt
level's decisions become ``MixedPrecisionPolicy`` objects (docs/DESIGN.md, "FSDP2"):

- every module the graph calls (``call_module``) whose parameters the graph reads nowhere else
  gets its own ``fully_shard`` (gathered at its forward, freed after it), with
  ``param_dtype`` = the dtype convert stored its parameters in: fp16/bf16 for Linear/Conv at
  O2 and O3, None (FP32) for norms that the opt level keeps FP32 (LayerNorm/GroupNorm at O2,
  BatchNorm under ``keep_batchnorm_fp32``);
- the remaining parameters (those the graph reads with ``get_attr``, e.g. every parameter at O1,
  where the graph casts weights itself) form the root group: gathered in the low dtype when
  every read of them is a cast to it (or convert stored them low), else in FP32, the graph's
  casts then making the low copies as they do without FSDP;
- ``reduce_dtype`` is always float32 (gradients are reduce-scattered in FP32 onto the FP32
  shards), and ``cast_forward_inputs=False``: activations are cast by the graph, as without FSDP.

A model of the torch.export front end (Hugging Face models) is sharded per transformer block
instead (`amp_fx.training.fsdp_groups`; docs/DESIGN.md, "FSDP2 for the torch.export front end"): its
captured graph is cut at the blocks, each block's ops run through the block's own call, so FSDP2
gathers one block at a time; the parts stored in another dtype (O2's FP32 norms, all blocks') are
one group of their own, gathered once per step (`amp_fx.training.fsdp_groups.shard_units`).

The shards stay FP32: convert's low-precision storage is undone (``param.data = data.float()``,
exact) before sharding, so the masters start from convert's rounded weights, as `FusedAdam`'s
masters do in the unsharded O2 recipe.

Checkpoints go through ``torch.distributed.checkpoint``: `save_checkpoint` / `load_checkpoint`
write and read model, optimizer and loss scaler state, sharded, and reshard on a different
number of ranks; values that are not tensors are read with ``torch.load(weights_only=True)``.

Example (inside a ``torchrun`` job)::

    >>> gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> fully_shard_converted(gm)  # doctest: +SKIP
    >>> optimizer = amp_fx.optim.FusedAdam(gm.parameters(), lr=1e-3)  # doctest: +SKIP
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.fx
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from amp_fx.capture.captured_model import CapturedModel
from amp_fx.capture.sharding import GATHER_DTYPE_ATTR, is_sharded
from amp_fx.capture.state import capture_states
from amp_fx.capture.traced_graph_module import FOLLOWER_ATTR
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES, default_device_type
from amp_fx.core.node_info import POLICY_KEY, node_info
from amp_fx.optim.fused_optimizer import is_fused_optimizer
from amp_fx.training.fsdp_groups import shard_groups, shard_units
from amp_fx.training.loss_scaler import LossScaler

logger = logging.getLogger(__name__)

__all__ = [
    "fully_shard_converted",
    "mixed_precision_policies",
    "gathered_parameter_bytes",
    "save_checkpoint",
    "load_checkpoint",
]


def _check_converted(gm: Any) -> torch.fx.GraphModule | CapturedModel:
    if isinstance(gm, FSDPModule) or (isinstance(gm, nn.Module) and is_sharded(gm)):
        raise TypeError("fully_shard_converted got a model that is already sharded; pass the converted model")
    if isinstance(gm, CapturedModel):
        return gm
    if not (isinstance(gm, torch.fx.GraphModule) and POLICY_KEY in gm.meta):
        raise TypeError(
            f"fully_shard_converted needs a GraphModule from amp_fx.convert, got {type(gm).__name__}; "
            "convert the plain model first: fully_shard_converted(amp_fx.convert(model, 'O2'))"
        )
    return gm


def _policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def _read_dtype(node: torch.fx.Node, stored: torch.dtype) -> torch.dtype:
    """The dtype the graph reads a ``get_attr`` parameter in: low if every use is a cast to one low dtype."""
    targets = {node_info(user).out_dtype if node_info(user).is_cast else None for user in node.users}
    if len(targets) == 1 and (target := targets.pop()) in LOW_PRECISION_DTYPES:
        return target
    return stored


def mixed_precision_policies(
    gm: torch.fx.GraphModule | nn.Module, block_types: Iterable[type] | None = None
) -> dict[str, MixedPrecisionPolicy]:
    """The FSDP2 groups of a converted model: module name ("" for the root) -> its MixedPrecisionPolicy.

    Read-only: it inspects the graph and the parameters' dtypes (module docstring: the rules). For
    a model of the torch.export front end the groups are its blocks (``block_types``, found by
    default) and the parts stored in another dtype (`amp_fx.training.fsdp_groups.shard_groups`).

    Example:
        >>> import torch, amp_fx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> gm = amp_fx.convert(model, "O2", dtype=torch.bfloat16)  # the LayerNorm is fused: root group
        >>> {name: p.param_dtype for name, p in mixed_precision_policies(gm).items()}
        {'0': torch.bfloat16, '': None}
    """
    gm = _check_converted(gm)
    if isinstance(gm, CapturedModel):
        return {name: _policy(dtype) for name, dtype in shard_groups(gm, block_types).items()}
    params_by_name = dict(gm.named_parameters(remove_duplicate=False))
    read_directly: dict[str, torch.dtype] = {}
    called: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in params_by_name:
            read_directly[node.target] = _read_dtype(node, params_by_name[node.target].dtype)
        elif node.op == "call_module" and node.target not in called:
            called.append(node.target)
    groups: dict[str, MixedPrecisionPolicy] = {}
    grouped: set[str] = set()
    for name in called:
        names = [f"{name}.{p}" for p, _ in gm.get_submodule(name).named_parameters(remove_duplicate=False)]
        if not names or any(n in read_directly or n in grouped for n in names):
            continue  # no parameters, or some read outside the module's forward: they stay in the root group
        dtypes = {params_by_name[n].dtype for n in names}
        if len(dtypes) != 1:
            continue
        dtype = dtypes.pop()
        groups[name] = _policy(dtype if dtype in LOW_PRECISION_DTYPES else None)
        grouped.update(names)
    root_dtypes = {read_directly.get(n, p.dtype) for n, p in params_by_name.items() if n not in grouped}
    stored_low = {
        n for n, p in params_by_name.items() if n not in grouped and p.dtype in LOW_PRECISION_DTYPES
    }
    if len(root_dtypes) == 1 and (dtype := next(iter(root_dtypes))) in LOW_PRECISION_DTYPES:
        groups[""] = _policy(dtype)
    elif stored_low:
        raise ValueError(
            f"cannot shard this converted model: parameters {sorted(stored_low)[:4]} are stored in low "
            "precision and read by the graph outside their module's forward, next to parameters read in "
            "FP32, and one FSDP2 group gathers in one dtype; convert at O1, or make those modules "
            "called as a whole (leaf_modules) so that they get a group of their own"
        )
    else:
        groups[""] = _policy(None)
    return groups


def _default_mesh(gm: nn.Module) -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard_converted needs torch.distributed: call dist.init_process_group() first "
            "(torchrun sets up the environment for it)"
        )
    return init_device_mesh(default_device_type(gm), (dist.get_world_size(),))


def fully_shard_converted(
    gm: torch.fx.GraphModule | nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    block_types: Iterable[type] | None = None,
) -> FSDPModule:
    """Shard a converted model with FSDP2, in place; its parameters become FP32 ``DTensor`` shards.

    Call it on the rank's device after ``dist.init_process_group``, before building the
    optimizer. ``mesh`` defaults to a 1-D mesh over the world on the parameters' device type.
    Returns ``gm`` (now also an ``FSDPModule``).

    A model of the torch.export front end (every Hugging Face model) is sharded per transformer
    block, found from ``_no_split_modules`` or repeated ``nn.ModuleList`` items unless
    ``block_types`` names the classes; each block's parameters are gathered for its own forward
    and freed after it (docs/DESIGN.md, "FSDP2 for the torch.export front end").

    Raises:
        TypeError: ``gm`` is not a model from ``amp_fx.convert`` or is sharded already, or it
            checkpoints layers (torch.export front end).
        ValueError: one FSDP2 group would need two gather dtypes (see `mixed_precision_policies`),
            or a model of the torch.export front end has no blocks or ties parameters of two groups.
        RuntimeError: torch.distributed is not initialised and no ``mesh`` was given.

    Example (inside a ``torchrun`` job)::

        >>> gm = fully_shard_converted(amp_fx.convert(model.cuda(), "O2"))  # doctest: +SKIP
        >>> optimizer = amp_fx.optim.FusedAdam(gm.parameters())  # doctest: +SKIP
    """
    policies = mixed_precision_policies(gm, block_types)  # checks everything before anything changes
    if isinstance(gm, CapturedModel):
        _refuse_checkpointing(gm)
    mesh = mesh if mesh is not None else _default_mesh(gm)
    with torch.no_grad():
        for param in gm.parameters():
            if param.dtype in LOW_PRECISION_DTYPES:
                param.data = param.data.float()  # exact: the FP32 shard is the master
    if isinstance(gm, CapturedModel):
        dtypes = {name: policy.param_dtype for name, policy in policies.items()}
        units = shard_units(gm, block_types, dtypes)
    else:
        units = [(name,) for name in policies]
    for names in units:
        modules = [gm.get_submodule(name) if name else gm for name in names]
        # A group of several parts (every block's FP32 norms) runs the whole forward: it stays
        # gathered for the backward (tiny) rather than being gathered a second time.
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            mp_policy=policies[names[0]],
            reshard_after_forward=reshard_after_forward and len(modules) == 1,
        )
    if isinstance(gm, CapturedModel):
        for name, policy in policies.items():
            (gm.get_submodule(name) if name else gm).__dict__[GATHER_DTYPE_ATTR] = policy.param_dtype
        for _, state in capture_states(gm):
            state.graphs.clear()  # they read the parameters FSDP2 has just replaced by shards
            state.unstored.clear()  # FP32 shards now, in groups gathered in FP32: they stay FP32
    elif FOLLOWER_ATTR in gm.__dict__:
        gm.__dict__[FOLLOWER_ATTR].accept(gm)  # the graph reads the shards as it read the parameters
    logger.info(
        "sharded %d FSDP2 groups over %d ranks: %s",
        len(units),
        mesh.size(),
        {name or "<root>": policy.param_dtype or torch.float32 for name, policy in policies.items()},
    )
    return gm  # type: ignore[return-value]


def _refuse_checkpointing(model: nn.Module) -> None:
    flagged = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if flagged:
        raise TypeError(
            f"{type(model).__name__} checkpoints layers ({flagged[0] or 'the model'}); amp_fx does not "
            "combine activation checkpointing with FSDP2 sharding yet: call gradient_checkpointing_disable() "
            "first"
        )


def gathered_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the gathered (unsharded) parameters ``model``'s modules hold now: what FSDP2 has
    all-gathered and not yet freed (each storage once; a freed one holds no bytes). Read from a
    block's forward pre-hook, it is the parameter memory of the forward at that point (not during
    a call that captures a graph: hooks then run on torch.export's fake parameters).

    >>> gathered_parameter_bytes(torch.nn.Linear(4, 2))  # unsharded: every parameter
    40
    """
    storages = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and not isinstance(param, DTensor):
                storage = param.untyped_storage()
                # By the storage object's address: a capture's fake tensors have no data pointer.
                storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


# ------------------------------------------------------------------------------------------------
# Checkpoints


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)  # refuses pickled classes
        # Hand the checked value on through the parent's bookkeeping (small values: hyperparameters).
        super().load_bytes(read_item, _saved_bytes(loaded))


def _saved_bytes(value: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _create_moments(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh fused optimizer its (zero) moments: DCP loads into the tensors a state dict has.

    torch's own fallback (a step with zero grads at lr 0) is skipped for it, its state holding
    entries (masters) before any step.
    """
    if is_fused_optimizer(optimizer):
        for group in optimizer.param_groups:
            for param in group["params"]:
                optimizer._init_moments(param, group)


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler | None) -> dict:
    state: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    return state


def save_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler | None = None,
    *,
    process_group: Any = None,
) -> None:
    """Save model, optimizer and scaler state, sharded, with ``torch.distributed.checkpoint``.

    Every rank calls it (a collective). Call it after ``scaler.update()``. Each rank writes its
    shards; plain values (hyperparameters, the scale) are written once.

    Example (inside a ``torchrun`` job)::

        >>> save_checkpoint("ckpt/step100", gm, optimizer, scaler)  # doctest: +SKIP
    """
    dcp.save(
        _training_state(model, optimizer, scaler),
        checkpoint_id=os.fspath(checkpoint_dir),
        process_group=process_group,
    )


def load_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler | None = None,
    *,
    process_group: Any = None,
) -> None:
    """Load what `save_checkpoint` wrote into ``model``, ``optimizer`` and ``scaler``, in place.

    Every rank calls it. The number of ranks may differ from the saving run (the shards are
    re-cut). Non-tensor values are read with ``weights_only=True``: no pickled classes.

    Example (inside a ``torchrun`` job)::

        >>> load_checkpoint("ckpt/step100", gm, optimizer, scaler)  # doctest: +SKIP
    """
    _create_moments(optimizer)
    state = _training_state(model, optimizer, scaler)
    dcp.load(
        state,
        checkpoint_id=os.fspath(checkpoint_dir),
        planner=_WeightsOnlyLoadPlanner(),
        process_group=process_group,
    )
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
