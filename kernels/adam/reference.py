"""Adam in plain torch: the family's contract (``amp_fx.kernels.adam``, which has the math)
computed with torch ops, on any device; the definition the Triton kernel is tested against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.adam.arguments import check_adam_hyperparameters, log_beta
from amp_fx.kernels.arguments import check_update
from amp_fx.kernels.optimizer_step import (
    own_steps,
    scaled_grads,
    skip_flag,
    working_copies,
    write_unless_skipped,
)

__all__ = ["adam_step_"]


def _bias_correction(beta: float, t: Tensor) -> Tensor:
    """1 - beta**t, as -expm1(t * ln(beta)): no cancellation when beta**t is close to 1."""
    return -torch.expm1(t * log_beta(beta))


@torch.no_grad()
def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    grad_multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
    step_offsets: Sequence[Tensor] | None = None,
) -> None:
    """One Adam (``adam_w_mode=False``) or AdamW (``adam_w_mode=True``) step, in place: the
    contract of ``amp_fx.kernels.adam``.

    Example:
        >>> p, g = torch.ones(2), torch.ones(2)
        >>> m, v, step = torch.zeros(2), torch.zeros(2), torch.zeros(1)
        >>> adam_step_([p], [g], None, [m], [v], step, lr=0.5, beta1=0.9, beta2=0.999, eps=0.0,
        ...            weight_decay=0.0, adam_w_mode=False)
        >>> p
        tensor([0.5000, 0.5000])
    """
    check_update(
        params,
        grads,
        masters,
        {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        step,
        grad_multiplier,
        found_inf,
        {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay},
        step_offsets,
    )
    check_adam_hyperparameters(lr, beta1, beta2, eps, weight_decay)
    if len(params) == 0:
        return
    skip = skip_flag(found_inf)
    if skip is True:
        return
    t = own_steps(step, step_offsets, len(params)) + 1
    step_sizes = (lr / _bias_correction(beta1, t)).unbind()
    bias_corrections2_sqrt = _bias_correction(beta2, t).sqrt().unbind()
    masters = [None] * len(params) if masters is None else masters
    # Each param's fp32 weight is its master, or the param itself.
    sources = [param if master is None else master for param, master in zip(params, masters, strict=True)]
    weights, new_exp_avgs, new_exp_avg_sqs = (
        working_copies(tensors, skip) for tensors in (sources, exp_avgs, exp_avg_sqs)
    )
    # The torch expression of the contract, op for op, each op one foreach call over the list,
    # in place on the working copies.
    g = scaled_grads(grads, grad_multiplier)
    if weight_decay != 0.0:
        if adam_w_mode:
            torch._foreach_mul_(weights, 1.0 - lr * weight_decay)
        else:
            g = torch._foreach_add(g, torch._foreach_mul(weights, weight_decay))
    torch._foreach_mul_(new_exp_avgs, beta1)
    torch._foreach_add_(new_exp_avgs, torch._foreach_mul(g, 1.0 - beta1))
    squares = torch._foreach_mul(g, 1.0 - beta2)
    torch._foreach_mul_(squares, g)
    torch._foreach_mul_(new_exp_avg_sqs, beta2)
    torch._foreach_add_(new_exp_avg_sqs, squares)
    denoms = torch._foreach_sqrt(new_exp_avg_sqs)
    torch._foreach_div_(denoms, bias_corrections2_sqrt)
    torch._foreach_add_(denoms, eps)
    steps = torch._foreach_div(new_exp_avgs, denoms)
    torch._foreach_mul_(steps, step_sizes)
    torch._foreach_sub_(weights, steps)
    with_master = [i for i, master in enumerate(masters) if master is not None]
    write_unless_skipped(
        [*exp_avgs, *exp_avg_sqs, *sources, *(params[i] for i in with_master)],
        [*new_exp_avgs, *new_exp_avg_sqs, *weights, *(weights[i] for i in with_master)],
        skip,
    )
