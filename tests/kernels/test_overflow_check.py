"""The overflow check: its squared norm against float64, and a flag that accumulates and is never
cleared, in both implementations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from tests.kernels.optimizer_problems import (
    KERNEL_DTYPES,
    SMALL,
    launch_config,
    multiplier_strategy,
    scalar,
    sizes_strategy,
)


@given(
    sizes=sizes_strategy,
    dtype=st.sampled_from(KERNEL_DTYPES),
    multiplier=multiplier_strategy,
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_squared_norm_matches_float64(device, sizes, dtype, multiplier, scale, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    grads = [(scale * torch.randn(n, generator=generator)).to(dtype).to(device) for n in sizes]
    found_inf = scalar(0.0, device)
    sq_norm = scalar(0.5, device)  # accumulates onto what is there
    grad_multiplier = None if multiplier is None else scalar(multiplier, device)
    with launch_config(SMALL):
        triton_ops.check_finite_and_norm_(
            grads, found_inf, grad_multiplier=grad_multiplier, sq_norm_out=sq_norm
        )
    factor = 1.0 if multiplier is None else float(torch.tensor(multiplier, dtype=torch.float32))
    expected = 0.5 + sum(float((g.double() * factor).square().sum()) for g in grads)
    assert found_inf.item() == 0.0
    assert sq_norm.item() == pytest.approx(expected, rel=1e-5)


def test_found_inf_is_never_cleared(device) -> None:
    found_inf = scalar(1.0, device)
    triton_ops.check_finite_and_norm_([torch.ones(5, device=device)], found_inf)
    assert found_inf.item() == 1.0


def test_check_accumulates_norm_and_never_clears() -> None:
    found_inf = torch.ones(1)
    sq_norm = torch.full((1,), 1.0)
    grads = [torch.tensor([3.0, 4.0]).half(), torch.tensor([[1.0, 2.0]]).bfloat16()]
    reference.check_finite_and_norm_(
        grads, found_inf, grad_multiplier=torch.full((1,), 0.5), sq_norm_out=sq_norm
    )
    assert found_inf.item() == 1.0
    assert sq_norm.item() == pytest.approx(1.0 + 0.25 * (9 + 16 + 1 + 4))
