"""MASTERS: amp for a torch.optim optimizer stepping FP32 master weights (O2).

The masters' state dict entry (``MASTERS_KEY``) lets a resumed run continue bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp import _grads
from amp_fx.amp._amp_optimizer import MASTERS_KEY, OptimizerKind, new_master
from amp_fx.amp._direct_optimizer import DirectAmpOptimizer
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.optim.model_load_hooks import track_params
from amp_fx.optim.torch_optimizer_scaling import FoundInf

logger = logging.getLogger("amp_fx.amp")


class MasterWeightsAmpOptimizer(DirectAmpOptimizer):
    """MASTERS: any other torch.optim optimizer when the opt level asks for master weights (O2).

    Its param groups hold FP32 masters in place of the model's low-precision params (FP32 params
    stay themselves and are handled as by `DirectAmpOptimizer`). After each backward the
    low-precision grads are unscaled into the masters' FP32 grads (so grads of several losses with
    different scales add up exactly, as in Apex); ``step`` updates the masters and copies them
    back into the model. Its state dict carries the masters under ``MASTERS_KEY``. A parameter the
    torch.export front end stores low only at the model's first call gets its master then
    (`adopt_master`).
    """

    kind = OptimizerKind.MASTERS
    accepts_closure = False

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor], session: Any = None
    ) -> None:
        super().__init__(optimizer, param_map, session)
        # (model parameter, the tensor the optimizer updates) in param-group order; the second is an
        # FP32 master for low-precision parameters and the parameter itself otherwise.
        self.pairs: list[tuple[Tensor, Tensor]] = []

    def _targets(self, originals: list[Tensor], mapped: list[Tensor]) -> list[Tensor]:
        """FP32 masters for the low-precision params (from their FP32 originals), the others as they are."""
        return [
            new_master(p, o) if p.dtype in LOW_PRECISION_DTYPES else p
            for p, o in zip(mapped, originals, strict=True)
        ]

    def _adopt_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        master_weights: bool | None,
    ) -> list[Tensor]:
        targets = self._targets(originals, mapped)
        self.pairs.extend(zip(mapped, targets, strict=True))
        self._rekey_state(originals, targets)
        track_params(self, mapped)
        return targets

    def adopt_master(self, param: Tensor, value: Tensor) -> Callable[[], None] | None:
        """Step an FP32 master in place of ``param``, stepped itself until the torch.export front end
        stored it low (at the model's first call): the master is ``value``, its exact FP32 value, and
        takes over its optimizer state and its (unscaled) grad. Returns what takes it back; None
        where ``param`` is not one of this optimizer's FP32-stepped params or is not low now
        (`amp_fx.optim.model_load_hooks.masters_for_stored_low` calls it)."""
        index = next((i for i, (p, target) in enumerate(self.pairs) if p is param and target is p), None)
        if index is None or param.dtype not in LOW_PRECISION_DTYPES:
            return None
        grad = param.grad
        with torch.no_grad():
            master = new_master(param, value)
        if grad is not None:  # a direct param's grad is unscaled already: the master's from now on
            master.grad, param.grad = grad.to(torch.float32), None
        take_back = self._step_instead(index, param, param, master)

        def undo() -> None:
            take_back()
            param.grad = grad

        return undo

    def _step_instead(
        self, index: int, param: Tensor, stepped: Tensor, instead: Tensor
    ) -> Callable[[], None]:
        """Have the optimizer step ``instead`` where it steps ``stepped`` (its slot in its group and
        its state), paired with ``param`` at ``self.pairs[index]``; returns what takes it back."""
        group = next(g for g in self.optimizer.param_groups if any(p is stepped for p in g["params"]))
        position = next(i for i, p in enumerate(group["params"]) if p is stepped)
        state = self.optimizer.state
        if stepped in state:
            state[instead] = state.pop(stepped)
        group["params"][position] = instead
        self.pairs[index] = (param, instead)

        def undo() -> None:
            if instead in state:
                state[stepped] = state.pop(instead)
            group["params"][position] = stepped
            self.pairs[index] = (param, stepped)

        return undo

    def release_master(self, param: Tensor) -> tuple[Tensor, Callable[[], None]] | None:
        """Step ``param`` itself, stored FP32 from now on (the torch.export front end's first graph
        decided so), in place of its master, which it takes the value, optimizer state and grad of
        (the caller sets the value); returns the master and what takes it back, None where
        ``param`` has no master here (`amp_fx.optim.model_load_hooks.masters_for_stored_fp32`)."""
        index = next((i for i, (p, target) in enumerate(self.pairs) if p is param and target is not p), None)
        if index is None:
            return None
        master, grad = self.pairs[index][1], param.grad
        if master.grad is not None:
            param.grad = master.grad
        take_back = self._step_instead(index, param, master, param)

        def undo() -> None:
            take_back()
            param.grad = grad

        return master, undo

    def _master_pairs(self) -> list[tuple[Tensor, Tensor]]:
        return [(p, target) for p, target in self.pairs if target is not p]

    def params(self) -> list[Tensor]:
        return [p for p, _ in self.pairs]

    def _direct_params(self) -> list[Tensor]:
        return [p for p, target in self.pairs if target is p]

    def masters_by_param(self) -> dict[int, Tensor]:
        return {id(p): master for p, master in self._master_pairs()}

    def _stash_grads(self) -> None:
        super()._stash_grads()
        for param, _ in self._master_pairs():
            # Its previous grads were unscaled into the master's at the end of their backward.
            param.grad = None

    def _unscale_new_grads(self, inv_scale: Tensor, found: FoundInf) -> None:
        super()._unscale_new_grads(inv_scale, found)
        pairs = [(p, master) for p, master in self._master_pairs() if p.grad is not None]
        if not pairs:
            return
        new_grads = _grads.converted([p.grad for p, _ in pairs], torch.float32)
        _grads.unscale_and_check_(new_grads, inv_scale, found)
        existing = [
            (master.grad, grad)
            for (_, master), grad in zip(pairs, new_grads, strict=True)
            if master.grad is not None
        ]
        for (_, master), grad in zip(pairs, new_grads, strict=True):
            if master.grad is None:
                master.grad = grad
        if existing:
            _grads.add_([target for target, _ in existing], [source for _, source in existing])

    def _stepped(self, stepped: bool) -> None:
        pairs = self._master_pairs()
        if stepped and pairs:
            with torch.no_grad():
                _grads.copy_([p for p, _ in pairs], [master for _, master in pairs])
        for _, master in pairs:
            master.grad = None  # as Apex: a master's grad lives for one step

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        # The model's low-precision params, whose grads the wrapped optimizer (on the masters) never sees.
        for param, _ in self._master_pairs():
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state[MASTERS_KEY] = [master if master is not p else None for p, master in self.pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict_type(state_dict)
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTERS_KEY, None)
        if saved is not None:
            self._check_saved_masters(saved)
        self._load_wrapped_state_dict(state_dict)
        if saved is None:
            logger.info(
                "the optimizer state dict has no FP32 master weights (not saved by amp_fx): the masters keep "
                "their current values, copied from the model"
            )
        else:
            with torch.no_grad():
                for (_, master), value in zip(self.pairs, saved, strict=True):
                    if value is not None:  # an FP32 parameter is its own master
                        master.copy_(value)
        self.zero_pending()

    def _check_saved_masters(self, saved: Any) -> None:
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.pairs):
            count = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            raise ValueError(
                f"the state dict's {MASTERS_KEY!r} holds {count} entries but the optimizer has "
                f"{len(self.pairs)} parameters; load a state dict saved from this model and optimizer"
            )
        for index, ((param, master), value) in enumerate(zip(self.pairs, saved, strict=True)):
            # A master saved for a parameter that is FP32 here loads into it, as into any master: the
            # torch.export front end stores some parameters low only at the model's first call.
            if master is param and value is None:
                continue
            if not isinstance(value, Tensor) or value.shape != master.shape or not value.is_floating_point():
                got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"the state dict's master weight {index} must be a floating tensor of shape "
                    f"{tuple(master.shape)}, got {got}; was it saved from another model or opt level?"
                )

    def _add_param_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        add: Callable[[dict[str, Any]], None],
    ) -> None:
        with torch.no_grad():
            targets = self._targets(originals, mapped)
        add({**group, "params": targets})
        self.pairs.extend(zip(mapped, targets, strict=True))
        track_params(self, mapped)
