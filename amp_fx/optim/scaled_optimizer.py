"""ScaledOptimizer: the handshake between a loss scaler and an optimizer that unscales in its kernel.

An optimizer that implements this protocol (`amp_fx.optim.FusedAdam`, `FusedSGD`) is never handed
unscaled grads: the scaler tells it the loss scale's reciprocal, and the optimizer applies it while
its kernel reads the grads (an fp16 grad divided by 2^16 in place would lose its small values).
Everything crossing the handshake is a device tensor; no step reads a value on the host, so a
whole iteration runs under ``torch.cuda.set_sync_debug_mode("error")``.

One iteration, step by step (who calls what; D = stays on the device, H = Python on the host):

1. ``scaler.scale(loss).backward()``: the grads hold ``scale * grad`` (D).
2. ``scaler.defer_unscale_(opt)`` (called by ``amp_fx.clip_grad_norm_``, or by ``scaler.step`` when
   nothing did) calls ``opt.unscale_grads_(inv_scale)`` with ``inv_scale = 1 / scale``,
   a 0-dim float32 device tensor. The optimizer records it as its pending grad multiplier for
   every device with grads, checks those grads for inf/NaN (D, the grads are only read) and returns
   one overflow flag per device (float32, shape (1,), > 0 on overflow). The flags are the
   optimizer's own persistent buffers: its next ``unscale_grads_`` reuses them. The scaler keeps
   them and, under torch.distributed, makes the ranks agree on them (D, an all-reduce).
3. Optional, ``amp_fx.clip_grad_norm_(opt, max_norm)``: for each device of
   ``opt.grads_by_device()`` (H: which tensors) it reads ``opt.pending_scaling(device)``
   (D: multiplier and flag), computes the norm of ``grad * multiplier`` and calls
   ``opt.fold_grad_multiplier_(clip_coefficient)`` (D: the multiplier becomes ``multiplier * coef``).
   Or ``scaler.unscale_(opt)`` (torch's recipe): step 2, then ``opt.apply_grad_multiplier_()`` writes
   ``grad * multiplier`` into the grads (fp16/bf16 grads become FP32 tensors) and forgets the
   multiplier (D); user code then changes the grads themselves, and the step reads them.
4. ``scaler.step(opt)`` calls ``opt.step()``: the kernel multiplies each grad by the pending
   multiplier and, where the flag is > 0, writes nothing (D: the skip is decided in the kernel).
   The step forgets the pending multiplier and flag (H: the dict entries).
5. ``scaler.update()`` grows or backs off the scale from all flags in one kernel launch, zeroing
   the flags it read (D), then calls ``opt.finish_scaling(zeroed_found_infs=flags)`` (H): the
   optimizer forgets what is still pending and notes which of its buffers hold 0 already, so that
   the next ``unscale_grads_`` need not fill them again.

``amp_fx.amp`` (Apex's API) drives the same methods: ``unscale_grads_`` after each backward,
``pending_scaling`` to hand out FP32 master grads, ``finish_scaling()`` at ``zero_grad``.

Optimizers that do not implement the protocol (torch.optim) have their grads unscaled in place
and skip on the host: see `amp_fx.optim.torch_optimizer_scaling`.

Example:
    >>> import torch
    >>> from amp_fx.optim import FusedSGD
    >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    >>> opt = FusedSGD([w], lr=1.0)
    >>> isinstance(opt, ScaledOptimizer), isinstance(torch.optim.SGD([w], lr=1.0), ScaledOptimizer)
    (True, False)
    >>> w.grad = torch.full((2,), 8.0, dtype=torch.float16)
    >>> flags = opt.unscale_grads_(torch.tensor(0.25))  # the grads stay 8; the kernel applies 1/4
    >>> opt.pending_scaling(torch.device("cpu"))
    (tensor([0.2500]), tensor([0.]))
    >>> opt.step(); w.detach()
    tensor([-1., -1.], dtype=torch.float16)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["ScaledOptimizer", "next_tick"]

_TICKS = itertools.count(1)


def next_tick() -> int:
    """A process-wide counter that orders loss scalings and optimizer steps
    (`amp_fx.training.active_scalers.scaler_for` reads it: a scaler that scaled a loss after an
    optimizer's last step may have scaled its grads).

    >>> next_tick() < next_tick()
    True
    """
    return next(_TICKS)


@runtime_checkable
class ScaledOptimizer(Protocol):
    """An optimizer that takes the loss scale as a pending grad multiplier (see the module docstring).

    ``isinstance(optimizer, ScaledOptimizer)`` tells a scaler which path to take.
    """

    def grads_by_device(self) -> dict[torch.device, list[Tensor]]:
        """The grads of all parameters that have one, per device (the tensors themselves)."""
        ...

    def unscale_grads_(self, inv_scale: Tensor) -> dict[torch.device, Tensor]:
        """Record ``inv_scale`` (device tensor) as the pending grad multiplier of every device with
        grads, replacing any earlier one, and check those grads for inf/NaN without changing them.

        Returns the overflow flag per device (float32, shape (1,), > 0 on overflow): persistent
        buffers that the next call rewrites. The next ``step`` skips its update where a flag is > 0.
        """
        ...

    def pending_scaling(self, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
        """(grad multiplier, overflow flag) that the next ``step`` applies on ``device``; None for each
        that was not recorded since the last step."""
        ...

    def fold_grad_multiplier_(self, factor: Tensor) -> None:
        """Multiply the pending grad multiplier of each device with grads by ``factor`` (a device
        tensor; a device without a multiplier gets ``factor`` itself)."""
        ...

    def apply_grad_multiplier_(self) -> None:
        """Write ``grad * pending multiplier`` into the grads (low-precision grads become FP32 tensors)
        and forget the multiplier; the overflow flags stay pending. `amp_fx.LossScaler.unscale_`
        calls it, so that user code then reads, and may change, the true gradients."""
        ...

    def finish_scaling(self, zeroed_found_infs: Sequence[Tensor] = ()) -> None:
        """Forget the pending multipliers and flags (end of an iteration, or a zero_grad).

        ``zeroed_found_infs`` are flags the scaler set to 0 on the device after reading them; a
        persistent buffer among them need not be zeroed again by the next ``unscale_grads_``.
        """
        ...
