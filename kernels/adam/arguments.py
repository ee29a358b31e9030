"""Adam's hyperparameter checks and the one helper both implementations share (``log_beta``)."""

from __future__ import annotations

import math

from amp_fx.kernels.arguments import check_range

__all__ = ["check_adam_hyperparameters", "log_beta"]


def log_beta(beta: float) -> float:
    """ln(beta), with beta = 0 mapped to -inf so that 1 - beta**t = -expm1(t * ln(beta)) = 1."""
    return math.log(beta) if beta > 0 else -math.inf


def check_adam_hyperparameters(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> None:
    """Raise ValueError for hyperparameters torch.optim.Adam would refuse."""
    check_range("lr", lr, 0.0, float("inf"))
    check_range("beta1", beta1, 0.0, 1.0)
    check_range("beta2", beta2, 0.0, 1.0)
    check_range("eps", eps, 0.0, float("inf"))
    check_range("weight_decay", weight_decay, 0.0, float("inf"))
