"""CudaGraphStep: a whole mixed-precision training step captured once in a CUDA graph, then replayed.

A training step of an O2 model is hundreds of small kernel launches (casts, LayerNorms, the
optimizer's launches, the scaler's update); on a fast GPU the host can fall behind the device.
amp_fx's step never reads a device value on the host (the loss scaler decides on the device; the
fused optimizers skip an overflowing step inside their kernels), so the whole step — forward, loss,
scaled backward, optional clipping, optimizer step and scaler update — can be captured into one
CUDA graph and replayed with a single launch.

Each call of a `CudaGraphStep` is one training step on the batch it is given:

- the first ``warmup_steps`` calls run eagerly on a side stream (CUDA graphs need the lazily
  created state — cuBLAS workspaces, Triton kernels, the scaler's tensors — to exist first);
- the next call copies its batch into static input buffers, captures the step and replays it;
- every later call copies its batch into those buffers and replays the graph.

So a training loop does not change, and replaying gives the same weights as running eagerly.
With ``enabled=False`` every call runs eagerly (the same code path), so one program runs with
and without graphs, on CPU too.

What capture implies (as for any CUDA graph):

- batches keep the shape, dtype and device of the captured one (pad the last batch, or drop it);
- Python numbers are baked in: an optimizer's ``lr``, ``max_grad_norm``. After changing a
  hyperparameter (a learning-rate schedule), call `reset_graph` and the next call captures again;
- grads are zeroed in place (``zero_grad(set_to_none=False)``), so their memory, and the fused
  optimizers' cached pointer tables, stay where warm-up put them;
- ``torch.autocast`` inside ``loss_fn`` needs ``cache_enabled=False`` (autocast's weight cache
  does not survive capture); amp_fx-converted models need no autocast;
- the returned loss is a copy, safe to keep; reading it (``.item()``) syncs, so log every N steps.

Example:
    >>> import torch, amp_fx
    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> model = amp_fx.convert(torch.nn.Linear(8, 2).to(device), "O2", dtype=torch.float16)
    >>> opt = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-3)
    >>> def loss_fn(x, y):
    ...     return torch.nn.functional.cross_entropy(model(x), y)
    >>> step = CudaGraphStep(loss_fn, opt, amp_fx.LossScaler(), enabled=device == "cuda")
    >>> for _ in range(5):  # 3 eager warm-up steps, then capture + replay, then replay
    ...     loss = step(torch.randn(16, 8, device=device), torch.randint(0, 2, (16,), device=device))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["CudaGraphStep"]


class ScalerProtocol(Protocol):
    """What a step needs from a loss scaler: `amp_fx.LossScaler` or ``torch.amp.GradScaler``."""

    def scale(self, outputs: Tensor) -> Tensor: ...

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...

    def step(self, optimizer: torch.optim.Optimizer) -> Any: ...

    def update(self) -> None: ...


class CudaGraphStep:
    """A training step (forward, loss, scaled backward, optimizer step, scaler update) as a CUDA graph.

    Args:
        loss_fn: ``loss_fn(*batch) -> loss``: runs the model on the batch and returns a scalar loss.
        optimizer: the optimizer of the model's parameters; with graphs, one that never syncs with
            the host (`amp_fx.optim.FusedAdam`/`FusedSGD`, or torch's with ``capturable=True``).
        scaler: `amp_fx.LossScaler`, ``torch.amp.GradScaler`` or None (bf16 needs no scaling).
        warmup_steps: eager steps before the capture (>= 1).
        max_grad_norm: clip the unscaled grads to this total 2-norm with `amp_fx.clip_grad_norm_`
            (None: no clipping).
        enabled: False runs every step eagerly, with the same code as the captured step.

    Example:
        >>> import torch, amp_fx
        >>> model = amp_fx.convert(torch.nn.Linear(4, 4), "O2", dtype=torch.bfloat16)
        >>> opt = amp_fx.optim.FusedSGD(model.parameters(), lr=0.1)
        >>> step = CudaGraphStep(lambda x: model(x).square().mean(), opt, enabled=False)
        >>> step(torch.ones(2, 4)).shape
        torch.Size([])
    """

    def __init__(
        self,
        loss_fn: Callable[..., Tensor],
        optimizer: torch.optim.Optimizer,
        scaler: ScalerProtocol | None = None,
        *,
        warmup_steps: int = 3,
        max_grad_norm: float | None = None,
        enabled: bool = True,
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a callable loss_fn(*batch) -> loss, got {type(loss_fn).__name__}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer (e.g. amp_fx.optim.FusedAdam), "
                f"got {type(optimizer).__name__}"
            )
        if scaler is not None and not all(
            hasattr(scaler, m) for m in ("scale", "unscale_", "step", "update")
        ):
            raise TypeError(
                "scaler must be an amp_fx.LossScaler or torch.amp.GradScaler (or None), "
                f"got {type(scaler).__name__}"
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be an int >= 1 (CUDA graphs capture only after an eager step), "
                f"got {warmup_steps!r}"
            )
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, (int, float))
            or max_grad_norm <= 0
        ):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        self._device = _cuda_device_of(optimizer) if enabled else None
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scaler = scaler
        self.warmup_steps = warmup_steps
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.enabled = enabled
        self.steps_taken = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_inputs: list[Tensor] = []
        self._static_loss: Tensor | None = None
        self._side_stream: torch.cuda.Stream | None = None

    @property
    def captured(self) -> bool:
        """True once the step has been captured; later calls replay it."""
        return self._graph is not None

    def reset_graph(self) -> None:
        """Drop the captured graph: the next call captures again (after changing ``lr``, for example).

        No warm-up is repeated: the state it created still exists.
        """
        self._graph = None
        self._static_inputs = []
        self._static_loss = None

    def __call__(self, *batch: Tensor) -> Tensor:
        """Run one training step on ``batch``; return the loss (a detached, unscaled copy)."""
        for i, value in enumerate(batch):
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"CudaGraphStep takes tensors only (a graph replays fixed buffers); argument {i} is "
                    f"{type(value).__name__}: bind it into loss_fn instead"
                )
        if not self.enabled:
            loss = self._run_step(batch)
        elif self._graph is not None:
            loss = self._replay(batch)
        elif self.steps_taken < self.warmup_steps:
            loss = self._warm_up(batch)
        else:
            loss = self._capture_and_replay(batch)
        self.steps_taken += 1
        return loss

    # ----------------------------------------------------------------------------------------

    def _run_step(self, batch: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
        """The step itself, identical eagerly and under capture."""
        optimizer, scaler = self.optimizer, self.scaler
        optimizer.zero_grad(set_to_none=False)
        loss = self.loss_fn(*batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(
                "loss_fn must return a one-element loss tensor, got "
                + (f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__)
            )
        (loss if scaler is None else scaler.scale(loss)).backward()
        if self.max_grad_norm is not None:
            from amp_fx.training.clip_grad import clip_grad_norm_
            from amp_fx.training.loss_scaler import LossScaler

            if isinstance(scaler, LossScaler):  # the fast path: 1 / scale and the clip in the kernel
                clip_grad_norm_(optimizer, self.max_grad_norm, scaler=scaler)
            else:
                if scaler is not None:
                    scaler.unscale_(optimizer)
                clip_grad_norm_(optimizer, self.max_grad_norm)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    def _warm_up(self, batch: tuple[Tensor, ...]) -> Tensor:
        # On a side stream, as torch.cuda.graphs' recipe does, so that nothing the warm-up leaves
        # queued on the default stream ends up in the capture.
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self._device)
        current = torch.cuda.current_stream(self._device)
        self._side_stream.wait_stream(current)
        with torch.cuda.device(self._device), torch.cuda.stream(self._side_stream):
            loss = self._run_step(batch)
        current.wait_stream(self._side_stream)
        return loss

    def _capture_and_replay(self, batch: tuple[Tensor, ...]) -> Tensor:
        self._static_inputs = [value.detach().to(self._device, copy=True) for value in batch]
        graph = torch.cuda.CUDAGraph()
        logger.info("capturing the training step in a CUDA graph (%d inputs)", len(batch))
        with torch.cuda.device(self._device), torch.cuda.graph(graph):
            self._static_loss = self._run_step(self._static_inputs)
        self._graph = graph
        graph.replay()
        return self._static_loss.clone()

    def _replay(self, batch: tuple[Tensor, ...]) -> Tensor:
        if len(batch) != len(self._static_inputs):
            raise ValueError(
                f"the step was captured with {len(self._static_inputs)} inputs but got {len(batch)}; pass "
                "the same arguments every step"
            )
        for i, (static, value) in enumerate(zip(self._static_inputs, batch, strict=True)):
            if value.shape != static.shape or value.dtype != static.dtype:
                raise ValueError(
                    f"input {i} has shape {tuple(value.shape)} and dtype {value.dtype}, but the step was "
                    f"captured with {tuple(static.shape)} and {static.dtype}: a CUDA graph replays fixed "
                    "shapes. Pad the batch (or use drop_last=True), or call reset_graph() to capture again"
                )
        # Copied only once all inputs passed the checks: a refused batch leaves the buffers as they were.
        for static, value in zip(self._static_inputs, batch, strict=True):
            static.copy_(value, non_blocking=True)
        self._graph.replay()
        return self._static_loss.clone()


def _cuda_device_of(optimizer: torch.optim.Optimizer) -> torch.device:
    """The one CUDA device holding all of ``optimizer``'s parameters; ValueError otherwise."""
    devices = {p.device for group in optimizer.param_groups for p in group["params"]}
    if not devices:
        raise ValueError("the optimizer has no parameters")
    off_cuda = sorted(str(d) for d in devices if d.type != "cuda")
    if off_cuda:
        reason = "" if torch.cuda.is_available() else " (this machine has no CUDA device)"
        raise ValueError(
            f"CUDA graphs need the parameters on a CUDA device, but some are on {off_cuda}{reason}; move "
            "the model with .cuda() before creating the optimizer, or pass enabled=False to run the same "
            "step eagerly"
        )
    if len(devices) > 1:
        raise ValueError(
            f"one CUDA graph runs on one device, but the parameters are on {sorted(map(str, devices))}; "
            "use one CudaGraphStep per device"
        )
    return devices.pop()
