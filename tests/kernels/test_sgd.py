"""The SGD kernel: Triton against the reference, the reference against torch.optim.SGD on fp32
tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from tests.kernels.optimizer_problems import (
    KERNEL_DTYPES,
    SMALL,
    assert_matches_reference,
    clone_problem,
    fp32_problem,
    launch_config,
    make_problem,
    multiplier_strategy,
    scalar,
    sgd_arguments,
    sizes_strategy,
    step_strategy,
)


@given(
    sizes=sizes_strategy,
    data=st.data(),
    lr=st.floats(1e-4, 1e-1),
    momentum_setting=st.sampled_from(
        [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.0, True), (0.5, 0.3, False)]
    ),
    weight_decay=st.sampled_from([0.0, 0.01]),
    multiplier=multiplier_strategy,
    step_value=step_strategy,
    seed=st.integers(0, 2**16),
)
def test_sgd_matches_reference(
    device, sizes, data, lr, momentum_setting, weight_decay, multiplier, step_value, seed
) -> None:
    momentum, dampening, nesterov = momentum_setting
    dtypes = data.draw(st.lists(st.sampled_from(KERNEL_DTYPES), min_size=len(sizes), max_size=len(sizes)))
    # Without momentum the buffers may be left out (None).
    states = () if momentum == 0.0 and data.draw(st.booleans()) else ("momentum_buffers",)
    ours = make_problem(sizes, dtypes, device, seed, states, data.draw(st.booleans()))
    expected = clone_problem(ours)
    kwargs = dict(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        grad_multiplier=None if multiplier is None else scalar(multiplier, device),
        found_inf=scalar(0.0, device),
    )
    step = scalar(step_value, device)
    with launch_config(SMALL):
        triton_ops.sgd_step_(*sgd_arguments(ours), step, **kwargs)
    reference.sgd_step_(*sgd_arguments(expected), step, **kwargs)
    assert_matches_reference(ours, expected)


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (True, 0.0), (False, 0.3)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgd_matches_torch_optim(nesterov: bool, dampening: float, weight_decay: float) -> None:
    params, grads_per_step = fp32_problem(1)
    torch_params = [p.clone().requires_grad_() for p in params]
    optimizer = torch.optim.SGD(
        torch_params, lr=0.05, momentum=0.9, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )
    buffers = [torch.zeros_like(p) for p in params]
    step = torch.zeros(1)
    for grads in grads_per_step:
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        reference.sgd_step_(
            params,
            grads,
            None,
            buffers,
            step,
            lr=0.05,
            momentum=0.9,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
        )
        reference.advance_step_(step, None)
    for ours, theirs in zip(params, torch_params, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
