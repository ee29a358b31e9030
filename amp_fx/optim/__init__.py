"""Fused optimizers with FP32 master weights: `FusedAdam`, `FusedSGD`, and `master_params`.

>>> import torch, amp_fx
>>> model = torch.nn.Linear(4, 2).half()
>>> opt = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-3)
>>> [m.dtype for m in amp_fx.optim.master_params(opt)]
[torch.float32, torch.float32]
"""

from amp_fx.optim.fused_adam import FusedAdam
from amp_fx.optim.fused_optimizer import master_params
from amp_fx.optim.fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD", "master_params"]
