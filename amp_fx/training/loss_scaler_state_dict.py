"""A `amp_fx.LossScaler`'s state as plain numbers: the host reads of its device state (the scale,
the growth and hysteresis trackers) and ``state_dict`` / ``load_state_dict``, a superset of
torch.amp.GradScaler's checkpoint format. A base of LossScaler, apart from it for its size.

Example:
    >>> import torch, amp_fx
    >>> scaler = amp_fx.LossScaler(init_scale=1024.0, hysteresis=2)
    >>> other = amp_fx.LossScaler()
    >>> other.load_state_dict(scaler.state_dict())
    >>> other.get_scale(), other.get_hysteresis()
    (1024.0, 2)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from amp_fx.kernels.reference import reciprocal_scale_
from amp_fx.training.loss_scaler_settings import LossScaleSettings, checked_state_dict_values

__all__ = ["LossScaleStateDict"]


class LossScaleStateDict(LossScaleSettings):
    """Reading and writing a scaler's state as Python numbers; `amp_fx.LossScaler` creates the
    device tensors these read (lazily, on the device of the first scaled loss) and documents them."""

    _enabled: bool
    # Where the device tensors are still to be created, what they will start from.
    _init_growth_tracker: int
    _init_hysteresis_tracker: int
    _scale: Tensor | None
    _growth_tracker: Tensor | None
    _hysteresis_tracker: Tensor | None
    _inv_scale: Tensor | None

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Reads the device: a host sync."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def _get_hysteresis_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._hysteresis_tracker is None:
            return self._init_hysteresis_tracker
        return int(self._hysteresis_tracker.item())

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as plain Python numbers (empty when disabled); a superset of GradScaler's.

        Keys: ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker`` (GradScaler's five) and ``hysteresis``, ``_hysteresis_tracker``,
        ``min_scale``, ``max_scale``. Reads the device (a host sync): call it after ``update()``.

        Example:
            >>> from amp_fx import LossScaler
            >>> LossScaler(init_scale=1024.0).state_dict()["scale"]
            1024.0
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": self._get_hysteresis_tracker(),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` (or from torch.amp.GradScaler's); no-op when disabled.

        Every value is checked before anything changes. Keys GradScaler does not write
        (hysteresis, bounds) keep their current values when absent.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"state_dict must be a dict from LossScaler.state_dict(), got {type(state_dict).__name__}"
            )
        if not state_dict:
            raise ValueError(
                "the loaded scaler state dict is empty: it was saved from a disabled scaler (enabled=False); "
                "create this scaler with enabled=False too, or load a state dict from an enabled one"
            )
        values, growth_tracker, hysteresis_tracker = checked_state_dict_values(
            state_dict, self._hysteresis, self._min_scale, self._max_scale
        )
        self._set_settings(**values)
        self._init_growth_tracker = int(growth_tracker)
        self._init_hysteresis_tracker = int(hysteresis_tracker)
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_growth_tracker)
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
            reciprocal_scale_(self._inv_scale, self._scale)
