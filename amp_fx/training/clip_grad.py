"""clip_grad_norm_: gradient clipping that never unscales the grads of amp_fx optimizers.

For `amp_fx.optim.FusedAdam` / `FusedSGD` the unscale can happen inside the optimizer's kernel: this
function has the `amp_fx.LossScaler` check the grads and hand ``1 / scale`` to the optimizer
(``defer_unscale_``, unless ``unscale_`` ran), computes the norm of ``grad * pending multiplier`` in
one fused pass over all grads (fp32 accumulation), and folds the clip coefficient
``min(1, max_norm / (norm + 1e-6))`` into the pending multiplier: nothing is rewritten, nothing is
read on the host (step 3 of the `amp_fx.optim.scaled_optimizer` handshake). Under FSDP2 (grads
that are ``DTensor`` shards) the sum of squares is all-reduced over the shard group first, so the
norm and the clip coefficient are the global ones on every rank. For any other
optimizer, or for an iterable of parameters, it is ``torch.nn.utils.clip_grad_norm_``.

Example:
    >>> import torch, amp_fx
    >>> w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    >>> opt, scaler = amp_fx.optim.FusedSGD([w], lr=1.0), amp_fx.LossScaler(init_scale=1024.0)
    >>> scaler.scale((w.float() * torch.tensor([3.0, 4.0])).sum()).backward()
    >>> amp_fx.clip_grad_norm_(opt, max_norm=1.0)  # the grads stay scaled: no pass over them
    tensor(5.)
    >>> scaler.step(opt); scaler.update(); w.detach()
    tensor([-0.6001, -0.7998], dtype=torch.float16)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from amp_fx.kernels import implementation_for
from amp_fx.optim.scaled_optimizer import ScaledOptimizer
from amp_fx.optim.wrappers import unwrap_optimizer
from amp_fx.training.active_scalers import scaler_for
from amp_fx.training.distributed import shard_groups
from amp_fx.training.loss_scaler import LossScaler

logger = logging.getLogger(__name__)

__all__ = ["clip_grad_norm_"]

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
_NORM_EPS = 1e-6


def clip_grad_norm_(
    target: torch.optim.Optimizer | Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    scaler: LossScaler | None = None,
) -> Tensor:
    """Clip the total 2-norm of the gradients to ``max_norm``; return the norm before clipping (0-dim tensor).

    ``target`` is an amp_fx optimizer (fused path: the norm of the true grads, clip folded into
    the pending grad multiplier, no host sync, the grads themselves left as they are), another
    torch optimizer (its params' grads, via torch.nn.utils.clip_grad_norm_) or parameters
    (torch.nn.utils.clip_grad_norm_). An optimizer may sit in a wrapper that holds it at
    ``.optimizer`` (accelerate's, Lightning's). Call it between ``backward`` and ``scaler.step``;
    ``scaler.unscale_`` first is not needed: grads that were not unscaled are measured divided by
    the scale of ``scaler`` (default: the `amp_fx.LossScaler` that scaled this iteration's loss,
    `amp_fx.training.active_scalers.scaler_for`), which also checks them for inf/NaN.

    An inf or NaN grad makes the norm inf or NaN, as in torch; under a LossScaler that step is
    skipped anyway.

    Example:
        >>> import torch, amp_fx
        >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)); w.grad = torch.ones_like(w)
        >>> opt = amp_fx.optim.FusedSGD([w], lr=1.0)
        >>> amp_fx.clip_grad_norm_(opt, max_norm=1.0)
        tensor(2.)
        >>> opt.step(); w.detach()
        tensor([0.5000, 0.5000, 0.5000, 0.5000], dtype=torch.bfloat16)
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be an amp_fx.LossScaler, got {type(scaler).__name__}")
    optimizer = unwrap_optimizer(target)
    if not hasattr(optimizer, "param_groups"):
        if scaler is not None:
            raise TypeError(
                "clip_grad_norm_(..., scaler=) needs the optimizer, whose grads the scaler checks; got "
                f"{type(target).__name__}. Pass the optimizer, or call scaler.unscale_(optimizer) first"
            )
    elif scaler is None:
        scaler = scaler_for(optimizer)
    if scaler is not None:
        # Checks the grads and makes 1/scale pending (torch.optim: unscales them in place), once.
        scaler.defer_unscale_(optimizer)
    if not isinstance(optimizer, ScaledOptimizer):
        if isinstance(optimizer, torch.optim.Optimizer):
            target = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(target, max_norm, norm_type=norm_type)
    if float(norm_type) != 2.0:
        raise ValueError(
            f"clip_grad_norm_ on an amp_fx optimizer computes the 2-norm in its fused pass; got norm_type="
            f"{norm_type}. Use norm_type=2.0"
        )
    return _clip_fused(optimizer, float(max_norm))


def _clip_fused(optimizer: ScaledOptimizer, max_norm: float) -> Tensor:
    grads_by_device = optimizer.grads_by_device()
    if not grads_by_device:
        return torch.zeros(())
    sq_norms = []
    for device, grads in grads_by_device.items():
        multiplier, found_inf = optimizer.pending_scaling(device)
        if found_inf is None:  # no LossScaler: the check runs anyway, its result is not used
            found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        sq_norm = torch.zeros(1, dtype=torch.float32, device=device)
        implementation_for(grads).check_finite_and_norm_(
            grads, found_inf, grad_multiplier=multiplier, sq_norm_out=sq_norm
        )
        sq_norms.append(sq_norm)
    home = sq_norms[0].device
    total = sq_norms[0] if len(sq_norms) == 1 else sum(s.to(home, non_blocking=True) for s in sq_norms)
    # FSDP2: the grads are DTensor shards; the sum of squares over all of them is the global one.
    grads = (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
    for shard_group in shard_groups(grads):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=shard_group)
    norm = total.sqrt()
    optimizer.fold_grad_multiplier_(torch.clamp(max_norm / (norm + _NORM_EPS), max=1.0))
    return norm.reshape(())
