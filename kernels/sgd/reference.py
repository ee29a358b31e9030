"""SGD in plain torch: the family's contract (``amp_fx.kernels.sgd``, which has the math)
computed with torch ops, on any device; the definition the Triton kernel is tested against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.arguments import check_update
from amp_fx.kernels.optimizer_step import (
    own_steps,
    scaled_grads,
    skip_flag,
    working_copies,
    write_unless_skipped,
)
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
    if skip is True:
        return
    masters = [None] * len(params) if masters is None else masters
    # Each param's fp32 weight is its master, or the param itself.
    sources = [param if master is None else master for param, master in zip(params, masters, strict=True)]
    weights = working_copies(sources, skip)
    # The torch expression of the contract, op for op, each op one foreach call over the list.
    g = scaled_grads(grads, grad_multiplier)
    if weight_decay != 0.0:
        g = torch._foreach_add(g, torch._foreach_mul(weights, weight_decay))
    targets, new_values = [], []
    if momentum != 0.0:
        first_steps = (own_steps(step, step_offsets, len(params)) == 0).unbind()
        blends = torch._foreach_mul(momentum_buffers, momentum)
        torch._foreach_add_(blends, torch._foreach_mul(g, 1.0 - dampening))
        new_bufs = [
            torch.where(first, grad, blend) for first, grad, blend in zip(first_steps, g, blends, strict=True)
        ]
        g = torch._foreach_add(g, torch._foreach_mul(new_bufs, momentum)) if nesterov else new_bufs
        targets, new_values = list(momentum_buffers), new_bufs
    torch._foreach_sub_(weights, torch._foreach_mul(g, lr))
    with_master = [i for i, master in enumerate(masters) if master is not None]
    write_unless_skipped(
        [*targets, *sources, *(params[i] for i in with_master)],
        [*new_values, *weights, *(weights[i] for i in with_master)],
        skip,
    )
