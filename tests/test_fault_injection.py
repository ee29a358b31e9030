"""Seeded fault injection: inf, -inf and NaN in random losses and gradients are silently harmless.

Over STEPS training steps of a tiny fp16 model, a `random.Random(seed)` plan writes inf, -inf or
NaN into the loss (the loss times the poison: every grad becomes non-finite) or into one element
of one grad after backward, at O1, O2 and O3, with FusedAdam and FusedSGD under `amp_fx.LossScaler`
and with torch.optim.AdamW under `amp_fx.amp`. The contracts:

- an injected step changes nothing but the loss scale: weights, FP32 masters, moments and step
  counts are bit-identical before and after (the whole model and optimizer state is compared);
- no non-finite value ever reaches a weight or a master;
- the scale sequence is exactly torch.amp.GradScaler's rule (`gradscaler_rule`, itself checked
  against torch's `_amp_update_scale_`) with the scaler's own configuration;
- the final weights and optimizer state equal, bit for bit, those of a run that left the injected
  batches out. That run replays the scale each kept batch had: a loss scale is a power of two, so
  it changes no fp16 value except where a scaled grad is subnormal, and the run without halvings
  would otherwise reach other scales (a difference of the scale, not of the skipped step).

Step 0 is never injected: a parameter's first step creates its moments before the device knows
whether the step overflows (tests/optim's snapshot documents that exception).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx import amp
from tests.bit_equality import bits_equal

STEPS = 200
INJECT_PROBABILITY = 0.08
POISONS = (math.inf, -math.inf, math.nan)
IN_FEATURES, HIDDEN, CLASSES, BATCH = 8, 16, 4, 8
DTYPE = torch.float16
OPT_LEVELS = ("O1", "O2", "O3")
# Growth about as often as the faults back off, so that the scale neither overflows fp16 grads
# nor sinks far below 1 over STEPS steps.
NATIVE_INIT_SCALE, NATIVE_GROWTH_INTERVAL = 2.0**8, 12
AMP_INIT_SCALE = 2.0**12  # amp's scaler starts at min(2**16, max_loss_scale) and grows every 2000 steps


@dataclass(frozen=True)
class Fault:
    """Where a poison goes: "loss" (multiplies the loss) or "grad" (one element of one grad)."""

    target: str
    value: float
    param_index: int = 0
    element: float = 0.0  # position in the grad, as a fraction of its size


def fault_plan(seed: int, steps: int, num_params: int) -> list[Fault | None]:
    """The fault (or None) of each step, drawn from ``random.Random(seed)``; step 0 stays clean."""
    rng = random.Random(seed)
    plan: list[Fault | None] = [None]
    for _ in range(1, steps):
        if rng.random() >= INJECT_PROBABILITY:
            plan.append(None)
            continue
        target = rng.choice(("loss", "grad"))
        plan.append(Fault(target, rng.choice(POISONS), rng.randrange(num_params), rng.random()))
    return plan


def gradscaler_rule(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    overflows: list[bool],
) -> list[float]:
    """torch.amp.GradScaler's scale after each step: back off on overflow, grow after
    ``growth_interval`` consecutive clean steps (any overflow restarts the count)."""
    scale, clean_steps, scales = init_scale, 0, []
    for overflow in overflows:
        if overflow:
            scale, clean_steps = scale * backoff_factor, 0
        else:
            clean_steps += 1
            if clean_steps == growth_interval:
                scale, clean_steps = scale * growth_factor, 0
        scales.append(scale)
    return scales


def test_gradscaler_rule_is_torchs() -> None:
    overflows = [bool(b) for b in torch.randint(0, 2, (60,), generator=torch.Generator().manual_seed(5))]
    overflows[10:30] = [False] * 20  # long enough runs of clean steps to grow
    scale, tracker = torch.full((), 2.0**8), torch.zeros((), dtype=torch.int32)
    expected = []
    for overflow in overflows:
        torch._amp_update_scale_(scale, tracker, torch.full((), float(overflow)), 2.0, 0.5, 3)
        expected.append(scale.item())
    assert gradscaler_rule(2.0**8, 2.0, 0.5, 3, overflows) == expected
    assert len(set(expected)) > 3, "the sequence must both grow and back off"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.LayerNorm(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number `step`, the same tensors every time it is asked for."""
    generator = torch.Generator().manual_seed(10_000 + step)
    inputs = torch.randn(BATCH, IN_FEATURES, generator=generator)
    return inputs, torch.randint(0, CLASSES, (BATCH,), generator=generator)


def loss_of(model: nn.Module, step: int, fault: Fault | None) -> torch.Tensor:
    inputs, targets = batch(step)
    loss = F.cross_entropy(model(inputs).float(), targets)
    return loss * fault.value if fault is not None and fault.target == "loss" else loss


def poison_grad(params: list[torch.Tensor], fault: Fault | None) -> None:
    if fault is None or fault.target != "grad":
        return
    grad = params[fault.param_index].grad
    with torch.no_grad():
        grad.view(-1)[int(fault.element * grad.numel())] = fault.value


