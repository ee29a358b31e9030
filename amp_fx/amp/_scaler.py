"""One loss scaler per loss, with Apex's semantics, on top of `amp_fx.LossScaler`.

Apex's dynamic scaler starts at ``min(2**16, max_loss_scale)``, halves on overflow (not below
``min_loss_scale``) and doubles after 2000 clean iterations (not above ``max_loss_scale``):
GradScaler's rule with hysteresis 1, which `amp_fx.LossScaler` implements on the device. A static
scale (``loss_scale=128.0``) never changes. Unlike Apex, a step whose gradients overflowed under a
static scale is skipped too (Apex applied the inf/NaN update, which ruins the weights for good);
a static scale of 1 without master weights (O0, O3) does nothing at all, as in Apex.

Apex printed "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
right away, which needs the overflow flag on the host: a sync every step. Here each update starts
a non-blocking copy of (overflow flag, new scale) to the host, and the message is logged later,
once the copy has landed (checked at the next ``amp.scale_loss``, ``optimizer.step`` or
``amp.state_dict``), so the hot path never waits for the device::

    >>> import torch
    >>> scaler = ApexLossScaler(0, "dynamic", min_loss_scale=None, max_loss_scale=2.0**24)
    >>> _ = scaler.scale_loss(torch.tensor(1.0))
    >>> scaler.update(torch.ones(1))
    >>> scaler.loss_scale()
    32768.0
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from amp_fx.training.loss_scaler import LossScaler

logger = logging.getLogger("amp_fx.amp")

# Apex's dynamic-scaling constants.
APEX_INIT_SCALE = 2.0**16
APEX_SCALE_WINDOW = 2000


@dataclass
class _HostRecord:
    """An update's overflow flag and new scale on their way to the host."""

    found_inf: Tensor
    scale: Tensor
    event: Any  # torch.cuda.Event when the copy is asynchronous, else None

    def ready(self) -> bool:
        return self.event is None or self.event.query()


