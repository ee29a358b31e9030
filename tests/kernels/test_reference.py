"""The pure-torch reference against torch.optim on fp32 tensors, its skip/step rules, and its
contract with triton_ops (same kernel names and signatures)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from amp_fx.kernels import reference
from amp_fx.kernels.families import FAMILIES, KERNEL_NAMES


def _fp32_problem(seed: int, shapes=((3, 5), (7,), (1,))):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in shapes]
    grads_per_step = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(5)]
    return params, grads_per_step


@pytest.mark.parametrize("adam_w_mode", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch_optim(adam_w_mode: bool, weight_decay: float) -> None:
    params, grads_per_step = _fp32_problem(0)
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


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (True, 0.0), (False, 0.3)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_sgd_matches_torch_optim(nesterov: bool, dampening: float, weight_decay: float) -> None:
    params, grads_per_step = _fp32_problem(1)
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


def test_skip_leaves_everything_bit_identical() -> None:
    params = [torch.randn(4).half(), torch.randn(3).half()]
    masters = [
        p.float() + 1e-4 for p in params
    ]  # masters that do not round to the params: a write would show
    grads = [torch.randn(4).half(), torch.tensor([1.0, float("nan"), 2.0]).half()]
    exp_avgs = [torch.randn(4), torch.randn(3)]
    exp_avg_sqs = [torch.rand(4), torch.rand(3)]
    step = torch.full((1,), 3.0)
    found_inf = torch.zeros(1)
    reference.check_finite_and_norm_(grads, found_inf)
    assert found_inf.item() == 1.0
    before = [t.clone() for t in [*params, *masters, *exp_avgs, *exp_avg_sqs, step]]
    reference.adam_step_(
        params,
        grads,
        masters,
        exp_avgs,
        exp_avg_sqs,
        step,
        lr=0.1,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        adam_w_mode=True,
        found_inf=found_inf,
    )
    reference.advance_step_(step, found_inf)
    after = [*params, *masters, *exp_avgs, *exp_avg_sqs, step]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))


def test_check_accumulates_norm_and_never_clears() -> None:
    found_inf = torch.ones(1)
    sq_norm = torch.full((1,), 1.0)
    grads = [torch.tensor([3.0, 4.0]).half(), torch.tensor([[1.0, 2.0]]).bfloat16()]
    reference.check_finite_and_norm_(
        grads, found_inf, grad_multiplier=torch.full((1,), 0.5), sq_norm_out=sq_norm
    )
    assert found_inf.item() == 1.0
    assert sq_norm.item() == pytest.approx(1.0 + 0.25 * (9 + 16 + 1 + 4))


def test_bad_input_is_refused_before_any_write() -> None:
    p = torch.ones(3)
    with pytest.raises(ValueError, match="grads\\[0\\] has shape"):
        reference.adam_step_(
            [p],
            [torch.ones(4)],
            None,
            [torch.zeros(3)],
            [torch.zeros(3)],
            torch.zeros(1),
            lr=0.1,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adam_w_mode=True,
        )
    with pytest.raises(ValueError, match="beta2"):
        reference.adam_step_(
            [p],
            [p.clone()],
            None,
            [torch.zeros(3)],
            [torch.zeros(3)],
            torch.zeros(1),
            lr=0.1,
            beta1=0.9,
            beta2=1.0,
            eps=1e-8,
            weight_decay=0.0,
            adam_w_mode=True,
        )
    with pytest.raises(ValueError, match="momentum_buffers"):
        reference.sgd_step_(
            [p],
            [p.clone()],
            None,
            None,
            torch.zeros(1),
            lr=0.1,
            momentum=0.9,
            dampening=0.0,
            weight_decay=0.0,
            nesterov=False,
        )
    with pytest.raises(ValueError, match="float32 tensor of one element"):
        reference.check_finite_and_norm_([p], torch.zeros(1, dtype=torch.float64))
    assert torch.equal(p, torch.ones(3))


def test_reference_implements_the_triton_contract() -> None:
    """implementation_for() returns either module: each defines every kernel the families name, with
    one signature, which is each family's reference's and Triton kernel's."""
    triton_ops = pytest.importorskip("amp_fx.kernels.triton_ops")
    assert list(triton_ops.__all__) == list(KERNEL_NAMES)
    for name in KERNEL_NAMES:
        assert name in reference.__all__, name
        expected = inspect.signature(getattr(triton_ops, name))
        assert inspect.signature(getattr(reference, name)) == expected, name
    for family in FAMILIES:
        implementations = [
            importlib.import_module(f"{family.__name__}.{kind}") for kind in ("reference", "triton")
        ]
        for name in family.KERNELS:
            assert getattr(reference, name) is getattr(implementations[0], name), name
            assert getattr(triton_ops, name) is getattr(implementations[1], name), name
