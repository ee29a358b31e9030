"""``amp.scale_loss``: the context manager around each backward.

On entry the loss is multiplied by its scaler's current scale (loss_id picks the scaler) and the
grads already present are taken aside; on exit the new grads are checked for inf/NaN and unscaled
(into the FP32 master grads for optimizers with masters, as Apex did), the taken-aside grads are
added back, and the scaler backs off or grows, all with device ops. If the grads overflowed, the
next ``optimizer.step()`` leaves the weights as they were, and
"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" is logged
(logger "amp_fx.amp", WARNING) once the flag has reached the host::

    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Several losses (``num_losses=2``, ``loss_id=0/1``) may have different scales: each backward's
grads are unscaled with their own scale before they are added together.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp._amp_optimizer import AmpOptimizer, amp_optimizer_of
from amp_fx.amp._scaler import ApexLossScaler
from amp_fx.amp._state import session_of
from amp_fx.optim.torch_optimizer_scaling import FoundInf, total_found_inf

logger = logging.getLogger("amp_fx.amp")


class BackwardContext:
    """One ``scale_loss`` block: finished at its exit, or earlier by an ``optimizer.step()`` inside it."""

    def __init__(
        self, scaler: ApexLossScaler, used_scale: Tensor, optimizers: list[AmpOptimizer], delay_unscale: bool
    ) -> None:
        self.scaler = scaler
        self.used_scale = used_scale
        self.optimizers = optimizers
        self.delay_unscale = delay_unscale
        self.finished = False
        for optimizer in optimizers:
            optimizer.open_context = self

    def _close(self) -> None:
        self.finished = True
        for optimizer in self.optimizers:
            if optimizer.open_context is self:
                optimizer.open_context = None

    def finish(self) -> None:
        if self.finished:
            return
        self._close()
        if self.delay_unscale:
            for optimizer in self.optimizers:
                optimizer.mark_delayed()
            return
        inv_scale = self.used_scale.double().reciprocal().float()
        found: FoundInf = {}
        for optimizer in self.optimizers:
            for device, flag in optimizer.finish_backward(inv_scale, self.used_scale).items():
                found[device] = flag if device not in found else found[device] + flag
        total = total_found_inf(found, self.used_scale.device)
        if total is None:
            total = torch.zeros(1, dtype=torch.float32, device=self.used_scale.device)
        self.scaler.update(total)

    def abandon(self) -> None:
        """The block raised: put the grads taken aside back and forget this backward."""
        self._close()
        for optimizer in self.optimizers:
            for param, grad in optimizer.stashed:
                param.grad = grad
            optimizer.stashed = []


def _as_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if isinstance(optimizers, Sequence) and not isinstance(optimizers, str):
        return list(optimizers)
    raise TypeError(
        "amp.scale_loss takes an optimizer or a list of optimizers returned by amp.initialize, "
        f"got {type(optimizers).__name__}"
    )


@contextmanager
def scale_loss(
    loss: Tensor,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_id: int = 0,
    model: torch.nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[Tensor]:
    """Yield ``loss.float() * scale`` for ``.backward()``; unscale and check the grads on exit.

    Args:
        loss: the loss (any shape; ``scaled_loss.backward()`` needs a scalar or a gradient).
        optimizers: the optimizer(s), returned by `amp.initialize`, whose parameters get grads.
        loss_id: which loss scaler (``0 <= loss_id < num_losses``).
        model: unused, as in Apex.
        delay_unscale: leave the grads scaled for a following ``scale_loss`` at the same scale
            (Apex's gradient-accumulation trick); step only after a block without it.
        delay_overflow_check: accepted for Apex compatibility; the check never syncs anyway.

    Example:
        >>> import torch
        >>> from amp_fx import amp
        >>> model = torch.nn.Linear(4, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16,
        ...                                   verbosity=0)
        >>> loss = model(torch.randn(3, 4)).sum()
        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()
    """
    amp_optimizers = _as_list(optimizers)
    session = session_of(amp_optimizers)
    if session is None or not session.enabled:
        yield loss
        return
    scaler = session.scaler(loss_id)
    session.log_overflows()
    if scaler.is_identity and not session.properties.master_weights:
        # O0/O3 with a static scale of 1: nothing to scale or unscale (Apex's short cut).
        yield loss.float()
        return
    states = [amp_optimizer_of(optimizer) for optimizer in amp_optimizers]
    for state in states:
        state.prepare_backward()
    scaled_loss, used_scale = scaler.scale_loss(loss)
    context = BackwardContext(scaler, used_scale, states, delay_unscale)
    try:
        yield scaled_loss
    except BaseException:
        context.abandon()
        raise
    context.finish()
