"""The optimizers on the Triton kernels: under TRITON_INTERPRET=1 on CPU (forced), and on CUDA.

Small runs only (the interpreter is slow): the same checks as the reference-path tests, plus the
launch count, which must not grow with the number of parameters.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx import LossScaler, clip_grad_norm_
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import tolerances

SHAPES = ((33,), (5, 7), (1,), (4, 4), (17,))
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16)


def _problem(device: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=generator) for s in SHAPES]
    params = [torch.nn.Parameter(v.to(device, d)) for v, d in zip(values, DTYPES, strict=True)]
    copies = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    return params, copies, generator


def _set_grads(params, copies, generator, scale: float) -> None:
    for param, copy in zip(params, copies, strict=True):
        grad = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
        copy.grad = grad.float()
        param.grad = (grad.float() * scale).to(param.dtype)


@pytest.mark.parametrize("unscale", [False, True], ids=["fast_path", "unscale_"])
@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_scaled_clipped_steps_match_torch_with_one_launch_per_step(triton_calls, device, name, unscale):
    params, copies, generator = _problem(device, seed=71)
    if name == "adam":
        optimizer = FusedAdam(params, lr=1e-2, weight_decay=0.01)
        reference = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.01)
    else:
        optimizer = FusedSGD(params, lr=0.05, momentum=0.9, nesterov=True)
        reference = torch.optim.SGD(copies, lr=0.05, momentum=0.9, nesterov=True)
    scaler = LossScaler(init_scale=256.0)
    steps = 3
    for _ in range(steps):
        scaler.scale(torch.zeros((), device=device))
        _set_grads(params, copies, generator, scale=256.0)
        if unscale:
            scaler.unscale_(optimizer)
        norm = clip_grad_norm_(optimizer, max_norm=2.0)
        expected_norm = torch.nn.utils.clip_grad_norm_(copies, max_norm=2.0)
        scaler.step(optimizer)
        scaler.update()
        reference.step()
        torch.testing.assert_close(norm.cpu(), expected_norm.cpu(), rtol=1e-5, atol=1e-6)
    rtol, atol = tolerances(torch.float32)
    for master, copy in zip(master_params(optimizer), copies, strict=True):
        torch.testing.assert_close(master.cpu(), copy.detach().cpu(), rtol=rtol, atol=atol)
    kernel = "adam_step_" if name == "adam" else "sgd_step_"
    # One update call per step for all five params of three dtypes, plus the overflow check and clip's
    # norm, and the scaler's one update of its scale per step.
    assert triton_calls == {
        kernel: steps,
        "check_finite_and_norm_": 2 * steps,
        "update_loss_scale_": steps,
        "advance_step_": 2 * steps,
    }


def test_overflow_skips_bit_identically(triton_calls, optimizer_snapshot, device) -> None:
    snapshot, assert_unchanged = optimizer_snapshot
    params, copies, generator = _problem(device, seed=73)
    optimizer = FusedAdam(params, lr=1e-2)
    scaler = LossScaler(init_scale=64.0)
    scaler.scale(torch.zeros((), device=device))
    _set_grads(params, copies, generator, scale=64.0)
    scaler.step(optimizer)
    scaler.update()
    before = snapshot(optimizer)
    scaler.scale(torch.zeros((), device=device))
    _set_grads(params, copies, generator, scale=64.0)
    params[3].grad[1, 2] = float("nan")
    scaler.step(optimizer)
    scaler.update()
    assert_unchanged(before, snapshot(optimizer))
    assert scaler.get_scale() == 32.0
    assert triton_calls["adam_step_"] == 2
