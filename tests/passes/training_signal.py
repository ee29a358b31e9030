"""One training step's loss and gradients, and their comparison to a reference within the suite's
per-dtype tolerances: shared by the loss-fusion tests of both front ends."""

from __future__ import annotations

import torch
from torch import nn

from amp_fx.testing import grad_tolerances, tolerances
from amp_fx.testing.comparison import compare_tensors, root_mean_square

Step = tuple[torch.Tensor, dict[str, torch.Tensor]]


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    """The loss (a model's output, or the second of its (logits, loss)) and every parameter's
    gradient, by name."""
    output = model(x, y)
    loss = output[1] if isinstance(output, tuple) else output
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss.sum(), [p for _, p in named])
    return loss.detach(), {name: grad for (name, _), grad in zip(named, grads, strict=True)}


def mismatches(actual: Step, expected: Step, dtype: torch.dtype, label: str) -> list:
    """The loss within `tolerances(dtype)`, each gradient within `grad_tolerances(dtype)` scaled by
    the reference gradients' root mean square: the mismatches found."""
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    assert type(loss) is torch.Tensor
    rtol, atol = tolerances(dtype)
    found = [compare_tensors(loss, expected_loss, rtol=rtol, atol=atol, name=f"{label} loss")]
    rtol, atol = grad_tolerances(dtype)
    scale = root_mean_square(list(expected_grads.values()))
    for name, grad in grads.items():
        assert type(grad) is torch.Tensor
        found.append(
            compare_tensors(
                grad, expected_grads[name], rtol=rtol, atol=atol, scale=scale, name=f"{label} {name}"
            )
        )
    return [mismatch for mismatch in found if mismatch is not None]
