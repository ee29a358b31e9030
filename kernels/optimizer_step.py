"""What every optimizer kernel shares: the gradient multiplier, the skip rule and the step counter
(``advance_step_``, the one kernel both implementations run as it is here: a single elementwise op
on a one-element tensor). The other helpers are the reference kernels' (``adam``, ``sgd``,
``overflow_check``).

The skip rule: when ``found_inf`` is given and > 0, nothing is written. On a device that is done
with ``torch.where(skip, old, new)`` per tensor, so skipped tensors keep their exact bits without
the host reading the flag; the Triton kernels do the same by not storing at all. A flag in CPU
memory is read on the host (a memory read, no device sync), and the step is skipped or taken whole,
in place (`skip_flag`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "advance_step_",
    "own_steps",
    "scaled_grad",
    "scaled_grads",
    "skip_flag",
    "working_copies",
    "write_unless_skipped",
]


def skip_flag(found_inf: Tensor | None) -> Tensor | bool | None:
    """How ``found_inf`` decides the step: None, the step writes; True, it writes nothing (a flag in
    CPU memory, read here: no device sync); else a 0-dim bool tensor, True when the step must be
    skipped, which `working_copies` and `write_unless_skipped` apply on the device.

    Example:
        >>> skip_flag(torch.ones(1)), skip_flag(torch.zeros(1)), skip_flag(None)
        (True, None, None)
    """
    if found_inf is None:
        return None
    skip = found_inf.reshape(()) > 0
    if found_inf.device.type == "cpu":
        return True if bool(skip) else None
    return skip


def write_unless_skipped(
    targets: Sequence[Tensor], new_values: Sequence[Tensor], skip: Tensor | None
) -> None:
    """Each target <- its new value in the target's dtype (one foreach copy), unless skip is set
    (then every target keeps its bits).

    Example:
        >>> target = torch.zeros(2, dtype=torch.bfloat16)
        >>> write_unless_skipped([target], [torch.tensor([1.0, 1 / 3])], skip_flag(torch.zeros(1)))
        >>> target
        tensor([1.0000, 0.3340], dtype=torch.bfloat16)
    """
    # A target that is its own new value was updated in place (`working_copies` without a skip).
    pairs = [(target, new) for target, new in zip(targets, new_values, strict=True) if target is not new]
    if not pairs:
        return
    targets, new_values = [target for target, _ in pairs], [new for _, new in pairs]
    if skip is not None:
        new_values = [
            torch.where(skip, target, new.to(target.dtype))
            for target, new in zip(targets, new_values, strict=True)
        ]
    # copy_ rounds to the target's dtype as .to does (to nearest even).
    torch._foreach_copy_(targets, new_values)


def working_copies(tensors: Sequence[Tensor], skip: Tensor | None) -> list[Tensor]:
    """What an update computes on, in place, for ``tensors``: each in fp32, itself where it is fp32
    and no skip flag is given (written in place), else an fp32 copy that `write_unless_skipped`
    writes back (a skipped step must leave every bit of the originals).

    Example:
        >>> state, skip = torch.zeros(2), torch.tensor(False)
        >>> working_copies([state], None)[0] is state, working_copies([state], skip)[0] is state
        (True, False)
    """
    work = [tensor.float() for tensor in tensors]
    if skip is None:
        return work
    return [copy.clone() if copy is tensor else copy for copy, tensor in zip(work, tensors, strict=True)]


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


def scaled_grads(grads: Sequence[Tensor], grad_multiplier: Tensor | None) -> list[Tensor]:
    """`scaled_grad` of each grad, the multiplier applied in one foreach op. Read only: an fp32
    grad without a multiplier comes back as itself.

    Example:
        >>> scaled_grads([torch.ones(2, dtype=torch.float16)], torch.full((1,), 0.5))
        [tensor([0.5000, 0.5000])]
    """
    fp32 = [grad.float() for grad in grads]
    return fp32 if grad_multiplier is None else list(torch._foreach_mul(fp32, grad_multiplier.reshape(())))


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
