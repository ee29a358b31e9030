"""`AcceleratorScaler`: an `amp_fx.LossScaler` where accelerate keeps its ``torch.amp.GradScaler``.

``Trainer(fp16=True)`` trains through accelerate's ``Accelerator.scaler``: ``accelerator.backward``
scales the loss with it, the prepared optimizer's ``step`` calls ``scaler.step(optimizer)`` and
``scaler.update()``, and the Trainer saves and restores its ``state_dict`` as ``scaler.pt`` in each
checkpoint. `AmpTrainer` puts this adapter there instead (with accelerate's own mixed precision
off), so the Trainer's fp16 path runs with amp_fx's scaler: the optimizer's kernel unscales and
skips an overflowing step on the device, no host read per step, and the skipped steps are counted
on the device as well (in ``step``: once per step, whatever unscaled before), read only when
logged or saved.

    >>> import torch, amp_fx
    >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    >>> opt = amp_fx.optim.FusedSGD([w], lr=0.1)
    >>> scaler = AcceleratorScaler(amp_fx.LossScaler(init_scale=4.0))
    >>> scaler.scale((w.float() * float("inf")).sum()).backward()
    >>> scaler.unscale_(opt); scaler.step(opt); scaler.update()
    >>> scaler.skipped_steps, scaler.get_scale(), w.detach()
    (1, 2.0, tensor([1., 1.], dtype=torch.float16))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import amp_fx
from amp_fx.optim.scaled_optimizer import ScaledOptimizer
from amp_fx.optim.wrappers import unwrap_optimizer

SKIPPED_KEY = "skipped_steps"


class AcceleratorScaler:
    """GradScaler's methods as accelerate and the Trainer call them, on an `amp_fx.LossScaler`."""

    def __init__(self, loss_scaler: amp_fx.LossScaler) -> None:
        self.loss_scaler = loss_scaler
        # Steps skipped on overflow: a device counter once a step was checked, else the loaded count.
        self._skipped: Tensor | None = None
        self._skipped_loaded = 0

    def scale(self, outputs: Any) -> Any:
        return self.loss_scaler.scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """`amp_fx.LossScaler.unscale_`: the grads become the true ones, for accelerate's torch clipping."""
        self.loss_scaler.unscale_(optimizer)

    def defer_unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """`amp_fx.LossScaler.defer_unscale_`: the fast path, the kernel unscales."""
        self.loss_scaler.defer_unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
        """`amp_fx.LossScaler.step`, this step's overflow counted on the device first: once per step,
        whichever of ``unscale_`` / ``defer_unscale_`` ran before, if any."""
        # accelerate passes its closure positionally; LossScaler.step, as GradScaler's, takes none.
        if closure is not None:
            raise RuntimeError("a loss-scaled step takes no closure (nor does torch.amp.GradScaler's)")
        if self.loss_scaler.is_enabled():
            self.loss_scaler.defer_unscale_(optimizer)  # the check, unless an unscale ran: nothing twice
            self._count_overflow(optimizer)
        return self.loss_scaler.step(optimizer)

    def _count_overflow(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer = unwrap_optimizer(optimizer)
        if not isinstance(optimizer, ScaledOptimizer):
            return
        flags = [
            flag
            for device in optimizer.grads_by_device()
            if (flag := optimizer.pending_scaling(device)[1]) is not None
        ]
        if not flags:
            return
        home = flags[0].device
        overflow = torch.stack([flag.to(home, non_blocking=True).max() for flag in flags]).max() > 0
        if self._skipped is None:
            self._skipped = torch.full((), self._skipped_loaded, dtype=torch.int64, device=home)
        self._skipped.add_(overflow.to(self._skipped.device, non_blocking=True))

    def update(self, new_scale: float | Tensor | None = None) -> None:
        self.loss_scaler.update(new_scale)

    def get_scale(self) -> float:
        return self.loss_scaler.get_scale()

    def is_enabled(self) -> bool:
        return self.loss_scaler.is_enabled()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on inf/NaN gradients since training began (reads the device)."""
        return self._skipped_loaded if self._skipped is None else int(self._skipped.item())

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the skip count: plain Python numbers (``torch.load(weights_only=True)``)."""
        return {**self.loss_scaler.state_dict(), SKIPPED_KEY: self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        skipped = state.pop(SKIPPED_KEY, 0)
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise ValueError(f"'{SKIPPED_KEY}' must be a count (an int >= 0), got {skipped!r}")
        self.loss_scaler.load_state_dict(state)
        self._skipped_loaded = skipped
        if self._skipped is not None:
            self._skipped.fill_(skipped)
