"""The Adam kernel: Triton against the reference (bit for bit where rounding allows), the reference
against torch.optim.Adam / AdamW on fp32 tensors."""

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
    sizes_strategy,
    step_strategy,
)


@given(
    sizes=sizes_strategy,
    data=st.data(),
    lr=st.floats(1e-4, 1e-1),
    beta1=st.sampled_from([0.0, 0.5, 0.9]),
    beta2=st.sampled_from([0.9, 0.999]),
    eps=st.sampled_from([1e-8, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    adam_w_mode=st.booleans(),
    multiplier=multiplier_strategy,
    step_value=step_strategy,
    with_found_inf=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adam_matches_reference(
    device,
    sizes,
    data,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    multiplier,
    step_value,
    with_found_inf,
    seed,
) -> None:
    dtypes = data.draw(st.lists(st.sampled_from(KERNEL_DTYPES), min_size=len(sizes), max_size=len(sizes)))
    with_masters = data.draw(st.booleans())
    ours = make_problem(sizes, dtypes, device, seed, ("exp_avgs", "exp_avg_sqs"), with_masters)
    expected = clone_problem(ours)
    kwargs = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adam_w_mode=adam_w_mode,
        grad_multiplier=None if multiplier is None else scalar(multiplier, device),
        found_inf=scalar(0.0, device) if with_found_inf else None,
    )
    step = scalar(step_value, device)
    with launch_config(SMALL):
        triton_ops.adam_step_(*ours.values(), step, **kwargs)
    reference.adam_step_(*expected.values(), step, **kwargs)
    assert_matches_reference(ours, expected)
    assert step.item() == step_value


@pytest.mark.parametrize("adam_w_mode", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch_optim(adam_w_mode: bool, weight_decay: float) -> None:
    params, grads_per_step = fp32_problem(0)
    torch_params = [p.clone().requires_grad_() for p in params]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    optimizer = cls(torch_params, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    step = torch.zeros(1)
    for grads in grads_per_step:
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        reference.adam_step_(
            params,
            grads,
            None,
            exp_avgs,
            exp_avg_sqs,
            step,
            lr=1e-2,
            beta1=0.8,
            beta2=0.99,
            eps=1e-6,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
        )
        reference.advance_step_(step, None)
    for ours, theirs in zip(params, torch_params, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    assert step.item() == len(grads_per_step)


def test_unaligned_views_are_updated_correctly(device) -> None:
    """Tensors at odd offsets: the table is marked unaligned and the kernels must not assume 16 bytes."""
    storage = torch.randn(4, 70, device=device)
    params = [storage[0, 1:40].half(), storage[1, 3:].clone()[2:]]  # the second: fp32 view at an odd offset
    ours = {
        "params": params,
        "grads": [torch.randn(70, device=device).half()[1:40], torch.randn(70, device=device)[5:]],
        "masters": [params[0].float(), None],
        "exp_avgs": [torch.zeros(70, device=device)[1:40], torch.zeros(70, device=device)[5:]],
        "exp_avg_sqs": [torch.zeros(70, device=device)[1:40], torch.zeros(70, device=device)[5:]],
    }
    expected = clone_problem(ours)
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True)
    triton_ops.adam_step_(*ours.values(), scalar(0.0, device), **kwargs)
    reference.adam_step_(*expected.values(), scalar(0.0, device), **kwargs)
    assert_matches_reference(ours, expected)
