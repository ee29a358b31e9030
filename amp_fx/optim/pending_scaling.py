"""The loss scaling a fused optimizer's next step applies, per device (the `ScaledOptimizer` handshake).

`amp_fx.optim.scaled_optimizer` describes the handshake; a `PendingScaling` is what a
`amp_fx.optim.fused_optimizer.FusedOptimizer` records of it: per device, a grad multiplier
(``1 / scale``, times a clip coefficient folded in) and an overflow flag, both device tensors, never
read on the host. The flag of each device is a persistent buffer, so that a step allocates and
fills none: the LossScaler's update kernel zeroes it after reading it and says so (`finish`).

    >>> import torch
    >>> pending = PendingScaling()
    >>> cpu = torch.device("cpu")
    >>> flags = pending.check({cpu: [torch.tensor([1.0, float("inf")])]}, torch.tensor(0.5))
    >>> pending.multipliers[cpu], flags[cpu] > 0
    (tensor([0.5000]), tensor([True]))
    >>> pending.fold([cpu], torch.tensor(0.5)); pending.multipliers[cpu]
    tensor([0.2500])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from amp_fx.kernels import implementation_for

__all__ = ["PendingScaling"]


class PendingScaling:
    """Per device: the pending grad multiplier and overflow flag (``multipliers``, ``found_infs``;
    set by `check` and `fold`, applied by the next step), and the persistent flag buffers."""

    def __init__(self) -> None:
        self.multipliers: dict[torch.device, Tensor] = {}
        self.found_infs: dict[torch.device, Tensor] = {}
        # One persistent overflow flag per device, and the devices whose flag is known to hold 0.
        self.flags: dict[torch.device, Tensor] = {}
        self._zeroed: set[torch.device] = set()

    def forget(self) -> None:
        """Forget the pending multipliers and flags (the flag buffers stay)."""
        self.multipliers = {}
        self.found_infs = {}

    def _flag(self, device: torch.device) -> Tensor:
        """This step's overflow flag on ``device`` (float32, shape (1,)), holding 0.

        Zeroed here only when nothing is known to have zeroed it since it was last handed out (the
        first step, an update(new_scale), amp_fx.amp's scaler, a step abandoned half-way).
        """
        buffer = self.flags.get(device)
        if buffer is None:
            buffer = self.flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
        elif device not in self._zeroed:
            buffer.zero_()
        self._zeroed.discard(device)
        return buffer

    def check(
        self, grads_by_device: dict[torch.device, list[Tensor]], inv_scale: Tensor
    ) -> dict[torch.device, Tensor]:
        """Record ``inv_scale`` as the pending multiplier of each device of ``grads_by_device``, in
        place of any earlier one, and check those grads for inf/NaN into the device's flag; returns
        the flags."""
        self.forget()
        for device, grads in grads_by_device.items():
            found_inf = self._flag(device)
            implementation_for(grads).check_finite_and_norm_(grads, found_inf)
            self.found_infs[device] = found_inf
            self.multipliers[device] = inv_scale.to(device, non_blocking=True).reshape(1)
        return dict(self.found_infs)

    def fold(self, devices: Iterable[torch.device], factor: Tensor) -> None:
        """Multiply the pending multiplier of each of ``devices`` by ``factor`` (a device tensor; a
        device without a multiplier gets ``factor`` itself)."""
        for device in devices:
            local = factor.to(device, non_blocking=True).reshape(1)
            current = self.multipliers.get(device)
            self.multipliers[device] = local if current is None else current * local

    def finish(self, zeroed_found_infs: Sequence[Tensor] = ()) -> None:
        """Forget what is pending; note which flag buffers are among ``zeroed_found_infs`` (set to 0
        on the device by LossScaler.update), so that the next `check` need not zero them."""
        for device, buffer in self.flags.items():
            if any(flag is buffer for flag in zeroed_found_infs):
                self._zeroed.add(device)
        self.forget()

    def for_step(
        self, device: torch.device, grad_scale: Tensor | None, torch_found_inf: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """The (grad_multiplier, found_inf) that a step applies on ``device``: the pending ones
        (LossScaler, clip_grad_norm_) combined with the ``grad_scale``/``found_inf`` that
        torch.amp.GradScaler sets on the optimizer; all device arithmetic."""
        multiplier, found_inf = self.multipliers.get(device), self.found_infs.get(device)
        if grad_scale is not None:
            # GradScaler passes the scale itself; like GradScaler.unscale_, take the reciprocal in fp64.
            inv_scale = grad_scale.to(device, non_blocking=True).double().reciprocal().float().reshape(1)
            multiplier = inv_scale if multiplier is None else multiplier * inv_scale
        if torch_found_inf is not None:
            local = torch_found_inf.to(device, torch.float32, non_blocking=True).reshape(1)
            found_inf = local if found_inf is None else found_inf + local
        return multiplier, found_inf
