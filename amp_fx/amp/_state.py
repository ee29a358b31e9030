"""The state of one `amp.initialize` call (an `AmpSession`) and Apex's state dict format.

Apex kept one global state, so ``amp.initialize`` could run only once. Here every call makes its
own session (properties, one loss scaler per loss, the optimizers it processed); the optimizers
remember their session, so ``amp.scale_loss`` finds the right scalers even after ``initialize``
ran again for another model (a hyper-parameter search, a notebook cell run twice).
``amp.state_dict()`` / ``amp.load_state_dict()`` act on the latest session, in Apex's format::

    {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}, "loss_scaler1": {...}}

so checkpoints written by Apex load here and the other way round.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp._amp_optimizer import amp_optimizer_of
from amp_fx.amp._properties import AmpConfigError, Properties
from amp_fx.amp._scaler import ApexLossScaler

logger = logging.getLogger("amp_fx.amp")

SCALER_KEY_PREFIX = "loss_scaler"


class AmpSession:
    """Properties, loss scalers and processed optimizers of one `amp.initialize` call."""

    def __init__(
        self,
        properties: Properties,
        num_losses: int = 1,
        verbosity: int = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        self.properties = properties
        self.verbosity = verbosity
        self.num_losses = num_losses
        self.scalers = (
            [
                ApexLossScaler(index, properties.loss_scale, min_loss_scale, max_loss_scale, verbosity)
                for index in range(num_losses)
            ]
            if properties.enabled
            else []
        )
        self.optimizers: list[Any] = []  # AmpOptimizer
        # id(original parameter) -> (weak reference to it, converted parameter)
        self._param_map: dict[int, tuple[weakref.ref, Tensor]] = {}

    @property
    def enabled(self) -> bool:
        return self.properties.enabled

    # ------------------------------------------------------------------------------------------
    def add_param_mapping(self, original: Tensor, converted: Tensor) -> None:
        self._param_map[id(original)] = (weakref.ref(original), converted)

    def map_param(self, param: Tensor) -> Tensor:
        """The converted model's parameter for an original model's parameter (else `param` itself)."""
        entry = self._param_map.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        return param

    def owns(self, param: Tensor) -> bool:
        """True if `param` is an original parameter of this session's models."""
        entry = self._param_map.get(id(param))
        return entry is not None and entry[0]() is param

    def masters_by_param(self) -> dict[int, Tensor]:
        """id(converted model parameter) -> the FP32 master an optimizer of this session keeps for it."""
        masters: dict[int, Tensor] = {}
        for amp_optimizer in self.optimizers:
            masters.update(amp_optimizer.masters_by_param())
        return masters

    # ------------------------------------------------------------------------------------------
    def scaler(self, loss_id: Any) -> ApexLossScaler:
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(self.scalers):
            raise ValueError(
                f"loss_id={loss_id!r} is out of range: amp.initialize was called with "
                f"num_losses={self.num_losses}, so loss_id must be an int in [0, {self.num_losses - 1}]; "
                "pass num_losses=N to amp.initialize for N losses"
            )
        return self.scalers[loss_id]

    def log_overflows(self, wait: bool = False) -> None:
        """Log the overflow messages whose flags have reached the host (all of them with wait=True)."""
        for scaler in self.scalers:
            scaler.log_overflows(wait)

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> OrderedDict[str, dict[str, float | int]]:
        """``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}`` (reads the device)."""
        return OrderedDict(
            (f"{SCALER_KEY_PREFIX}{i}", scaler.state_dict()) for i, scaler in enumerate(self.scalers)
        )

    def load_state_dict(self, state_dict: Any) -> None:
        """Load Apex's format; everything is checked before any scaler changes.

        As in Apex: a different number of scalers is logged and the entries that fit are loaded
        in order; a key that is not ``loss_scalerN`` is an error.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"amp.load_state_dict needs the dict from amp.state_dict(), got {type(state_dict).__name__}"
            )
        unexpected = [key for key in state_dict if not str(key).startswith(SCALER_KEY_PREFIX)]
        if unexpected:
            raise AmpConfigError(
                f"Error(s) in loading amp state_dict: unexpected key(s) {unexpected}; "
                "amp.load_state_dict takes only amp.state_dict()'s 'loss_scalerN' entries "
                "(load model and optimizer states separately)"
            )
        entries = [ApexLossScaler.check_entry(str(key), value) for key, value in state_dict.items()]
        if len(entries) != len(self.scalers):
            logger.warning(
                "amp state dict has %d loss scaler(s) but num_losses=%d here: loading the first %d",
                len(entries),
                len(self.scalers),
                min(len(entries), len(self.scalers)),
            )
        for scaler, (loss_scale, unskipped) in zip(self.scalers, entries, strict=False):
            scaler.load(loss_scale, unskipped)


_current: AmpSession | None = None


def set_current_session(session: AmpSession) -> None:
    global _current
    _current = session


def require_session(what: str) -> AmpSession:
    if _current is None:
        raise RuntimeError(
            f"{what} needs amp state: call model, optimizer = amp.initialize(model, optimizer, ...) first"
        )
    return _current


def session_of(optimizers: list[torch.optim.Optimizer]) -> AmpSession | None:
    """The session the optimizers were processed by (None for unprocessed ones when amp is disabled)."""
    sessions = []
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "amp.scale_loss takes the optimizer(s) returned by amp.initialize, "
                f"got {type(optimizer).__name__}"
            )
        amp_optimizer = amp_optimizer_of(optimizer)
        if amp_optimizer is None:
            if _current is not None and not _current.enabled:
                return None  # amp.initialize(enabled=False): every amp call is a no-op
            raise RuntimeError(
                f"this {type(optimizer).__name__} was not returned by amp.initialize; call "
                "model, optimizer = amp.initialize(model, optimizer, opt_level=...) and use the returned "
                "optimizer"
            )
        sessions.append(amp_optimizer.session)
    if not sessions:
        raise ValueError(
            "amp.scale_loss needs the optimizer(s) whose parameters this backward produces grads for"
        )
    if any(session is not sessions[0] for session in sessions):
        raise ValueError(
            "amp.scale_loss got optimizers from different amp.initialize calls; a loss's scaler belongs "
            "to one call, so pass optimizers initialized together"
        )
    return sessions[0]
