"""Bytes a training step writes, counted op by op: a device-free measure of memory traffic.

Every op that reaches the dispatcher under `BytesWritten` adds the bytes of the tensors it writes:
its fresh outputs (allocations included: ``empty`` counts, so a Triton kernel counts through the
tensors its wrapper allocates) and the arguments it writes in place (``add_``, ``out=``, torch's
fused optimizers). Views write nothing and count nothing. Writes a kernel makes in place without
an op (a Triton kernel launched directly on existing tensors) are not seen: on the CPU amp_fx's
optimizers run their pure-torch reference, which is seen.

`training_step_bytes` counts one steady-state step (forward with the loss, backward, optimizer
step) of three ways to train a model in low precision: ``"autocast"`` (torch.autocast, fp32
weights, torch's fused AdamW), ``"low_precision"`` (the model ``.to(dtype)``, Apex's O3, no master
weights) and ``"O2"`` (``amp_fx.convert(model, "O2")``, amp_fx's FusedAdam with FP32 masters)::

    >>> import torch
    >>> with BytesWritten() as counted:
    ...     _ = torch.ones(4) + 1  # ones: 16 bytes, the sum: 16 more
    >>> counted.total
    32
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_fx.core.opt_levels import OPT_LEVELS, lookup_opt_level

__all__ = ["PHASES", "RECIPES", "BytesWritten", "StepBytes", "training_step_bytes"]

# The ways to train in low precision `training_step_bytes` compares (module docstring).
RECIPES = ("autocast", "low_precision", "O2")
# The parts of a step, in order.
PHASES = ("forward", "backward", "optimizer")


def _tensor_bytes(value: Any) -> int:
    """Bytes of a tensor or of the tensors in a list/tuple (a foreach op's arguments); 0 otherwise."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def written_bytes(func: torch._ops.OpOverload, args: tuple, kwargs: dict, outputs: Any) -> int:
    """Bytes one call of ``func`` writes: its arguments marked written in its schema (``Tensor(a!)``)
    and its returns that alias no argument. A return that aliases one is a view, or the written
    argument itself, counted once already.

    Example:
        >>> x = torch.zeros(3)
        >>> written_bytes(torch.ops.aten.add_.Tensor, (x, x), {}, x)
        12
    """
    schema = func._schema
    total = 0
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.name in kwargs:
            total += _tensor_bytes(kwargs[argument.name])
        elif position < len(args) and not argument.kwarg_only:
            total += _tensor_bytes(args[position])
    returned = outputs if isinstance(outputs, tuple) else (outputs,)
    for ret, value in zip(schema.returns, returned, strict=False):
        if ret.alias_info is None:
            total += _tensor_bytes(value)
    return total


class BytesWritten(TorchDispatchMode):
    """A dispatch mode summing the bytes every op writes (`written_bytes`): in total, by op name,
    by ``phase`` (set it between the parts of a step) and by op within each phase.

    Example:
        >>> with BytesWritten() as counted:
        ...     counted.phase = "forward"
        ...     y = torch.ones(2, dtype=torch.float16).float()
        >>> counted.by_phase["forward"], counted.by_op["aten._to_copy.default"]
        (12, 8)
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_op: Counter[str] = Counter()
        self.by_phase: Counter[str] = Counter()
        self.by_phase_op: dict[str, Counter[str]] = defaultdict(Counter)
        self.phase = "other"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        outputs = func(*args, **kwargs)
        count = written_bytes(func, args, kwargs, outputs) if isinstance(func, torch._ops.OpOverload) else 0
        self.total += count
        self.by_op[str(func)] += count
        self.by_phase[self.phase] += count
        self.by_phase_op[self.phase][str(func)] += count
        return outputs


@dataclass
class StepBytes:
    """Bytes one training step writes, by part of the step (`PHASES`), and by op within each part."""

    recipe: str
    forward: int
    backward: int
    optimizer: int
    by_op: dict[str, Counter[str]] = field(default_factory=dict)  # phase -> op name -> bytes

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.optimizer

    def op_bytes(self, op: str, phases: tuple[str, ...] = PHASES) -> int:
        """Bytes ``op`` (e.g. ``"aten._to_copy.default"``, the casts) writes in ``phases``."""
        return sum(self.by_op.get(phase, Counter())[op] for phase in phases)


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a model's call returned: a tensor, or a transformers output's ``.loss``."""
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if type(loss) is not torch.Tensor or loss.numel() != 1:
        raise ValueError(
            "training_step_bytes needs a model whose call returns its loss (a one-element tensor, "
            f"or an output with .loss, e.g. a transformers model given labels=); got {type(output).__name__}"
        )
    return loss


def _recipe_step(
    model: nn.Module, inputs: dict[str, Any], recipe: str, dtype: torch.dtype, lr: float
) -> tuple[Callable[[], torch.Tensor], torch.optim.Optimizer, Any]:
    """(forward returning the loss, optimizer, loss scaler or None) of ``recipe`` on a copy of ``model``."""
    device_type = next(model.parameters()).device.type
    fp16 = dtype == torch.float16
    if recipe in OPT_LEVELS:
        import amp_fx
        from amp_fx.optim import FusedAdam

        trained = amp_fx.convert(copy.deepcopy(model), recipe, dtype=dtype, device_type=device_type)
        masters = lookup_opt_level(recipe).keeps_fp32_masters
        optimizer: torch.optim.Optimizer = FusedAdam(trained.parameters(), lr=lr, master_weights=masters)
        return lambda: _loss_of(trained(**inputs)), optimizer, amp_fx.LossScaler(enabled=fp16)
    if recipe == "autocast":
        trained = copy.deepcopy(model)

        def forward() -> torch.Tensor:
            with torch.autocast(device_type, dtype=dtype):
                return _loss_of(trained(**inputs))

        scaler = torch.amp.GradScaler(device_type) if fp16 else None
    else:
        from amp_fx.testing.references import low_precision_copy

        trained = low_precision_copy(model, dtype, output_dtype=None)
        forward, scaler = (lambda: _loss_of(trained(**inputs))), None
    return forward, torch.optim.AdamW(trained.parameters(), lr=lr, fused=True), scaler


def training_step_bytes(
    model: nn.Module,
    inputs: dict[str, Any],
    recipe: str,
    dtype: torch.dtype = torch.bfloat16,
    lr: float = 1e-4,
) -> StepBytes:
    """Bytes one steady-state training step of ``model(**inputs)`` (its loss) writes under ``recipe``.

    One untimed step first creates the optimizer's state and captures amp_fx's graph; the second is
    counted. ``model`` is copied, never modified.

    Example:
        >>> import transformers
        >>> config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=8)
        >>> ids = torch.randint(0, 64, (1, 8))
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> training_step_bytes(model, {"input_ids": ids, "labels": ids}, "autocast").total > 0
        True
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: choose one of {', '.join(RECIPES)}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, not {dtype}")
    forward, optimizer, scaler = _recipe_step(model, inputs, recipe, dtype, lr)

    def step(counted: BytesWritten | None) -> None:
        def enter(phase: str) -> None:
            if counted is not None:
                counted.phase = phase

        optimizer.zero_grad(set_to_none=True)
        enter("forward")
        loss = forward()
        enter("backward")
        (loss if scaler is None else scaler.scale(loss)).backward()
        enter("optimizer")
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()

    step(None)
    with BytesWritten() as counted:
        step(counted)
    by_phase = counted.by_phase
    by_op = {phase: counted.by_phase_op[phase] for phase in PHASES}
    return StepBytes(recipe, by_phase["forward"], by_phase["backward"], by_phase["optimizer"], by_op)
