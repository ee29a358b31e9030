"""FUSED: amp for `amp_fx.optim.FusedAdam` / `FusedSGD`, through the `ScaledOptimizer` handshake."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp import _grads
from amp_fx.amp._amp_optimizer import AmpOptimizer, OptimizerKind, new_master
from amp_fx.optim.fused_optimizer import MASTER_KEY, master_params
from amp_fx.optim.model_load_hooks import track_params
from amp_fx.optim.scaled_optimizer import ScaledOptimizer
from amp_fx.optim.torch_optimizer_scaling import FoundInf


class FusedAmpOptimizer(AmpOptimizer):
    """FUSED: `amp_fx.optim.FusedAdam` / `FusedSGD`, the fast path, through the `ScaledOptimizer` handshake.

    The optimizer keeps the FP32 masters in its own state and takes the loss scale as a pending
    grad multiplier: the model grads stay scaled, its kernel unscales, checks and skips on the
    device, and no step syncs.
    """

    kind = OptimizerKind.FUSED

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor], session: Any = None
    ) -> None:
        super().__init__(optimizer, param_map, session)
        self.scaled: ScaledOptimizer = optimizer
        # The scale the model grads carry (None: unscaled), and that of the stashed ones.
        self.grad_scale: Tensor | None = None
        self.stash_scale: Tensor | None = None
        # Grad multiplier per device used when amp.master_params handed out FP32 grads.
        self.materialized: dict[torch.device, Tensor | None] | None = None

    def _adopt_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        master_weights: bool | None,
    ) -> list[Tensor]:
        """Masters from the FP32 originals (exact) for the now low-precision params; the optimizer
        tracks the params, so it adopts masters for those stored low later (`masters_for_stored_low`)."""
        self._rekey_state(originals, mapped)
        track_params(self.optimizer, mapped)
        if master_weights is not None:
            group["master_weights"] = bool(master_weights)
            self.optimizer.defaults["master_weights"] = bool(master_weights)
        state = self.optimizer.state
        for original, param in zip(originals, mapped, strict=True):
            entry = state[param]
            if self.optimizer._master_expected(param, group):
                if MASTER_KEY not in entry:
                    entry[MASTER_KEY] = new_master(param, original).requires_grad_(False)
            else:
                entry.pop(MASTER_KEY, None)
        return mapped

    # ------------------------------------------------------------------------------------------
    # Masters and their FP32 grads
    def _params_and_masters(self) -> list[tuple[Tensor, Tensor]]:
        """(model parameter, its FP32 master or itself when it has none), in param-group order."""
        return list(zip(self.params(), master_params(self.optimizer), strict=True))

    def masters_by_param(self) -> dict[int, Tensor]:
        return self.optimizer.masters_by_param()

    def master_params(self) -> Iterator[Tensor]:
        """The FP32 masters (the params without one themselves), with unscaled grads.

        Hands out FP32 copies of the unscaled grads as the masters' ``.grad`` (so
        ``torch.nn.utils.clip_grad_norm_(amp.master_params(opt), ...)`` works as in Apex); the
        next ``step`` folds whatever was done to them back into the model grads.
        """
        self._materialize_master_grads()
        yield from master_params(self.optimizer)

    def _materialize_master_grads(self) -> None:
        if self.materialized is not None:
            return
        pairs = [(p, master) for p, master in self._params_and_masters() if p.grad is not None]
        multipliers: dict[torch.device, Tensor | None] = {}
        for device in dict.fromkeys(p.grad.device for p, _ in pairs):
            pending = self.scaled.pending_scaling(device)[0]
            multipliers[device] = None if pending is None else pending.reshape(())
        with torch.no_grad():
            _grads.mul_([p.grad for p, master in pairs if master is p], multipliers)
            mastered = [(p, master) for p, master in pairs if master is not p]
            grads = _grads.converted([p.grad for p, _ in mastered], torch.float32)
            _grads.mul_(grads, multipliers)
            for (_, master), grad in zip(mastered, grads, strict=True):
                master.grad = grad
        self.materialized = multipliers

    def _write_back_master_grads(self) -> None:
        """Undo `_materialize_master_grads`: the (maybe clipped) FP32 grads, scaled, into the model grads."""
        multipliers, self.materialized = self.materialized, None
        if multipliers is None:
            return
        with torch.no_grad():
            pairs = [(p, master) for p, master in self._params_and_masters() if p.grad is not None]
            _grads.div_([p.grad for p, master in pairs if master is p], multipliers)
            mastered = [(p, master) for p, master in pairs if master is not p and master.grad is not None]
            values = _grads.divided([master.grad for _, master in mastered], multipliers)
            _grads.copy_([p.grad for p, _ in mastered], values)
            for _, master in mastered:
                master.grad = None

    # ------------------------------------------------------------------------------------------
    # Around a backward
    def _stash_grads(self) -> None:
        self._write_back_master_grads()
        self._take_grads_aside(self.params())
        self.stash_scale = self.grad_scale

    def _finish_backward(self, inv_scale: Tensor, used_scale: Tensor, found: FoundInf) -> None:
        stashed, self.stashed = self.stashed, []
        if not stashed:
            self.grad_scale = used_scale
            found.update(self.scaled.unscale_grads_(inv_scale))
            return
        # Grads of an earlier backward at another scale: bring both to the smaller scale, in FP32,
        # so neither overflows. This loss's flags come from its own grads only.
        _grads.check_finite([p.grad for p in self.params() if p.grad is not None], found)
        carried = self.stash_scale if self.stash_scale is not None else torch.ones_like(used_scale)
        common = torch.minimum(used_scale, carried.to(used_scale.device))
        new_factor, old_factor = common / used_scale, common / carried.to(used_scale.device)
        # combined = old * old_factor + new * new_factor in FP32, then in the parameter's dtype.
        combined = _grads.converted([old for _, old in stashed], torch.float32, copy=True)
        _grads.mul_(combined, old_factor)
        both = [i for i, (param, _) in enumerate(stashed) if param.grad is not None]
        new = _grads.converted([stashed[i][0].grad for i in both], torch.float32, copy=True)
        _grads.mul_(new, new_factor)
        _grads.add_([combined[i] for i in both], new)
        rounded = _grads.converted(combined, [param.dtype for param, _ in stashed])
        for (param, _), grad in zip(stashed, rounded, strict=True):
            param.grad = grad
        stashed_ids = {id(p) for p, _ in stashed}
        _grads.mul_(
            [p.grad for p in self.params() if p.grad is not None and id(p) not in stashed_ids], new_factor
        )
        self.grad_scale = common
        self.stash_scale = None
        # Checks the combined grads (an overflowed earlier loss is still inf in them) for the step.
        self.scaled.unscale_grads_(common.double().reciprocal().float())

    # ------------------------------------------------------------------------------------------
    # The patched methods
    def _step(self, original_step: Callable[..., Any], closure: Callable[[], Any] | None) -> Any:
        self._write_back_master_grads()
        return original_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.scaled.finish_scaling()
        for param, master in self._params_and_masters():
            if master is not param:
                master.grad = None
        self.grad_scale = self.stash_scale = None

    def zero_pending(self) -> None:
        super().zero_pending()
        self.materialized = None

    def _add_param_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        add: Callable[[dict[str, Any]], None],
    ) -> None:
        # Masters from the FP32 originals where the caller passed those, before the optimizer
        # would make them from the rounded parameters.
        merged = {**self.optimizer.defaults, **group}  # the group as the optimizer will complete it
        state = self.optimizer.state
        added = [
            (original, param)
            for original, param in zip(originals, mapped, strict=True)
            if self.optimizer._master_expected(param, merged) and param not in state
        ]
        with torch.no_grad():
            for original, param in added:
                state[param][MASTER_KEY] = new_master(param, original).requires_grad_(False)
        try:
            add({**group, "params": mapped})
        except Exception:
            for _, param in added:  # a refused group leaves the optimizer as it was
                state.pop(param, None)
            raise
