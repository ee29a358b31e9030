"""FusedAdam: Adam/AdamW with FP32 master weights, one kernel call per param group, no host sync."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from amp_fx.kernels.adam.arguments import check_adam_hyperparameters
from amp_fx.optim.fused_optimizer import FusedOptimizer


class FusedAdam(FusedOptimizer):
    """Adam (``adam_w_mode=False``, L2 penalty) or AdamW (``adam_w_mode=True``, decoupled decay).

    The math is torch.optim.Adam's / AdamW's, computed in FP32. For fp16/bf16 parameters with
    ``master_weights=True`` (the default) the optimizer keeps an FP32 master copy in
    ``state[p]["master_param"]`` and writes the rounded result back to the parameter; FP32
    parameters are updated in place. Moments (``exp_avg``, ``exp_avg_sq``) are FP32, created at a
    parameter's first step with a grad (as torch.optim's and Apex's). Bias correction counts
    each parameter's own steps, as torch.optim.Adam does: the group's count
    (``param_groups[i]["step"]``, one float32 device tensor, advanced at each step of the group that
    was not skipped) minus ``state[p]["step_offset"]``, the group steps the parameter took no part
    in (before its first grad, or without a grad since); see `amp_fx.optim.fused_optimizer`.

    Hyperparameters are read from the param groups at each step as Python floats, so LR schedulers
    work as with torch.optim (when a step is captured in a CUDA graph, the values at capture time
    are baked in).

    Args:
        params: parameters or param groups, as for torch.optim.Adam.
        lr, betas, eps, weight_decay: as torch.optim.Adam / AdamW.
        adam_w_mode: True for AdamW's decoupled weight decay, False for Adam's L2 penalty.
        master_weights: keep FP32 masters for fp16/bf16 params (False: update them in place,
            with FP32 arithmetic but low-precision storage).

    Example:
        >>> import torch, amp_fx
        >>> model = torch.nn.Linear(4, 2).half()
        >>> opt = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-3)
        >>> scaler = amp_fx.LossScaler()
        >>> loss = model(torch.randn(8, 4, dtype=torch.float16)).float().square().mean()
        >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    """

    _kernel_name = "adam_step_"
    _state_names = ("exp_avg", "exp_avg_sq")
    _flags = ("adam_w_mode",)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
        master_weights: bool = True,
    ) -> None:
        hyperparameters = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
        }
        super().__init__(params, hyperparameters, master_weights)

    def _kernel_hyperparameters(self, group: dict[str, Any]) -> dict[str, Any]:
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair of floats (beta1, beta2), got {betas!r}")
        return {
            "lr": group["lr"],
            "beta1": betas[0],
            "beta2": betas[1],
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
            "adam_w_mode": group["adam_w_mode"],
        }

    def _check_kernel_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        # All but the flag adam_w_mode (checked by the base) are the numbers the kernel checks.
        check_adam_hyperparameters(**{k: v for k, v in hyperparameters.items() if k != "adam_w_mode"})
