"""Which `amp_fx.LossScaler` an optimizer's gradients carry the scale of: how
`amp_fx.clip_grad_norm_` finds the scale of grads that nobody unscaled.

A scaler notes here when it scales a loss (`note_scaled`), steps an optimizer (`note_stepped`) and
updates (`note_updated`); `scaler_for` answers from those notes. The notes hold weak references:
they keep neither a scaler nor an optimizer alive.
"""

from __future__ import annotations

import weakref
from typing import Any

from amp_fx.optim.scaled_optimizer import ScaledOptimizer, next_tick
from amp_fx.optim.wrappers import unwrap_optimizer

# An amp_fx.LossScaler, which imports this module: named here without importing it back.
Scaler = Any

__all__ = ["note_scaled", "note_stepped", "note_updated", "scaler_for"]

# Each scaler that scaled a loss since its last update, with the `next_tick` of its last scale(),
# and the scaler that last stepped each optimizer.
_SCALED_AT: weakref.WeakKeyDictionary[Scaler, int] = weakref.WeakKeyDictionary()
_SCALER_OF_OPTIMIZER: weakref.WeakKeyDictionary[Any, Scaler] = weakref.WeakKeyDictionary()


def note_scaled(scaler: Scaler) -> None:
    """``scaler`` scaled a loss: the grads of the next backward carry its scale."""
    _SCALED_AT[scaler] = next_tick()


def note_stepped(scaler: Scaler, optimizer: Any) -> None:
    """``scaler`` stepped ``optimizer`` (unwrapped): its grads answer to ``scaler`` from now on."""
    try:
        _SCALER_OF_OPTIMIZER[optimizer] = scaler
    except TypeError:
        pass  # not weak-referenceable: scaler_for then finds the scaler among the active ones


def note_updated(scaler: Scaler) -> None:
    """``scaler`` updated its scale: no grads carry its scale until it scales a loss again."""
    _SCALED_AT.pop(scaler, None)


def scaler_for(optimizer: Any) -> Scaler | None:
    """The LossScaler whose scale ``optimizer``'s grads carry now, or None (no scaler is in use).

    That is the scaler that stepped ``optimizer`` last, if it has scaled a loss since its last
    ``update``. Before its first such step, for an amp_fx optimizer, it is the scaler that scaled a
    loss after the optimizer was created or last stepped and has not updated since; when several
    did, none can be chosen and a RuntimeError says to pass ``scaler=``.

    Example:
        >>> import torch, amp_fx
        >>> opt = amp_fx.optim.FusedSGD([torch.nn.Parameter(torch.ones(1))])
        >>> scaler = amp_fx.LossScaler()
        >>> _ = scaler.scale(torch.ones(()))
        >>> scaler_for(opt) is scaler
        True
        >>> scaler.update(1024.0); scaler_for(opt) is None
        True
    """
    optimizer = unwrap_optimizer(optimizer)
    try:
        last = _SCALER_OF_OPTIMIZER.get(optimizer)
    except TypeError:  # not weak-referenceable: it was never stepped by a LossScaler
        last = None
    if last is not None and last in _SCALED_AT:
        return last
    if not isinstance(optimizer, ScaledOptimizer):
        return None
    since = getattr(optimizer, "last_step_tick", 0)
    candidates = [scaler for scaler, scaled_at in _SCALED_AT.items() if scaled_at > since]
    if len(candidates) > 1:
        raise RuntimeError(
            f"{len(candidates)} LossScalers have scaled a loss since this optimizer was created or last "
            "stepped, so which scale its gradients carry is unknown; pass the scaler: "
            "amp_fx.clip_grad_norm_(optimizer, max_norm, scaler=scaler)"
        )
    return candidates[0] if candidates else None
