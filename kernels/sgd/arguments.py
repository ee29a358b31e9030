"""SGD's hyperparameter checks, shared by the reference and the Triton kernel."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from amp_fx.kernels.arguments import check_range

__all__ = ["check_sgd_hyperparameters"]


def check_sgd_hyperparameters(
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    momentum_buffers: Sequence[Tensor] | None,
) -> None:
    """Raise ValueError for hyperparameters torch.optim.SGD would refuse, or missing momentum buffers."""
    check_range("lr", lr, 0.0, float("inf"))
    check_range("momentum", momentum, 0.0, float("inf"))
    check_range("weight_decay", weight_decay, 0.0, float("inf"))
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires momentum > 0 and dampening == 0")
    if momentum != 0.0 and momentum_buffers is None:
        raise ValueError(
            "momentum != 0 needs momentum_buffers (fp32, torch.zeros_like(param, dtype=torch.float32))"
        )
