"""Parameters whose grads come late or now and then step as torch.optim steps them.

torch.optim counts steps per parameter: a layer frozen and then unfrozen, or a branch unused at
first, starts Adam's bias correction at t = 1 and SGD's momentum buffer at its first grad (no
dampening); a step in which a parameter has no grad does not count for it. The fused optimizers
count per group and keep per-parameter offsets (``state[p]["step_offset"]``); these tests run both
side by side on such parameters, on the reference path and on the Triton kernels (forced on CPU
under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from amp_fx import LossScaler
from amp_fx.optim import FusedAdam, FusedSGD
from amp_fx.testing import rounding_tolerances

STEPS = 20
SHAPES = ((5, 7), (33,), (3,), (2, 3, 4))


def has_grad(index: int, step: int) -> bool:
    """Which params get a grad at ``step``: always; frozen, then unfrozen; unused until late; now and then."""
    return (True, step >= 7, step >= 12, step % 3 != 1)[index]


OPTIMIZERS = {
    "adam": (
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
        lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.01, adam_w_mode=False),
    ),
    "adamw": (
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
        lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1, adam_w_mode=True),
    ),
    "sgd": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-3),
        lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-3),
    ),
    "nesterov": (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    ),
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor], step: int) -> None:
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        param.grad = grad.clone() if has_grad(i, step) else None


def _grads(generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(s, generator=generator) for s in SHAPES]


def _assert_match(fused: list[torch.Tensor], expected: list[torch.Tensor], step: int) -> None:
    # Within fp32 rounding, not bit for bit: torch.optim fuses multiply-adds (add_ with alpha) and
    # computes Adam's bias corrections in Python doubles; the fused kernels round each fp32 op.
    # A wrong count is far outside this (a momentum buffer off by the dampening, a bias correction
    # off by a factor of up to 10).
    rtol, atol = rounding_tolerances(torch.float32)
    for i, (got, want) in enumerate(zip(fused, expected, strict=True)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"step {step}, param {i}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_late_and_intermittent_grads_match_torch(name: str, kernels: str) -> None:
    make_torch, make_fused = OPTIMIZERS[name]
    params, twins = _params(), _params()
    fused, reference = make_fused(params), make_torch(twins)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = _grads(generator)
        _set_grads(params, grads, step)
        _set_grads(twins, grads, step)
        fused.step()
        reference.step()
        _assert_match([p.detach() for p in params], [t.detach() for t in twins], step)
    if name.startswith("adam"):
        # The per-parameter counts: the group's count minus each offset, as torch's state[p]["step"].
        group_step = fused.param_groups[0]["step"].reshape(())
        for param, twin in zip(params, twins, strict=True):
            own = group_step - fused.state[param]["step_offset"]
            assert own.item() == reference.state[twin]["step"].item()


def test_skipped_steps_leave_offsets_unchanged() -> None:
    """An overflow step counts for nobody: the group count and every offset keep their bits."""
    params = _params()
    optimizer = FusedAdam(params, lr=0.01)
    scaler = LossScaler(init_scale=2.0**4)
    generator = torch.Generator().manual_seed(2)
    for step in range(4):
        scaler.scale(torch.zeros(()))  # the grads below stand for this loss's, unscaled by 1 / 16
        _set_grads(params, _grads(generator), step)
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    before = {i: optimizer.state[p]["step_offset"].clone() for i, p in enumerate(params) if has_grad(i, 0)}
    group_step = optimizer.param_groups[0]["step"].clone()
    grads = _grads(generator)
    grads[0][0, 0] = float("inf")
    scaler.scale(torch.zeros(()))
    _set_grads(params, grads, 4)  # param 3 has no grad at step 4
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(optimizer.param_groups[0]["step"], group_step)
    for i, offset in before.items():
        assert torch.equal(optimizer.state[params[i]]["step_offset"], offset), i


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_checkpoint_keeps_per_parameter_counts(name: str) -> None:
    """Save mid-run (a param idle, one not yet started), load into a fresh optimizer, run on: the
    result is the uninterrupted run's."""
    _, make_fused = OPTIMIZERS[name]
    params, resumed_params = _params(), _params()
    optimizer = make_fused(params)
    generator = torch.Generator().manual_seed(3)
    grads_per_step = [_grads(generator) for _ in range(STEPS)]
    for step in range(10):
        _set_grads(params, grads_per_step[step], step)
        optimizer.step()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for resumed, param in zip(resumed_params, params, strict=True):
            resumed.copy_(param)
    resumed_optimizer = make_fused(resumed_params)
    resumed_optimizer.load_state_dict(torch.load(buffer, weights_only=True))
    for step in range(10, STEPS):
        for ps, opt in ((params, optimizer), (resumed_params, resumed_optimizer)):
            _set_grads(ps, grads_per_step[step], step)
            opt.step()
    for param, resumed in zip(params, resumed_params, strict=True):
        assert torch.equal(param, resumed)


def test_checkpoint_without_offsets_loads_with_the_group_count() -> None:
    """A state dict saved before per-parameter offsets existed: every param counts the group's steps."""
    params, twins = _params(), _params()
    optimizer, twin_optimizer = FusedAdam(params, lr=0.01), FusedAdam(twins, lr=0.01)
    generator = torch.Generator().manual_seed(4)
    grads = _grads(generator)
    for ps, opt in ((params, optimizer), (twins, twin_optimizer)):
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        opt.step()
    old = copy.deepcopy(optimizer.state_dict())
    for state in old["state"].values():
        del state["step_offset"]
    twin_optimizer.load_state_dict(old)
    assert all(float(twin_optimizer.state[t]["step_offset"]) == 0.0 for t in twins)


def test_corrupt_offset_is_refused_before_anything_changes() -> None:
    params = _params()
    optimizer = FusedAdam(params, lr=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"][0]["step_offset"] = torch.tensor(5.0)
    before = optimizer.state_dict()["state"][0]["step_offset"].clone()
    with pytest.raises(ValueError, match="'step_offset' \\(5\\) exceeds its param group's 'step' \\(1\\)"):
        optimizer.load_state_dict(saved)
    assert torch.equal(optimizer.state[params[0]]["step_offset"], before)
