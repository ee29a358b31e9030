"""SGD in plain torch: the family's contract (``amp_fx.kernels.sgd``, which has the math)
computed with torch ops, on any device; the definition the Triton kernel is tested against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.arguments import check_update
from amp_fx.kernels.optimizer_step import own_steps, scaled_grad, skip_flag, write_unless_skipped
from amp_fx.kernels.sgd.arguments import check_sgd_hyperparameters

__all__ = ["sgd_step_"]


@torch.no_grad()
def sgd_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    momentum_buffers: Sequence[Tensor] | None,
    step: Tensor,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
    step_offsets: Sequence[Tensor] | None = None,
) -> None:
    """One SGD step (torch.optim.SGD math), in place: the contract of ``amp_fx.kernels.sgd``.

    Example:
        >>> p, g, buf, step = torch.ones(2), torch.ones(2), torch.zeros(2), torch.zeros(1)
        >>> sgd_step_([p], [g], None, [buf], step, lr=0.1, momentum=0.9, dampening=0.0,
        ...           weight_decay=0.0, nesterov=False)
        >>> p, buf
        (tensor([0.9000, 0.9000]), tensor([1., 1.]))
    """
    check_update(
        params,
        grads,
        masters,
        {"momentum_buffers": momentum_buffers},
        step,
        grad_multiplier,
        found_inf,
        {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay},
        step_offsets,
    )
    check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov, momentum_buffers)
    if len(params) == 0:
        return
    skip = skip_flag(found_inf)
    if momentum != 0.0:
        first_steps = (own_steps(step, step_offsets, len(params)) == 0).unbind()
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        master = None if masters is None else masters[i]
        weight = (param if master is None else master).float()
        g = scaled_grad(grad, grad_multiplier)
        if weight_decay != 0.0:
            g = g + weight_decay * weight
        if momentum != 0.0:
            buf = momentum_buffers[i]
            new_buf = torch.where(first_steps[i], g, momentum * buf + (1.0 - dampening) * g)
            g = g + momentum * new_buf if nesterov else new_buf
            write_unless_skipped(buf, new_buf, skip)
        new_weight = weight - lr * g
        if master is not None:
            write_unless_skipped(master, new_weight, skip)
        write_unless_skipped(param, new_weight, skip)
