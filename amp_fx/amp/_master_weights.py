"""What `amp.initialize` does to an optimizer: FP32 master weights and loss-scale bookkeeping.

Three kinds of optimizer, chosen by `optimizer_kind`, each handled by its own `AmpOptimizer`
subclass in its own module; `install_amp_optimizer` is the factory that picks it:

- FUSED (`FusedAmpOptimizer`): `amp_fx.optim.FusedAdam` / `FusedSGD` keep the FP32 masters in
  their own state and take the loss scale as a pending grad multiplier (the `ScaledOptimizer`
  handshake, `amp_fx.optim.scaled_optimizer`, as under `amp_fx.LossScaler`): the model grads stay
  scaled, the kernel unscales, checks and skips on the device. The fast path.
- MASTERS (`MasterWeightsAmpOptimizer`): any other torch.optim optimizer when the opt level asks
  for master weights (O2): its param groups are pointed at FP32 copies of the model's
  low-precision parameters. After each backward the fp16/bf16 grads are unscaled into the
  masters' FP32 grads (so grads of several losses with different scales add up exactly, as in
  Apex); ``step`` updates the masters and copies them back into the model.
- DIRECT (`DirectAmpOptimizer`): any other optimizer without master weights (O0, O1, O3): it
  updates the model's parameters; grads are unscaled in place after each backward, as in Apex.

For the MASTERS and DIRECT kinds a skipped step needs the overflow flag on the host, unless the
optimizer reads ``found_inf`` itself (``_step_supports_amp_scaling``, e.g. torch's
``Adam(fused=True)``): this is the one sync per step that torch.amp.GradScaler also pays for
such optimizers. The FUSED kind never syncs. Unscaling and skipping are `amp_fx.LossScaler`'s own code
(`amp_fx.optim.torch_optimizer_scaling`).

The optimizer object stays what it was (an LR scheduler, ``isinstance`` checks and ``param_groups``
keep working); ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict`` and ``add_param_group``
are replaced on the instance by bound methods that go through its `AmpOptimizer`
(`amp_optimizer_of`). The MASTERS kind's state dict carries the masters (key
``"amp_fx_master_params"``), so a resumed run continues bit for bit::

    >>> import torch
    >>> model = torch.nn.Linear(2, 2).half()
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> amp_opt = install_amp_optimizer(opt, OptimizerKind.MASTERS)
    >>> [p.dtype for p in opt.param_groups[0]["params"]]
    [torch.float32, torch.float32]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp._amp_optimizer import (
    MASTERS_KEY,
    PATCHED_METHODS,
    AmpOptimizer,
    OptimizerKind,
    amp_optimizer_of,
    optimizer_kind,
)
from amp_fx.amp._direct_optimizer import DirectAmpOptimizer
from amp_fx.amp._fused_optimizer import FusedAmpOptimizer
from amp_fx.amp._masters_optimizer import MasterWeightsAmpOptimizer

__all__ = [
    "MASTERS_KEY",
    "PATCHED_METHODS",
    "STRATEGIES",
    "AmpOptimizer",
    "DirectAmpOptimizer",
    "FusedAmpOptimizer",
    "MasterWeightsAmpOptimizer",
    "OptimizerKind",
    "amp_optimizer_of",
    "install_amp_optimizer",
    "optimizer_kind",
]

# The strategy for each kind.
STRATEGIES: dict[OptimizerKind, type[AmpOptimizer]] = {
    strategy.kind: strategy for strategy in (FusedAmpOptimizer, MasterWeightsAmpOptimizer, DirectAmpOptimizer)
}


def install_amp_optimizer(
    optimizer: torch.optim.Optimizer,
    kind: OptimizerKind,
    param_map: Callable[[Tensor], Tensor] = lambda p: p,
    session: Any = None,
    master_weights: bool | None = None,
) -> AmpOptimizer:
    """The factory: install `kind`'s strategy on `optimizer` (see `AmpOptimizer.install`).

    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).half().parameters(), lr=0.1)
    >>> type(install_amp_optimizer(opt, OptimizerKind.DIRECT)).__name__
    'DirectAmpOptimizer'
    """
    return STRATEGIES[kind].install(optimizer, param_map, session, master_weights)
