"""`FusedBatchNormAct`: a BatchNorm2d call, the residual add after it and the ReLU, as one module.

`amp_fx.passes.fuse_batch_norm` puts one in place of ``relu(bn(x))`` or ``relu(bn(x) + identity)``
(ResNet's pattern). It owns no parameters: it calls the BatchNorm module it replaces, which stays
where it was in the model (same state_dict keys, same train/eval switch, same buffers). In training
mode, on an input of at least `MIN_FUSED_ELEMENTS` elements, it runs `amp_fx.ops.norms.batch_norm_act`
(Triton kernels on channels_last inputs: fewer passes over the activations than cuDNN's BatchNorm
followed by separate add and ReLU kernels); otherwise, and for everything `batch_norm_act` does
not fuse, exactly what the three calls computed. The pass leaves BatchNorms and ReLU modules with
hooks unfused, and a BatchNorm given hooks later runs as a module (so they fire). It keeps calling
the BatchNorm2d object it was built with: replace modules (``nn.SyncBatchNorm.
convert_sync_batchnorm``, conv-BN folding) before ``amp_fx.convert``, not after.

    >>> bn = torch.nn.BatchNorm2d(8)
    >>> fused = FusedBatchNormAct(bn, "bn")
    >>> x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    >>> torch.allclose(fused(x), torch.relu(torch.nn.BatchNorm2d(8)(x)), atol=1e-6)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from amp_fx.ops.module_hooks import has_forward_hooks

__all__ = ["MIN_FUSED_ELEMENTS", "FusedBatchNormAct", "is_fusable_batch_norm"]

# An eager fused call costs the host about three times torch's BatchNorm + add + ReLU (Triton
# launches), and an eager ResNet-50 step at O2 is close to host-bound; the GPU time the kernels save
# grows with the activation. On an H200 (ResNet-50 shapes, batch 256, fp16, CUDA graphs,
# 2026-11-30) the fused call of a BN -> [add] -> ReLU chain took 0.78-0.81x torch's GPU time from
# 2**26 elements up, and below that 0.69-1.29x, a few microseconds either way, so smaller calls run
# torch's ops.
MIN_FUSED_ELEMENTS = 2**26


def is_fusable_batch_norm(module: nn.Module) -> bool:
    """True for a plain BatchNorm2d (not a subclass with its own forward, not SyncBatchNorm)."""
    return isinstance(module, nn.BatchNorm2d) and type(module).forward is nn.BatchNorm2d.forward


class FusedBatchNormAct(nn.Module):
    """``relu(batch_norm(x) [+ residual])`` through the BatchNorm2d module `batch_norm`.

    Args:
        batch_norm: the BatchNorm2d module; referenced, not registered (its owner keeps it).
        name: its qualified name in the model (for passes that plan its parameters' dtype).
        relu: apply ReLU after the (optional) residual add.
    """

    # The op `amp_fx.core.module_ops.module_op` names it by: the policy decides it as a BatchNorm.
    amp_fx_op = "batch_norm"

    def __init__(self, batch_norm: nn.BatchNorm2d, name: str, relu: bool = True) -> None:
        super().__init__()
        if not is_fusable_batch_norm(batch_norm):
            raise TypeError(
                f"FusedBatchNormAct needs an nn.BatchNorm2d with torch's forward, got "
                f"{type(batch_norm).__name__}; leave other norms unfused"
            )
        # A tuple hides the module from nn.Module's registration: no duplicate state_dict keys.
        self._batch_norm = (batch_norm,)
        self.batch_norm_name = name
        self.relu = relu

    @property
    def batch_norm(self) -> nn.BatchNorm2d:
        return self._batch_norm[0]

    def extra_repr(self) -> str:
        return f"{self.batch_norm_name}: {self.batch_norm.extra_repr()}, relu={self.relu}"

    def _momentum(self) -> float:
        # nn.BatchNorm2d.forward's exponential_average_factor, counting the batch as it does.
        bn = self.batch_norm
        if not (bn.training and bn.track_running_stats) or bn.num_batches_tracked is None:
            return 0.0 if bn.momentum is None else bn.momentum
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # cumulative moving average (a host read, as in torch)
            return 1.0 / float(bn.num_batches_tracked)
        return bn.momentum

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        bn = self.batch_norm
        if has_forward_hooks(bn):
            # Hooks registered after convert: the module itself runs, so that they fire.
            return self._add_and_relu(bn(x), residual)
        bn._check_input_dim(x)
        momentum = self._momentum()
        uses_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        tracked = not bn.training or bn.track_running_stats
        running_mean = bn.running_mean if tracked else None
        running_var = bn.running_var if tracked else None
        if uses_batch_stats and x.numel() >= MIN_FUSED_ELEMENTS:
            from amp_fx.ops.norms import batch_norm_act

            return batch_norm_act(
                x, bn.weight, bn.bias, running_mean, running_var, momentum, bn.eps, residual, self.relu
            )
        y = F.batch_norm(x, running_mean, running_var, bn.weight, bn.bias, uses_batch_stats, momentum, bn.eps)
        return self._add_and_relu(y, residual)

    def _add_and_relu(self, y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is not None:
            y = y + residual
        return F.relu(y) if self.relu else y