class ApexLossScaler:
    """Loss scaler number `index` of an `amp.initialize` call: dynamic or static.

    Args:
        index: the loss id, used in messages and state dict keys ("loss_scaler0").
        loss_scale: "dynamic" or a fixed positive number.
        min_loss_scale, max_loss_scale: bounds of the dynamic scale (Apex's arguments).
        verbosity: 0 silences the overflow messages.
    """

    def __init__(
        self,
        index: int,
        loss_scale: float | str,
        min_loss_scale: float | None,
        max_loss_scale: float,
        verbosity: int = 1,
    ) -> None:
        self.index = index
        self.dynamic = loss_scale == "dynamic"
        self.verbosity = verbosity
        self._static_scale = 1.0 if self.dynamic else float(loss_scale)
        self._static_tensors: dict[torch.device, Tensor] = {}
        self._records: deque[_HostRecord] = deque()
        self._scaler: LossScaler | None = None
        if self.dynamic:
            init_scale = min(APEX_INIT_SCALE, max_loss_scale)
            if min_loss_scale is not None:
                init_scale = max(init_scale, min_loss_scale)
            self._scaler = LossScaler(
                init_scale=init_scale,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=APEX_SCALE_WINDOW,
                min_scale=min_loss_scale,
                max_scale=max_loss_scale,
            )

    @property
    def is_identity(self) -> bool:
        """True for a static scale of 1: Apex then hands the loss through untouched."""
        return not self.dynamic and self._static_scale == 1.0

    def scale_loss(self, loss: Tensor) -> tuple[Tensor, Tensor]:
        """(loss.float() * scale, the scale used, as a device tensor that later updates leave alone)."""
        loss = loss.float()
        if self._scaler is None:
            scale = self._static_tensors.get(loss.device)
            if scale is None:
                scale = torch.full((), self._static_scale, dtype=torch.float32, device=loss.device)
                self._static_tensors[loss.device] = scale
            return loss * scale, scale
        scaled = self._scaler.scale(loss)
        # The scaler's own tensor changes in place at update(); the grads keep the scale they got.
        return scaled, self._scaler.scale_tensor().clone()

    def update(self, found_inf: Tensor) -> None:
        """Back off or grow the dynamic scale from this loss's overflow flag (device ops only)."""
        if self._scaler is None:
            scale = self._static_tensors.get(found_inf.device)
            if scale is None:
                scale = torch.full((), self._static_scale, dtype=torch.float32, device=found_inf.device)
        else:
            scale = self._scaler.scale_tensor()
            if scale is None:  # nothing was scaled yet
                return
            self._scaler.update_from_found_infs(
                found_inf.to(scale.device, non_blocking=True).reshape(()).float()
            )
        if scale.is_cuda:
            record = _HostRecord(
                found_inf.reshape(()).to("cpu", non_blocking=True),
                scale.to("cpu", non_blocking=True),
                torch.cuda.Event(),
            )
            record.event.record()
        else:
            record = _HostRecord(found_inf.reshape(()).clone(), scale.clone(), None)
        self._records.append(record)

    def log_overflows(self, wait: bool = False) -> None:
        """Log Apex's overflow message for every update whose flag has reached the host.

        With ``wait=True`` waits for all of them (used where a sync is paid anyway).
        """
        while self._records and (wait or self._records[0].ready()):
            record = self._records.popleft()
            if wait and record.event is not None:
                record.event.synchronize()
            if self.verbosity >= 1 and float(record.found_inf) > 0:
                change = "reducing loss scale to" if self.dynamic else "keeping its static loss scale"
                logger.warning(
                    "Gradient overflow.  Skipping step, loss scaler %d %s %s",
                    self.index,
                    change,
                    float(record.scale),
                )

    def loss_scale(self) -> float:
        """The current scale as a Python float (reads the device)."""
        if self._scaler is None:
            return self._static_scale
        return self._scaler.get_scale()

    def unskipped(self) -> int:
        """Clean iterations since the last change of the scale (Apex's ``_unskipped``)."""
        if self._scaler is None:
            return 0
        return self._scaler.state_dict()["_growth_tracker"]

    def state_dict(self) -> dict[str, float | int]:
        """Apex's entry: ``{"loss_scale": 65536.0, "unskipped": 0}``."""
        self.log_overflows(wait=True)
        return {"loss_scale": self.loss_scale(), "unskipped": self.unskipped()}

    @staticmethod
    def check_entry(key: str, entry: Any) -> tuple[float, int]:
        """Validate one Apex state dict entry; return (loss_scale, unskipped)."""
        if not isinstance(entry, dict) or "loss_scale" not in entry or "unskipped" not in entry:
            raise ValueError(
                f"amp state dict entry {key!r} must be a dict with 'loss_scale' and 'unskipped' "
                f"(from amp.state_dict()), got {entry!r}"
            )
        scale, unskipped = entry["loss_scale"], entry["unskipped"]
        if isinstance(scale, Tensor):
            scale = scale.item()
        if isinstance(unskipped, Tensor):
            unskipped = unskipped.item()
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(
                f"amp state dict entry {key!r}: loss_scale must be a positive number, got {scale!r}"
            )
        if isinstance(unskipped, bool) or not isinstance(unskipped, int) or unskipped < 0:
            raise ValueError(
                f"amp state dict entry {key!r}: unskipped must be an int >= 0, got {unskipped!r}"
            )
        return float(scale), unskipped

    def load(self, loss_scale: float, unskipped: int) -> None:
        """Set the scale and the clean-iteration count (values checked by `check_entry`)."""
        if self._scaler is None:
            # Apex overwrote a static scale from the checkpoint too.
            self._static_scale = loss_scale
            self._static_tensors.clear()
            return
        self._records.clear()
        current = self._scaler.state_dict()
        current.update(scale=loss_scale, _growth_tracker=unskipped)
        self._scaler.load_state_dict(current)
