"""What every optimizer kernel shares: the gradient multiplier, the skip rule and the step counter
(``advance_step_``, the one kernel both implementations run as it is here: a single elementwise op
on a one-element tensor). The other helpers are the reference kernels' (``adam``, ``sgd``,
``overflow_check``).

The skip rule: when ``found_inf`` is given and > 0, nothing is written. Here that is done with
``torch.where(skip, old, new)`` per tensor, so skipped tensors keep their exact bits; the Triton
kernels do the same by not storing at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["advance_step_", "own_steps", "scaled_grad", "skip_flag", "write_unless_skipped"]


def skip_flag(found_inf: Tensor | None) -> Tensor | None:
    """A 0-dim bool tensor, True when the step must be skipped (broadcasts against any shape)."""
    return None if found_inf is None else found_inf.reshape(()) > 0


def write_unless_skipped(target: Tensor, new_value: Tensor, skip: Tensor | None) -> None:
    """target <- new_value in target's dtype, unless skip is set (then target keeps its bits)."""
    new_value = new_value.to(target.dtype)
    if skip is not None:
        new_value = torch.where(skip, target, new_value)
    target.copy_(new_value)


def own_steps(step: Tensor, step_offsets: Sequence[Tensor] | None, count: int) -> Tensor:
    """The steps each of ``count`` params has taken, one tensor of shape (count,): ``step`` minus
    each param's offset (the group steps it missed); offsets None: ``step`` for all.

    One tensor, so that what is computed from the counts (Adam's bias corrections) is a few ops for
    the whole list rather than a few per parameter.

    Example:
        >>> own_steps(torch.full((1,), 5.0), [torch.tensor(0.0), torch.tensor(3.0)], 2)
        tensor([5., 2.])
    """
    step = step.reshape(1)
    if step_offsets is None:
        return step.expand(count)
    return step - torch.stack([offset.reshape(()) for offset in step_offsets])


def scaled_grad(grad: Tensor, grad_multiplier: Tensor | None) -> Tensor:
    """``grad`` in fp32, times ``grad_multiplier`` (e.g. 1 / loss_scale) when given."""
    grad = grad.float()
    return grad if grad_multiplier is None else grad * grad_multiplier.reshape(())


@torch.no_grad()
def advance_step_(step: Tensor | Sequence[Tensor], found_inf: Tensor | None) -> None:
    """``step += 1`` unless ``found_inf`` > 0, decided on the device. A list of counts (the step
    offsets of params without a grad this step) advances in one foreach launch; the increment is a
    tensor list, never a device scalar, so nothing is read on the host.

    Example:
        >>> step = torch.zeros(1)
        >>> advance_step_(step, torch.ones(1)); advance_step_(step, None)
        >>> step
        tensor([1.])
        >>> offsets = [torch.zeros(()), torch.zeros(())]
        >>> advance_step_(offsets, torch.zeros(1)); offsets
        [tensor(1.), tensor(1.)]
    """
    steps = [step] if isinstance(step, Tensor) else list(step)
    if not steps:
        return
    if found_inf is None:
        increment: float | Tensor = 1.0
    else:
        increment = (found_inf.reshape(()) <= 0).to(steps[0].dtype)
    if isinstance(step, Tensor):
        step.add_(increment)
    elif isinstance(increment, Tensor):
        torch._foreach_add_(steps, [increment] * len(steps))
    else:
        torch._foreach_add_(steps, increment)
