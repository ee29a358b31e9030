"""DIRECT: amp for a torch.optim optimizer that updates the model's own parameters (O0, O1, O3).

Grads are unscaled in place after each backward, with `amp_fx.LossScaler`'s code
(`amp_fx.optim.torch_optimizer_scaling`), and the step is skipped on the overflow flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp import _grads
from amp_fx.amp._amp_optimizer import AmpOptimizer, OptimizerKind
from amp_fx.optim.torch_optimizer_scaling import (
    FoundInf,
    any_overflow_on_host,
    reads_found_inf,
    step_reading_found_inf,
    total_found_inf,
)


class DirectAmpOptimizer(AmpOptimizer):
    """DIRECT: a torch.optim optimizer without master weights (O0, O1, O3) updates the model's params.

    After each backward the new grads are unscaled in place and added to the earlier ones; the
    step is skipped on the overflow flags of all backwards since the last step (on the device for
    optimizers that read ``found_inf``, else on the host).
    """

    kind = OptimizerKind.DIRECT
    accepts_closure = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor], session: Any = None
    ) -> None:
        super().__init__(optimizer, param_map, session)
        # Overflow flags of the backwards since the last step.
        self.found: FoundInf = {}

    def _adopt_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        master_weights: bool | None,
    ) -> list[Tensor]:
        self._rekey_state(originals, mapped, follow_dtype=True)
        return mapped

    def _direct_params(self) -> list[Tensor]:
        """The model parameters the wrapped optimizer updates itself."""
        return self.params()

    def _stash_grads(self) -> None:
        self._take_grads_aside(self._direct_params())

    def _finish_backward(self, inv_scale: Tensor, used_scale: Tensor, found: FoundInf) -> None:
        self._unscale_new_grads(inv_scale, found)
        for device, flag in found.items():
            current = self.found.get(device)
            self.found[device] = flag.clone() if current is None else current + flag

    def _unscale_new_grads(self, inv_scale: Tensor, found: FoundInf) -> None:
        direct = [p for p in self._direct_params() if p.grad is not None]
        _grads.unscale_and_check_([p.grad for p in direct], inv_scale, found)
        self._add_back_stashed()

    def _add_back_stashed(self) -> None:
        stashed, self.stashed = self.stashed, []
        both = [(p.grad, old) for p, old in stashed if p.grad is not None]
        for param, old in stashed:
            if param.grad is None:
                param.grad = old
        if both:
            _grads.add_([new for new, _ in both], [old for _, old in both])

    def _step(self, original_step: Callable[..., Any], closure: Callable[[], Any] | None) -> Any:
        found, self.found = self.found, {}
        stepped, result = self._guarded_step(original_step, closure, found)
        self._stepped(stepped)
        return result

    def _stepped(self, stepped: bool) -> None:
        """After the wrapped step (`stepped`: it ran, or may have, on the device)."""

    def _guarded_step(self, original_step: Any, closure: Any, found: FoundInf) -> tuple[bool, Any]:
        """Step unless `found` flags an overflow. (stepped or maybe-stepped, result)."""
        if not found:
            return True, original_step(closure)
        if reads_found_inf(self.optimizer):
            params = self.optimizer.param_groups[0]["params"]
            device = params[0].device if params else next(iter(found))
            # torch's fused optimizers take GradScaler's 0-dim flag.
            found_inf = total_found_inf(found, device).reshape(())
            return True, step_reading_found_inf(self.optimizer, lambda: original_step(closure), found_inf)
        if any_overflow_on_host(found):
            if self.session is not None:
                self.session.log_overflows()
            return False, None
        return True, original_step(closure)

    def zero_pending(self) -> None:
        super().zero_pending()
        self.found = {}
