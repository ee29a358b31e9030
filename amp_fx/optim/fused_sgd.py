"""FusedSGD: SGD with momentum and FP32 master weights, one kernel call per param group, no host sync."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

from torch import Tensor

from amp_fx.kernels.sgd.arguments import check_sgd_hyperparameters
from amp_fx.optim.fused_optimizer import FusedOptimizer, StepBatch, as_float


class FusedSGD(FusedOptimizer):
    """SGD with optional momentum, dampening, Nesterov momentum and weight decay (torch.optim.SGD math).

    For fp16/bf16 parameters with ``master_weights=True`` (the default) the optimizer keeps an
    FP32 master copy in ``state[p]["master_param"]`` and writes the rounded result back to the
    parameter; FP32 parameters are updated in place. With ``momentum != 0`` each parameter has an
    FP32 ``momentum_buffer``, created at its first step with a grad and set to that gradient (no
    dampening), as torch does, also for a parameter whose first grad comes late. The kernel tells
    a parameter's first step from the group's count (``param_groups[i]["step"]``, one float32
    device tensor, not advanced on a skipped step) minus ``state[p]["step_offset"]``, the group
    steps the parameter took no part in; see `amp_fx.optim.fused_optimizer`.

    Args:
        params: parameters or param groups, as for torch.optim.SGD.
        lr, momentum, dampening, weight_decay, nesterov: as torch.optim.SGD.
        master_weights: keep FP32 masters for fp16/bf16 params.

    Example:
        >>> import torch, amp_fx
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = amp_fx.optim.FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.randn(8, 4, dtype=torch.bfloat16)).float().square().mean().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        master_weights: bool = True,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "master_weights": master_weights,
        }
        super().__init__(params, defaults)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _check_hyperparameters(self, group: dict[str, Any]) -> None:
        for name in ("nesterov", "master_weights"):
            if not isinstance(group[name], bool):
                raise TypeError(f"{name} must be True or False, got {group[name]!r}")
        momentum = as_float("momentum", group["momentum"])
        check_sgd_hyperparameters(
            as_float("lr", group["lr"]),
            momentum,
            as_float("dampening", group["dampening"]),
            as_float("weight_decay", group["weight_decay"]),
            group["nesterov"],
            # The buffers are created at the first step; only the hyperparameters are checked here.
            momentum_buffers=(),
        )

    def _update(
        self,
        kernels: ModuleType,
        batch: StepBatch,
        step: Tensor,
        group: dict[str, Any],
        grad_multiplier: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        momentum = float(group["momentum"])
        kernels.sgd_step_(
            batch.params,
            batch.grads,
            batch.masters_or_none(),
            batch.states["momentum_buffer"] if momentum != 0 else None,
            step,
            lr=float(group["lr"]),
            momentum=momentum,
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=group["nesterov"],
            grad_multiplier=grad_multiplier,
            found_inf=found_inf,
            step_offsets=batch.step_offsets_or_none(),
        )