def all_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the training state: the model's, each param group's, each optimizer state's
    (FP32 masters, moments, step counts)."""
    for name, tensor in model.state_dict().items():
        yield f"model {name}", tensor
    for g, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                yield f"group {g} {key}", value
        for i, param in enumerate(group["params"]):
            yield f"group {g} param {i}", param
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    yield f"group {g} param {i} {key}", value


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in all_tensors(model, optimizer)}


def assert_bits_equal(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], what: str) -> None:
    assert before.keys() == after.keys(), what
    for name, old in before.items():
        assert bits_equal(old, after[name]), f"{what}: {name} changed"


def assert_all_finite(model: nn.Module, optimizer: torch.optim.Optimizer, what: str) -> None:
    for name, tensor in all_tensors(model, optimizer):
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), f"{what}: {name} holds a non-finite value"


@dataclass
class Run:
    """What a training run leaves: the scale each step used and after each step, the final state."""

    used_scales: list[float] = field(default_factory=list)
    scales_after: list[float] = field(default_factory=list)
    final: dict[str, torch.Tensor] = field(default_factory=dict)


# A trainer runs ``steps`` (batch numbers) with their faults; ``replay`` (batch number -> scale)
# sets the scale before each step instead of letting the scaler choose it.
Faults = list[Fault | None]
Replay = dict[int, float] | None
Trainer = Callable[[str, list[int], Faults, Replay], Run]


def train_native(optimizer_name: str) -> Trainer:
    def train(opt_level: str, steps: list[int], faults: Faults, replay: Replay) -> Run:
        model = amp_fx.convert(make_model(), opt_level, dtype=DTYPE)
        params = list(model.parameters())
        if optimizer_name == "FusedAdam":
            optimizer = amp_fx.optim.FusedAdam(params, lr=1e-2, weight_decay=0.01)
        else:
            optimizer = amp_fx.optim.FusedSGD(params, lr=0.05, momentum=0.9)
        scaler = amp_fx.LossScaler(init_scale=NATIVE_INIT_SCALE, growth_interval=NATIVE_GROWTH_INTERVAL)
        factors = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_hysteresis())
        assert factors == (2.0, 0.5, 1), "the expected scales below assume GradScaler's factors"
        assert scaler.get_min_scale() is None and scaler.get_max_scale() > NATIVE_INIT_SCALE * 2.0**10
        run = Run()
        for position, (step, fault) in enumerate(zip(steps, faults, strict=True)):
            optimizer.zero_grad(set_to_none=True)
            scaled = scaler.scale(loss_of(model, step, fault))
            run.used_scales.append(scaler.get_scale())
            before = snapshot(model, optimizer) if fault is not None else None
            scaled.backward()
            poison_grad(params, fault)
            scaler.step(optimizer)
            next_step = steps[position + 1] if position + 1 < len(steps) else None
            scaler.update(None if replay is None or next_step is None else replay[next_step])
            run.scales_after.append(scaler.get_scale())
            check_step(model, optimizer, before, f"{opt_level} {optimizer_name} step {step} ({position})")
        run.final = snapshot(model, optimizer)
        return run

    return train


def train_amp(opt_level: str, steps: list[int], faults: Faults, replay: Replay) -> Run:
    model = make_model()
    # eps=1e-4: at O3 AdamW updates the fp16 weights themselves, and its default eps (1e-8) is 0 in
    # fp16, so an underflowed second moment would divide by zero on a clean step.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-4)
    # O3's default is a static scale of 1, which Apex (and amp_fx) never skips on: ask for dynamic.
    model, optimizer = amp.initialize(
        model,
        optimizer,
        opt_level=opt_level,
        loss_scale="dynamic",
        max_loss_scale=AMP_INIT_SCALE,
        verbosity=0,
    )
    params = list(model.parameters())
    run = Run()
    for position, (step, fault) in enumerate(zip(steps, faults, strict=True)):
        if replay is not None:
            amp.load_state_dict({"loss_scaler0": {"loss_scale": replay[step], "unskipped": 0}})
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, step, fault)
        run.used_scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        before = snapshot(model, optimizer) if fault is not None else None
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
            poison_grad(params, fault)
        optimizer.step()
        run.scales_after.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        check_step(model, optimizer, before, f"amp {opt_level} AdamW step {step} ({position})")
    run.final = snapshot(model, optimizer)
    return run


def check_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, before: dict[str, torch.Tensor] | None, what: str
) -> None:
    if before is not None:
        assert_bits_equal(before, snapshot(model, optimizer), f"injected {what}")
    assert_all_finite(model, optimizer, what)


CASES: dict[str, tuple[Trainer, float, int]] = {
    # name: (trainer, initial scale, growth interval)
    "FusedAdam": (train_native("FusedAdam"), NATIVE_INIT_SCALE, NATIVE_GROWTH_INTERVAL),
    "FusedSGD": (train_native("FusedSGD"), NATIVE_INIT_SCALE, NATIVE_GROWTH_INTERVAL),
    "amp-AdamW": (train_amp, AMP_INIT_SCALE, 2000),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_injected_faults_are_skipped_without_a_trace(case: str, opt_level: str) -> None:
    trainer, init_scale, growth_interval = CASES[case]
    seed = 1000 * OPT_LEVELS.index(opt_level) + sorted(CASES).index(case)
    num_params = len(list(make_model().parameters()))
    plan = fault_plan(seed, STEPS, num_params)
    injected = [fault is not None for fault in plan]
    assert 5 <= sum(injected) <= STEPS // 4
    assert {f.target for f in plan if f} == {"loss", "grad"}

    run = trainer(opt_level, list(range(STEPS)), plan, None)
    assert run.scales_after == gradscaler_rule(init_scale, 2.0, 0.5, growth_interval, injected)
    assert run.used_scales == [init_scale, *run.scales_after[:-1]]
    if growth_interval < STEPS:
        grew = [after > used for used, after in zip(run.used_scales, run.scales_after, strict=True)]
        assert any(grew), "the plan left no run of clean steps long enough to grow the scale"

    kept = [step for step, fault in enumerate(plan) if fault is None]
    reference = trainer(opt_level, kept, [None] * len(kept), {s: run.used_scales[s] for s in kept})
    assert reference.used_scales == [run.used_scales[s] for s in kept]
    assert_bits_equal(reference.final, run.final, "the run with faults against the run without their batches")
