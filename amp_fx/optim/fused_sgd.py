"""FusedSGD: SGD with momentum and FP32 master weights, one kernel call per param group, no host sync."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from amp_fx.kernels.sgd.arguments import check_sgd_hyperparameters
from amp_fx.optim.fused_optimizer import FusedOptimizer


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

    _kernel_name = "sgd_step_"
    _state_names = ("momentum_buffer",)
    _flags = ("nesterov",)

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
        hyperparameters = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, hyperparameters, master_weights)

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_names if group["momentum"] != 0 else ()

    def _kernel_hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        return {name: group[name] for name in ("lr", "momentum", "dampening", "weight_decay", "nesterov")}

    def _check_kernel_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        # The buffers are created at the first step; only the hyperparameters are checked here.
        check_sgd_hyperparameters(**hyperparameters, momentum_buffers=())
