"""What FusedAdam and FusedSGD share: FP32 master weights, state, and a step with no host sync.

For each fp16/bf16 parameter (with ``master_weights=True``) the optimizer keeps an FP32 copy in
``state[p]["master_param"]``; the update reads the low-precision grad, computes in FP32 from the
master and writes the master and the rounded low-precision weight. FP32 parameters are their own
master and are updated in place. Masters are created with the param group; moments (FP32, shaped
like the parameter) at the parameter's first step with a grad, as torch.optim and Apex create theirs.

A step hands, per param group, all params that have grads to one call of the kernel
(`amp_fx.kernels`), then advances the group's step counter (``param_group["step"]``, a float32
device tensor of shape (1,)) on the device. Each parameter with moments holds
``state[p]["step_offset"]``, the group steps it took no part in, so that its own count is ``step -
step_offset``, as torch.optim counts. Loss scaling reaches the kernel as two device tensors, a grad
multiplier and an overflow flag (`amp_fx.optim.pending_scaling`), never read on the host; an
overflow makes the kernel write nothing. ``torch.amp.GradScaler`` drives the same path through the
``grad_scale``/``found_inf`` attributes it sets on optimizers with
``_step_supports_amp_scaling = True``. docs/DESIGN.md ("Optimizers, master weights and loss
scaling") tells the whole of it.

Example:
    >>> import torch
    >>> from amp_fx.optim import FusedSGD, master_params
    >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    >>> opt = FusedSGD([w], lr=0.1)
    >>> w.grad = torch.full((3,), 0.5, dtype=torch.float16)
    >>> opt.step()
    >>> next(master_params(opt))
    tensor([0.9500, 0.9500, 0.9500])
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.kernels import implementation_for
from amp_fx.kernels.arguments import is_dense
from amp_fx.optim.model_load_hooks import MASTER_KEY, track_params
from amp_fx.optim.param_group_checks import as_float, check_params, group_with_param_list, param_tensors
from amp_fx.optim.pending_scaling import PendingScaling
from amp_fx.optim.scaled_optimizer import next_tick
from amp_fx.optim.state_dict_loading import STEP_KEY, STEP_OFFSET_KEY, StateDictLoading
from amp_fx.optim.wrappers import unwrap_optimizer
from amp_fx.training.distributed import local_tensor

logger = logging.getLogger(__name__)


def is_fused_optimizer(optimizer: Any) -> bool:
    """True for optimizers that take loss scaling as a pending grad multiplier (amp_fx's fused ones)."""
    return isinstance(optimizer, FusedOptimizer)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Yield, for each parameter of ``optimizer`` in param-group order, its FP32 master.

    A parameter without a master (an fp32 parameter, or any parameter of a group with
    ``master_weights=False``) is yielded itself. ``optimizer`` may be a wrapper that holds the
    optimizer at ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, Lightning's).

    Example:
        >>> import torch
        >>> from amp_fx.optim import FusedAdam, master_params
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> [m.dtype for m in master_params(FusedAdam([w]))]
        [torch.float32]
    """
    optimizer = unwrap_optimizer(optimizer)
    if not is_fused_optimizer(optimizer):
        raise TypeError(
            f"master_params needs an amp_fx.optim optimizer (FusedAdam, FusedSGD), got "
            f"{type(optimizer).__name__}; torch.optim optimizers keep no master weights"
        )
    for group in optimizer.param_groups:
        for param in group["params"]:
            yield optimizer.state.get(param, {}).get(MASTER_KEY, param)


@dataclass
class StepBatch:
    """The tensors of one param group that take part in one step (params with a grad)."""

    device: torch.device
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    masters: list[Tensor | None] = field(default_factory=list)
    states: dict[str, list[Tensor]] = field(default_factory=lambda: defaultdict(list))
    step_offsets: list[Tensor] = field(default_factory=list)
    # Offsets of the group's params that have moments but no grad this step (they do not count it).
    idle_step_offsets: list[Tensor] = field(default_factory=list)

    def step_offsets_or_none(self) -> list[Tensor] | None:
        """The offsets, one per param, or None when the group keeps no moments (nothing reads them)."""
        return self.step_offsets if self.step_offsets else None

    def masters_or_none(self) -> list[Tensor | None] | None:
        """The masters list, or None when no param has one (all are updated in place)."""
        return None if all(m is None for m in self.masters) else self.masters


class FusedOptimizer(StateDictLoading, torch.optim.Optimizer):
    """Base of the fused optimizers; subclasses say which state they keep and which kernel they call.

    Implements `amp_fx.optim.scaled_optimizer.ScaledOptimizer`, the loss scaler's handshake;
    ``load_state_dict`` checks a checkpoint whole before it changes anything
    (`amp_fx.optim.state_dict_loading`).

    The base does what every fused optimizer does: ``master_weights``, param groups, the checks of
    params and of hyperparameters' types, state, the step. A subclass states only what is its own:

    - ``_kernel_name``: its kernel in `amp_fx.kernels` (``"adam_step_"``), which the step calls as
      ``kernel(params, grads, masters, *states, step, **hyperparameters, grad_multiplier=...,
      found_inf=..., step_offsets=...)``;
    - ``_state_names``: its FP32 state tensors besides the master, each shaped like the parameter, in
      the order its kernel takes them (``("exp_avg", "exp_avg_sq")``); ``_state_keys(group)`` says
      which of them a group keeps (all, unless overridden: SGD's buffer only with momentum);
    - ``_flags``: its True/False hyperparameters (``master_weights`` is every optimizer's);
    - ``_kernel_hyperparameters(group)``: its kernel's hyperparameter arguments, read from a param
      group (``lr``, ``beta1``, ...: any but a flag is checked to be a Python number, then passed
      as a float);
    - ``_check_kernel_hyperparameters(hyperparameters)``: raise ValueError for values its kernel
      refuses (its family's ``arguments`` checks).
    """

    # torch.amp.GradScaler then hands over grad_scale/found_inf instead of unscaling in place.
    _step_supports_amp_scaling = True
    _kernel_name: str
    _state_names: tuple[str, ...]
    _flags: tuple[str, ...] = ()

    def __init__(self, params: Any, hyperparameters: dict[str, Any], master_weights: bool) -> None:
        # When it was created or last stepped: a LossScaler that scaled a loss since may own its grads.
        self.last_step_tick = next_tick()
        self._pending = PendingScaling()
        super().__init__(params, {**hyperparameters, "master_weights": master_weights})

    # ----------------------------------------------------------------------------------------
    # Hyperparameters (a subclass defines ``_kernel_hyperparameters`` and
    # ``_check_kernel_hyperparameters``; see the class docstring)

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        """Raise TypeError/ValueError for a bad value in ``group`` (a new group with the defaults
        merged in, or a loaded one), before anything is created."""
        hyperparameters = self._kernel_hyperparameters(group)
        for name in (*self._flags, "master_weights"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{name} must be True or False, got {group[name]!r}")
        self._check_kernel_hyperparameters(
            {
                name: value if name in self._flags else as_float(name, value)
                for name, value in hyperparameters.items()
            }
        )

    # ----------------------------------------------------------------------------------------
    # Param groups and state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch.optim.Optimizer.__getstate__ keeps only defaults/state/param_groups (deepcopy, pickle).
        if "_pending" not in self.__dict__:
            self._pending = PendingScaling()
        self.__dict__.setdefault("last_step_tick", next_tick())
        # A copy (deepcopy, unpickling) holds new params: loads into their model must reach its masters.
        track_params(self, (p for group in self.param_groups for p in group["params"]))
        self._fill_missing_step_offsets()

    def _fill_missing_step_offsets(self) -> None:
        """Give offset 0 (the group's count is the param's own) to params that hold moments but no
        step offset: state saved, pickled or deep-copied before per-parameter counts existed.

        Done here, once, because load_state_dict, unpickling and deepcopy all end here; the step then
        meets only params with both moments and offset, or neither (a first step)."""
        for group in self.param_groups:
            step_device = group[STEP_KEY].device
            for param in group["params"]:
                state = self.state.get(param)
                # Any key but the master is a moment, also one the group's hyperparameters no longer use
                # (momentum set to 0): it is used again, with this offset, if they change back.
                if state and STEP_OFFSET_KEY not in state and set(state) - {MASTER_KEY}:
                    state[STEP_OFFSET_KEY] = torch.zeros((), dtype=torch.float32, device=step_device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (torch semantics); creates its FP32 masters and step counter (moments come
        with each parameter's first step).

        Example:
            >>> import torch
            >>> from amp_fx.optim import FusedAdam
            >>> opt = FusedAdam([torch.nn.Parameter(torch.zeros(2))])
            >>> opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))]})
            >>> opt.state[opt.param_groups[1]["params"][0]]["master_param"].dtype
            torch.float32
        """
        param_group = group_with_param_list(param_group)
        tensors = param_tensors(param_group["params"])
        check_params(type(self).__name__, tensors)
        merged = {**self.defaults, **param_group}
        self._check_hyperparameters(merged)
        super().add_param_group(param_group)  # torch's checks (duplicates, names) before it appends
        group = self.param_groups[-1]
        device = tensors[0].device if tensors else torch.device("cpu")
        group[STEP_KEY] = torch.zeros(1, dtype=torch.float32, device=device)
        for param in group["params"]:
            self._init_master(param, group)
        track_params(self, group["params"])

    def _master_expected(self, param: Tensor, group: dict[str, Any]) -> bool:
        """True for a low-precision param of a group that keeps FP32 masters."""
        return param.dtype in LOW_PRECISION_DTYPES and group["master_weights"]

    def _init_master(self, param: Tensor, group: dict[str, Any]) -> None:
        """Create the FP32 master of a low-precision ``param`` (copied from it), if it has none."""
        state = self.state[param]
        if self._master_expected(param, group) and MASTER_KEY not in state:
            with torch.no_grad():
                # .to() keeps the memory format, so master and param share strides (the kernels need it).
                state[MASTER_KEY] = param.detach().to(torch.float32, copy=True)

    def masters_by_param(self) -> dict[int, Tensor]:
        """id(param) -> its FP32 master, for each parameter that has one (`MasterKeeper`)."""
        return {
            id(param): self.state[param][MASTER_KEY]
            for group in self.param_groups
            for param in group["params"]
            if MASTER_KEY in self.state.get(param, {})
        }

    def adopt_master(self, param: Tensor, value: Tensor) -> Callable[[], None] | None:
        """Give ``param``, stored low after this optimizer was built, the FP32 master ``value`` (its
        value before it was rounded) where its group keeps masters and it has none; returns what
        takes it back, None if none was given (`MasterKeeper`).
        (`amp_fx.optim.model_load_hooks.masters_for_stored_low` calls it; the example is there.)"""
        group = next((g for g in self.param_groups if any(p is param for p in g["params"])), None)
        if group is None or not self._master_expected(param, group) or MASTER_KEY in self.state[param]:
            return None
        with torch.no_grad():
            self.state[param][MASTER_KEY] = value.detach().to(torch.float32, copy=True)
        return lambda: self.state[param].pop(MASTER_KEY, None)

    def release_master(self, param: Tensor) -> tuple[Tensor, Callable[[], None]] | None:
        """Stop keeping the FP32 master of ``param``, now stored FP32 (its own master); returns the
        master and what puts it back, None if it has none (`MasterKeeper`;
        `amp_fx.optim.model_load_hooks.masters_for_stored_fp32` calls it, the example is there)."""
        state = self.state.get(param, {})
        master = state.pop(MASTER_KEY, None)
        if master is None:
            return None

        def undo() -> None:
            self.state[param][MASTER_KEY] = master

        return master, undo

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state tensors a parameter of ``group`` keeps besides its master."""
        return self._state_names

    def _init_moments(self, param: Tensor, group: dict[str, Any]) -> None:
        """Create the zeroed FP32 state tensors ``param`` lacks (its first step, or momentum 0 -> 0.9),
        and with them its step offset: the group's count now, so that this is its step t = 1.

        Moments without an offset (an old checkpoint or pickle) got offset 0 in ``__setstate__``."""
        state = self.state[param]
        created = False
        for key in self._state_keys(group):
            if key not in state:
                state[key] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
                created = True
        if created:
            # A device copy: no host-to-device transfer, no sync (CUDA graphs, sync-debug mode).
            state[STEP_OFFSET_KEY] = group[STEP_KEY].detach().reshape(()).clone()

    # ----------------------------------------------------------------------------------------
    # Pending loss scaling (a `PendingScaling`: set by unscale_grads_ and fold_grad_multiplier_,
    # consumed by step; a load drops it)

    def _reset_pending(self) -> None:
        self._pending.forget()

    # ----------------------------------------------------------------------------------------
    # The ScaledOptimizer protocol (amp_fx.optim.scaled_optimizer: the handshake, step by step)

    def grads_by_device(self) -> dict[torch.device, list[Tensor]]:
        """The grads of all params that have one, per device."""
        grads: dict[torch.device, list[Tensor]] = defaultdict(list)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = local_tensor(param.grad)  # FSDP2: this rank's shard
                    grads[grad.device].append(grad)
        return dict(grads)

    def unscale_grads_(self, inv_scale: Tensor) -> dict[torch.device, Tensor]:
        """Record ``inv_scale`` as the pending grad multiplier and check the grads for inf/NaN.

        The grads are not modified. Returns the found_inf tensor (float32, shape (1,)) per device;
        the next ``step`` skips the update on the device when one of them is > 0. These tensors
        are the optimizer's persistent flags: the next call reuses (and rewrites) them.
        """
        return self._pending.check(self.grads_by_device(), inv_scale)

    def pending_scaling(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """(grad multiplier, found_inf) recorded for ``device`` since the last step, or None for each."""
        return self._pending.multipliers.get(device), self._pending.found_infs.get(device)

    def fold_grad_multiplier_(self, factor: Tensor) -> None:
        """Multiply the pending grad multiplier of each device with grads by ``factor`` (a device tensor)."""
        self._pending.fold(self.grads_by_device(), factor)

    @torch.no_grad()
    def apply_grad_multiplier_(self) -> None:
        """Write ``grad * pending multiplier`` into the grads themselves and forget the multiplier
        (the overflow flags stay pending: the step still skips on them).

        An fp16/bf16 grad is replaced by an FP32 tensor (``param.grad_dtype`` set to None to allow it):
        an fp16 grad divided by the loss scale in place would flush its small values to zero. FP32
        grads are multiplied in place. Then ``param.grad`` holds what the step applies, and whatever
        user code does to it (torch's clip_grad_norm_, logging) is what the step applies.
        """
        fp32_grads: dict[torch.device, list[Tensor]] = defaultdict(list)
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.dtype != torch.float32:
                    grad = grad.to(torch.float32)
                    # The grad's dtype must match param.grad_dtype unless it is None (torch's rule).
                    param.grad_dtype = None
                    param.grad = grad
                local = local_tensor(grad)
                fp32_grads[local.device].append(local)
        for device, grads in fp32_grads.items():
            multiplier = self._pending.multipliers.pop(device, None)
            if multiplier is not None:
                torch._foreach_mul_(grads, multiplier.reshape(()))
        self._pending.multipliers.clear()

    def finish_scaling(self, zeroed_found_infs: Sequence[Tensor] = ()) -> None:
        """Forget the pending multiplier and found_inf; note which of this optimizer's flags are among
        ``zeroed_found_infs`` (set to 0 on the device by LossScaler.update)."""
        self._pending.finish(zeroed_found_infs)

    # ----------------------------------------------------------------------------------------
    # The step

    def _collect(self, group: dict[str, Any]) -> StepBatch | None:
        """Gather the params of ``group`` that have grads; checks only, no state is created here."""
        batch: StepBatch | None = None
        idle_step_offsets = []
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                offset = self.state.get(param, {}).get(STEP_OFFSET_KEY)
                if offset is not None:
                    idle_step_offsets.append(offset)
                continue
            if grad.is_sparse:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam "
                    "for sparse embeddings (nn.Embedding(sparse=False) gives dense ones)"
                )
            # FSDP2's DTensors: the kernels step this rank's shards (the params are mapped in _gather_state).
            grad, local = local_tensor(grad), local_tensor(param)
            if grad.stride() != local.stride() or not is_dense(grad):
                # The kernels walk param, grad and states in storage order; give the grad the param's layout.
                grad = torch.empty_like(local, dtype=grad.dtype).copy_(grad)
            if batch is None:
                batch = StepBatch(device=local.device)
            batch.params.append(param)
            batch.grads.append(grad)
        if batch is not None:
            batch.idle_step_offsets = idle_step_offsets
        return batch

    def _update(
        self,
        kernels: ModuleType,
        batch: StepBatch,
        step: Tensor,
        group: dict[str, Any],
        grad_multiplier: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        """One call of this optimizer's kernel (from ``kernels``, an implementation) for ``batch``."""
        kept = self._state_keys(group)
        hyperparameters = {
            name: value if name in self._flags else float(value)
            for name, value in self._kernel_hyperparameters(group).items()
        }
        getattr(kernels, self._kernel_name)(
            batch.params,
            batch.grads,
            batch.masters_or_none(),
            # One list per state the kernel takes; None for one the group keeps none of.
            *(batch.states[name] if name in kept else None for name in self._state_names),
            step,
            **hyperparameters,
            grad_multiplier=grad_multiplier,
            found_inf=found_inf,
            step_offsets=batch.step_offsets_or_none(),
        )

    def _gather_state(self, group: dict[str, Any], batch: StepBatch) -> None:
        """Add the masters and state tensors of ``batch``'s params, creating moments they lack."""
        keys = self._state_keys(group)
        for param in batch.params:
            self._init_moments(param, group)
            state = self.state[param]
            master = state.get(MASTER_KEY)
            batch.masters.append(None if master is None else local_tensor(master))
            for key in keys:
                batch.states[key].append(local_tensor(state[key]))
            if keys:
                batch.step_offsets.append(state[STEP_OFFSET_KEY])
        batch.params = [local_tensor(param) for param in batch.params]

    def _scaling_for(
        self, device: torch.device, cache: dict[torch.device, tuple[Tensor | None, Tensor | None]]
    ) -> tuple[Tensor | None, Tensor | None]:
        """The (grad_multiplier, found_inf) that this step applies on ``device``.

        Combines the pending values from LossScaler/clip_grad_norm_ with ``grad_scale``/``found_inf``
        set by torch.amp.GradScaler; all device arithmetic, computed once per device.
        """
        if device not in cache:
            grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
            cache[device] = self._pending.for_step(device, grad_scale, found_inf)
        return cache[device]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update every parameter that has a grad, in one kernel call per param group.

        ``closure`` (optional) re-evaluates the model and returns the loss, as in torch.optim.
        Under a LossScaler (or torch.amp.GradScaler) the grads are unscaled and checked on the
        device; an overflow leaves all weights, masters, moments and step counters bit-identical.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Collect every group first, so that a bad grad raises before anything is created or written.
        batches = [(group, self._collect(group)) for group in self.param_groups]
        cache: dict[torch.device, tuple[Tensor | None, Tensor | None]] = {}
        for group, batch in batches:
            if batch is None:
                continue
            self._gather_state(group, batch)
            step = group[STEP_KEY]
            grad_multiplier, found_inf = self._scaling_for(batch.device, cache)
            kernels = implementation_for(batch.params)
            self._update(kernels, batch, step, group, grad_multiplier, found_inf)
            kernels.advance_step_(step, found_inf)
            # Params with moments but no grad do not take this step: their own counts stay.
            kernels.advance_step_(batch.idle_step_offsets, found_inf)
        self._reset_pending()
        self.last_step_tick = next_tick()
        return loss
