"""LossScaler: dynamic loss scaling with torch.amp.GradScaler's protocol, state on the device.

``scale``, ``unscale_``, ``step`` and ``update`` work as in ``torch.amp.GradScaler``, with the same
defaults, so GradScaler code runs unchanged; on top of it: hysteresis, min/max scale, and a step
with no host sync for amp_fx's fused optimizers (any `amp_fx.optim.scaled_optimizer.ScaledOptimizer`):
``defer_unscale_`` (called by ``amp_fx.clip_grad_norm_`` or ``step``) hands ``1 / scale`` to the
optimizer's kernel, ``unscale_`` gives the true grads, and an overflow skips the update on the
device. Any other optimizer is scaled as GradScaler scales it
(`amp_fx.optim.torch_optimizer_scaling`). docs/DESIGN.md ("Optimizers, master weights and loss
scaling") tells both paths at length.

Example:
    >>> import torch, amp_fx
    >>> model = torch.nn.Linear(4, 2).half()
    >>> opt = amp_fx.optim.FusedAdam(model.parameters())
    >>> scaler = amp_fx.LossScaler(init_scale=1024.0, hysteresis=2)
    >>> loss = model(torch.ones(8, 4, dtype=torch.float16)).float().square().mean()
    >>> scaler.scale(loss).backward()
    >>> scaler.unscale_(opt)
    >>> norm = amp_fx.clip_grad_norm_(opt, max_norm=1.0)
    >>> scaler.step(opt); scaler.update()
    >>> scaler.get_scale()
    1024.0
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from amp_fx.optim.scaled_optimizer import ScaledOptimizer
from amp_fx.optim.torch_optimizer_scaling import (
    any_overflow_on_host,
    reads_found_inf,
    step_reading_found_inf,
    total_found_inf,
    unscale_grads_in_place_,
)
from amp_fx.optim.wrappers import unwrap_optimizer
from amp_fx.training.active_scalers import note_scaled, note_stepped, note_updated
from amp_fx.training.distributed import agree_on_overflow_
from amp_fx.training.loss_scale_checkpoint import ScalerState, read_state_dict, state_dict_of, upgraded_pickle
from amp_fx.training.loss_scale_settings import LossScaleSettings, check_scale
from amp_fx.training.loss_scale_stages import OptimizerRecord, Stage
from amp_fx.training.loss_scale_tensors import ScaleTensors

logger = logging.getLogger(__name__)

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scaler: torch.amp.GradScaler's protocol with hysteresis and a min/max scale.

    The scale starts at ``init_scale``, is multiplied by ``growth_factor`` after
    ``growth_interval`` consecutive steps without inf/NaN grads (never above ``max_scale``) and
    by ``backoff_factor`` on overflow (never below ``min_scale``). With hysteresis it backs off
    only at the ``hysteresis``-th consecutive overflowing step, and again at every further
    consecutive one; a clean step refills the count (DeepSpeed's rule, docs/DESIGN.md). Every
    overflowing step is skipped and resets the growth count, whether or not it backs off.

    The scale and its trackers are 0-dim tensors on the device of the first scaled loss, which
    ``update`` changes in one kernel launch (`amp_fx.training.loss_scale_tensors`). The settings
    are one frozen `amp_fx.training.loss_scale_settings.LossScaleSettings`, checked whole before a
    setter or ``load_state_dict`` replaces them: a refused value changes nothing.

    Args:
        init_scale: initial scale (GradScaler's default 2**16).
        growth_factor, backoff_factor, growth_interval: as torch.amp.GradScaler.
        hysteresis: consecutive overflowing steps before the scale backs off (1 = GradScaler).
        min_scale: lower bound of the scale (None: none).
        max_scale: upper bound of the scale (None: none; 2**24 by default).
        enabled: False makes every method a pass-through (bf16 training needs no scaling).
        process_group: the data-parallel group whose ranks must agree on skipping a step (an
            overflow on one rank skips it on all); None means the default group when
            torch.distributed is initialised. See `amp_fx.training.distributed`.

    Example:
        >>> import torch, amp_fx
        >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        >>> opt, scaler = amp_fx.optim.FusedSGD([w], lr=0.1), amp_fx.LossScaler(init_scale=1024.0)
        >>> scaler.scale((w.float() * 3).sum()).backward()
        >>> w.grad
        tensor([3072., 3072.], dtype=torch.float16)
        >>> scaler.step(opt); scaler.update()
        >>> w
        Parameter containing:
        tensor([0.7002, 0.7002], dtype=torch.float16, requires_grad=True)
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        if isinstance(init_scale, str):
            raise TypeError(
                f"LossScaler's first argument is init_scale, got {init_scale!r}: unlike "
                "torch.amp.GradScaler it takes no device (the scale lives on the device of the first "
                "scaled loss); drop that argument"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        # Frozen: a setter or load_state_dict replaces it whole, checked before it is stored.
        self._settings = LossScaleSettings(
            growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
        )
        check_scale("init_scale", init_scale, self._settings)
        self._enabled = enabled
        self._process_group = process_group
        # Created lazily on the device of the first scaled loss.
        self._tensors = ScaleTensors(float(init_scale), 0, self._settings.hysteresis)
        self._per_optimizer_states: dict[int, OptimizerRecord] = defaultdict(OptimizerRecord)

    def _require_state(self, method: str) -> Tensor:
        if self._tensors.scale is None:
            raise RuntimeError(
                f"LossScaler.{method}() was called before any loss was scaled; "
                "call scaler.scale(loss).backward() first in each iteration"
            )
        return self._tensors.scale

    # ----------------------------------------------------------------------------------------
    # The protocol

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Tensor | Iterable[Tensor]:
        """Multiply a tensor (or an iterable of tensors, nested) by the scale; no-op when disabled.

        Example:
            >>> import torch
            >>> LossScaler(init_scale=8.0).scale(torch.tensor(1.5))
            tensor(12.)
        """
        if not self._enabled:
            return outputs
        note_scaled(self)
        copies: dict[torch.device, Tensor] = {}
        tensors = self._tensors

        def apply(value: Any) -> Any:
            if isinstance(value, Tensor):
                if tensors.scale is None:
                    tensors.create(value.device)
                if value.device not in copies:
                    copies[value.device] = tensors.scale.to(value.device, non_blocking=True)
                return value * copies[value.device]
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable):
                return map(apply, value)
            raise TypeError(f"scale() takes a tensor or an iterable of tensors, got {type(value).__name__}")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s grads by the scale and check them for inf/NaN, as GradScaler does.

        Afterwards ``param.grad`` holds the true gradients, and what user code does to them is what
        ``step`` applies. For amp_fx optimizers an fp16/bf16 grad becomes an FP32 tensor (until
        ``zero_grad``) and an overflow still skips the step on the device; other optimizers' grads
        are divided in place (fp16 grads refused, as by GradScaler). Call it at most once per
        optimizer between ``update()`` calls; for clipping alone, ``amp_fx.clip_grad_norm_`` is
        faster (the grads stay scaled). ``optimizer`` may be a wrapper holding it at ``.optimizer``.

        Example:
            >>> import torch, amp_fx
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
            >>> opt, scaler = amp_fx.optim.FusedAdam([w]), amp_fx.LossScaler(init_scale=1024.0)
            >>> scaler.scale(w.float().sum()).backward(); scaler.unscale_(opt)
            >>> w.grad  # the true gradient, in FP32
            tensor([1., 1.])
            >>> torch.nn.utils.clip_grad_norm_([w], max_norm=1.0)
            tensor(1.4142)
        """
        if not self._enabled:
            return
        self._require_state("unscale_")
        optimizer = unwrap_optimizer(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state.check_unscale()
        if isinstance(optimizer, ScaledOptimizer):
            # Checked (and 1/scale made pending) unless amp_fx.clip_grad_norm_ did it already; the
            # multiplier, with any clip folded into it, is then written into the grads.
            self.defer_unscale_(optimizer)
            optimizer.apply_grad_multiplier_()
        else:
            # GradScaler's fp64 reciprocal, written by the last update (or scale change); read-only here.
            found_infs = unscale_grads_in_place_(optimizer, self._tensors.inv_scale, allow_fp16=False)
            agree_on_overflow_(found_infs, self._process_group)
            state.found_inf_per_device, state.optimizer = found_infs, optimizer
        state.stage = Stage.UNSCALED

    def defer_unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer``'s grads for inf/NaN and leave them scaled: ``1 / scale`` becomes a
        pending multiplier that the optimizer's kernel applies (the fast path; no host sync).

        `amp_fx.clip_grad_norm_` calls it; ``step`` calls it when nothing did. Does nothing once the
        grads were checked this iteration. For an optimizer that is no amp_fx optimizer it is
        ``unscale_`` (its grads are divided in place).

        Example:
            >>> import torch, amp_fx
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
            >>> opt, scaler = amp_fx.optim.FusedSGD([w]), amp_fx.LossScaler(init_scale=1024.0)
            >>> scaler.scale(w.float().sum()).backward(); scaler.defer_unscale_(opt)
            >>> w.grad  # still scaled: the kernel multiplies by 1 / 1024 as it reads it
            tensor([1024., 1024.], dtype=torch.float16)
        """
        if not self._enabled:
            return
        self._require_state("defer_unscale_")
        optimizer = unwrap_optimizer(optimizer)
        if not isinstance(optimizer, ScaledOptimizer):
            if self._per_optimizer_states[id(optimizer)].stage is Stage.READY:
                self.unscale_(optimizer)
            return
        state = self._per_optimizer_states[id(optimizer)]
        if state.stage is not Stage.READY:
            return
        found_infs = optimizer.unscale_grads_(self._tensors.inv_scale)
        agree_on_overflow_(found_infs, self._process_group)
        state.stage, state.found_inf_per_device, state.optimizer = Stage.DEFERRED, found_infs, optimizer

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless ``unscale_`` ran) and step ``optimizer``, skipping the update on inf/NaN grads.

        Returns what ``optimizer.step`` returns. For amp_fx optimizers the skip is decided on the
        device inside the kernel; for others it reads found_inf on the host, as GradScaler does.
        Closures are not supported (as in GradScaler). A wrapper (``.optimizer``) steps the
        optimizer inside it.
        """
        optimizer = unwrap_optimizer(optimizer)
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError(
                "LossScaler.step does not take a closure (nor does GradScaler); run the forward and backward "
                "yourself, then call scaler.step(optimizer)"
            )
        scale = self._require_state("step")
        state = self._per_optimizer_states[id(optimizer)]
        state.check_step()
        note_stepped(self, optimizer)

        if isinstance(optimizer, ScaledOptimizer):
            self.defer_unscale_(optimizer)
            state.require_inf_checks()
            result = optimizer.step(**kwargs)
        elif reads_found_inf(optimizer):
            result = self._step_torch_fused(optimizer, state, scale, kwargs)
        else:
            if state.stage is Stage.READY:
                self.unscale_(optimizer)
            state.require_inf_checks()
            # The GradScaler path for torch.optim optimizers: a host sync, by design of that protocol.
            found = any_overflow_on_host(state.found_inf_per_device)
            result = optimizer.step(**kwargs) if not found else None
        state.stage = Stage.STEPPED
        return result

    def _step_torch_fused(
        self, optimizer: torch.optim.Optimizer, state: OptimizerRecord, scale: Tensor, kwargs: dict[str, Any]
    ) -> Any:
        """GradScaler's protocol for optimizers that unscale in their own kernel (torch's fused Adam)."""
        if state.stage is Stage.READY:
            dummy_inv_scale = torch.ones((), dtype=torch.float32, device=scale.device)
            infs = unscale_grads_in_place_(optimizer, dummy_inv_scale, allow_fp16=True)
            agree_on_overflow_(infs, self._process_group)
            state.found_inf_per_device, state.optimizer = infs, optimizer
        state.require_inf_checks()
        found_inf = total_found_inf(state.found_inf_per_device, scale.device)
        # As GradScaler: after unscale_ the grads are already unscaled; otherwise hand over the scale
        # (times any grad_scale the user set).
        grad_scale = getattr(optimizer, "grad_scale", None)
        if state.stage is not Stage.UNSCALED:
            grad_scale = scale if grad_scale is None else scale * grad_scale
        return step_reading_found_inf(
            optimizer, lambda: optimizer.step(**kwargs), found_inf, grad_scale=grad_scale
        )

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Update the scale from this iteration's overflow checks (or set it to ``new_scale``).

        All device ops, no host sync. Call once per iteration, after ``step`` for every optimizer.

        Example:
            >>> import torch, amp_fx
            >>> w = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
            >>> opt, scaler = amp_fx.optim.FusedSGD([w]), amp_fx.LossScaler(init_scale=4.0)
            >>> scaler.scale(w.float().sum() * float("inf")).backward()
            >>> scaler.step(opt); scaler.update(); scaler.get_scale()
            2.0
        """
        if not self._enabled:
            return
        scale = self._require_state("update")
        found_infs: list[Tensor] = []
        if new_scale is not None:
            self._tensors.set_scale(new_scale)
        else:
            found_infs = [
                found_inf.to(scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state.found_inf_per_device.values()
            ]
            if not found_infs:
                raise RuntimeError(
                    "no inf checks were recorded before update(); call scaler.step(optimizer) (or "
                    "scaler.unscale_(optimizer)) first in each iteration"
                )
            # The kernel zeroes the flags it read: the fused optimizers' flags are persistent
            # buffers, which their next unscale_ then reuses without a fill of its own.
            self.update_from_found_infs(found_infs, zero_found_infs=True)
        for state in self._per_optimizer_states.values():
            if isinstance(state.optimizer, ScaledOptimizer):
                state.optimizer.finish_scaling(zeroed_found_infs=found_infs)
        self._per_optimizer_states = defaultdict(OptimizerRecord)
        note_updated(self)

    def update_from_found_infs(
        self, found_infs: Tensor | Sequence[Tensor], *, zero_found_infs: bool = False
    ) -> None:
        """Apply the scale rule (class docstring) to overflow flags the caller collected itself, in
        one kernel launch on the device (`amp_fx.training.loss_scale_tensors`).

        ``update()`` calls it with this iteration's flags; `amp_fx.amp`, with one flag per loss.
        ``zero_found_infs`` sets the flags to 0 after reading them (a `ScaledOptimizer`'s
        persistent flags then need no fill before their next use). A no-op when disabled.

        Example:
            >>> import torch
            >>> scaler = LossScaler(init_scale=8.0)
            >>> _ = scaler.scale(torch.tensor(1.0))
            >>> scaler.update_from_found_infs(torch.ones(1)); scaler.get_scale()
            4.0
        """
        if not self._enabled:
            return
        self._require_state("update_from_found_infs")
        note_updated(self)
        flags = [found_infs] if isinstance(found_infs, Tensor) else found_infs
        self._tensors.update(flags, self._settings, zero_found_infs=zero_found_infs)

    # ----------------------------------------------------------------------------------------
    # Getters and setters (GradScaler's, and those of the settings GradScaler lacks)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Reads the device: a host sync."""
        if not self._enabled:
            return 1.0
        return self._tensors.scale_value()

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._tensors.growth_value()

    def _get_hysteresis_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._tensors.hysteresis_value()

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps."""
        return self._settings.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._settings = replace(self._settings, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by on overflow."""
        return self._settings.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._settings = replace(self._settings, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The number of consecutive clean steps before the scale grows."""
        return self._settings.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1).

        Example:
            >>> scaler = LossScaler(growth_interval=100)
            >>> scaler.set_growth_interval(0)
            Traceback (most recent call last):
            ...
            ValueError: growth_interval must be an int in [1, 2**31 - 1] (the trackers are int32), got 0
            >>> scaler.get_growth_interval()  # a refused value changes nothing
            100
        """
        self._settings = replace(self._settings, growth_interval=new_interval)

    def get_hysteresis(self) -> int:
        """The number of consecutive overflowing steps before the scale backs off."""
        return self._settings.hysteresis

    def get_min_scale(self) -> float | None:
        """The lower bound of the scale (None: unbounded)."""
        return self._settings.min_scale

    def get_max_scale(self) -> float | None:
        """The upper bound of the scale (None: unbounded)."""
        return self._settings.max_scale

    def scale_tensor(self) -> Tensor | None:
        """The current scale as a tensor on the device, for logging without a host read (None
        before the first `scale`, or when disabled); `get_scale` reads it to the host.

        >>> LossScaler(enabled=False).scale_tensor() is None
        True
        """
        return self._tensors.scale

    # GradScaler's name for the same, which code written for GradScaler calls.
    _get_scale_async = scale_tensor

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        return self._per_optimizer_states[id(unwrap_optimizer(optimizer))].found_inf_per_device

    def is_enabled(self) -> bool:
        """False when the scaler was created with ``enabled=False`` (a pass-through)."""
        return self._enabled

    # ----------------------------------------------------------------------------------------
    # Checkpoints and pickling

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers (empty when disabled): GradScaler's five keys
        and ours (`amp_fx.training.loss_scale_checkpoint` lists them). Reads the device (a host
        sync): call it after ``update()``.

        Example:
            >>> from amp_fx import LossScaler
            >>> LossScaler(init_scale=1024.0).state_dict()["scale"]
            1024.0
        """
        if not self._enabled:
            return {}
        state = ScalerState(
            self._settings, self.get_scale(), self._get_growth_tracker(), self._get_hysteresis_tracker()
        )
        return state_dict_of(state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` (or from torch.amp.GradScaler's); no-op when disabled.

        Every value is checked before anything changes. Keys GradScaler does not write
        (hysteresis, bounds) keep their current values when absent.

        Example:
            >>> scaler, other = LossScaler(init_scale=1024.0, hysteresis=2), LossScaler()
            >>> other.load_state_dict(scaler.state_dict())
            >>> other.get_scale(), other.get_hysteresis()
            (1024.0, 2)
        """
        if not self._enabled:
            return
        state = read_state_dict(state_dict, self._settings)
        self._settings = state.settings
        self._tensors.load(state.scale, state.growth_tracker, state.hysteresis_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled and self._per_optimizer_states:
            raise RuntimeError(
                "a LossScaler may only be pickled at the start of an iteration or after scaler.update()"
            )
        # Device tensors are re-created lazily after unpickling, on the device of the first scaled loss.
        state["_tensors"] = self._tensors.on_host()
        state["_per_optimizer_states"] = {}
        state["_process_group"] = None  # process groups do not pickle: a copy agrees over the default group
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(upgraded_pickle(state))
        self._per_optimizer_states = defaultdict(OptimizerRecord)
