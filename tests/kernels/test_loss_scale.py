"""The loss-scale update kernel against its pure-torch reference, bit for bit, over every branch.

On CPU the kernel runs under TRITON_INTERPRET=1; the same checks run on CUDA when marked `gpu`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.kernels.loss_scale import triton as loss_scale_triton

CONFIG = {
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 3,
    "hysteresis": 2,
    "min_scale": None,
    "max_scale": None,
}


def _state(device: str, scale: float, growth_tracker: int, hysteresis_tracker: int, flags: list[float]):
    return {
        "scale": torch.tensor(scale, dtype=torch.float32, device=device),
        "growth_tracker": torch.tensor(growth_tracker, dtype=torch.int32, device=device),
        "hysteresis_tracker": torch.tensor(hysteresis_tracker, dtype=torch.int32, device=device),
        # The fused optimizers' flags have shape (1,), GradScaler-style ones shape (): both occur.
        "found_infs": [
            torch.full((1,) if i % 2 == 0 else (), f, dtype=torch.float32, device=device)
            for i, f in enumerate(flags)
        ],
        "inv_scale_out": torch.full((), -1.0, device=device),
    }


def _run(implementation, state: dict, config: dict, zero_found_infs: bool = True) -> dict:
    copy = {k: [f.clone() for f in v] if isinstance(v, list) else v.clone() for k, v in state.items()}
    implementation.update_loss_scale_(
        copy["scale"],
        copy["growth_tracker"],
        copy["hysteresis_tracker"],
        copy["found_infs"],
        inv_scale_out=copy["inv_scale_out"],
        zero_found_infs=zero_found_infs,
        **config,
    )
    return copy


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.detach().cpu().reshape(-1).view(torch.int32).tolist()


def _assert_same(actual: dict, expected: dict) -> None:
    for key in ("scale", "growth_tracker", "hysteresis_tracker", "inv_scale_out"):
        assert _bits(actual[key]) == _bits(expected[key]), key
    assert [_bits(f) for f in actual["found_infs"]] == [_bits(f) for f in expected["found_infs"]]


def _check(device: str, state: dict, config: dict, zero_found_infs: bool = True) -> dict:
    """Run both implementations on copies of ``state``; assert the same bits; return the result."""
    expected = _run(reference, state, config, zero_found_infs)
    actual = _run(triton_ops, state, config, zero_found_infs)
    _assert_same(actual, expected)
    return expected


def _values(result: dict) -> tuple[float, int, int]:
    return (
        result["scale"].item(),
        result["growth_tracker"].item(),
        result["hysteresis_tracker"].item(),
    )


# (scale, growth tracker, hysteresis tracker, flags, config changes) -> (scale, growth, hysteresis)
BRANCHES = {
    "overflow_with_hysteresis_left": (1024.0, 2, 2, [1.0], {}, (1024.0, 0, 1)),
    "overflow_backs_off_at_last_hysteresis": (1024.0, 2, 1, [1.0], {}, (512.0, 0, 0)),
    "consecutive_overflow_backs_off_again": (1024.0, 0, 0, [1.0], {}, (512.0, 0, 0)),
    "clean_below_interval_counts_and_refills": (1024.0, 0, 1, [0.0], {}, (1024.0, 1, 2)),
    "clean_at_interval_grows": (1024.0, 2, 2, [0.0], {}, (2048.0, 0, 2)),
    "growth_to_inf_refused": (3.0e38, 2, 2, [0.0], {}, (3.0e38, 0, 2)),
    "max_scale_clamps_growth": (2.0**23 * 3, 2, 2, [0.0], {"max_scale": 2.0**24}, (2.0**24, 0, 2)),
    "max_scale_rounded_to_fp32": (1.0, 2, 2, [0.0], {"max_scale": 1.1}, (1.1, 0, 2)),
    "min_scale_clamps_backoff": (4.0, 0, 1, [1.0], {"min_scale": 3.0}, (3.0, 0, 0)),
    "min_scale_rounded_to_fp32": (0.5, 0, 1, [1.0], {"min_scale": 0.3}, (0.3, 0, 0)),
    "two_flags_one_set": (1024.0, 0, 1, [0.0, 1.0], {}, (512.0, 0, 0)),
    "four_flags_none_set": (1024.0, 2, 2, [0.0] * 4, {}, (2048.0, 0, 2)),
    "four_flags_summed": (1024.0, 0, 1, [0.0, 0.0, 0.0, 2.0], {}, (512.0, 0, 0)),
    "six_flags_the_sixth_set": (1024.0, 0, 1, [0.0] * 5 + [1.0], {}, (512.0, 0, 0)),
    "six_flags_none_set": (1024.0, 0, 1, [0.0] * 6, {}, (1024.0, 1, 2)),
    "hysteresis_one_is_grad_scaler": (1024.0, 1, 1, [1.0], {"hysteresis": 1}, (512.0, 0, 0)),
}


# The interpreter's numpy cast warns on the overflow that the rule then refuses.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_every_branch_matches_the_reference(device: str, branch: str) -> None:
    scale, growth, hysteresis, flags, changes, expected = BRANCHES[branch]
    result = _check(device, _state(device, scale, growth, hysteresis, flags), {**CONFIG, **changes})
    expected_scale, expected_growth, expected_hysteresis = expected
    assert _values(result) == (
        torch.tensor(expected_scale, dtype=torch.float32).item(),
        expected_growth,
        expected_hysteresis,
    )
    assert (
        result["inv_scale_out"].item()
        == torch.tensor(result["scale"].item()).double().reciprocal().float().item()
    )
    assert all(f.item() == 0.0 for f in result["found_infs"])


def test_factor_products_are_taken_in_fp64_and_rounded_once(device: str) -> None:
    # 0.3 and 1.1 are not float32 numbers; for these scales, a factor rounded to fp32 before the
    # product (Triton's default for a Python float argument) would give another float32 result.
    config = {**CONFIG, "growth_factor": 1.1, "backoff_factor": 0.3, "growth_interval": 1}
    for scale, flag in ((10641227.0, 1.0), (2201683.0, 1.0), (2287403.5, 0.0), (10312613.0, 0.0)):
        factor = config["backoff_factor"] if flag else config["growth_factor"]
        wide = torch.tensor(scale).double()
        expected = wide.mul(factor).float().item()
        assert expected != wide.mul(torch.tensor(factor).double()).float().item()
        result = _check(device, _state(device, scale, 0, 1, [flag]), config)
        assert result["scale"].item() == expected


def test_a_nan_scale_stays_nan_through_the_bounds(device: str) -> None:
    # update(new_scale=tensor(nan)) can set one; torch.clamp keeps NaN, so the kernel must not
    # return a bound instead.
    config = {**CONFIG, "min_scale": 1.0, "max_scale": 2.0**20, "hysteresis": 1, "growth_interval": 1}
    for flag in (0.0, 1.0):  # grow (clamped by max_scale) and back off (clamped by min_scale)
        result = _check(device, _state(device, math.nan, 0, 1, [flag]), config)
        assert math.isnan(result["scale"].item())


def test_flags_are_kept_without_zero_found_infs(device: str) -> None:
    result = _check(
        device, _state(device, 8.0, 0, 1, [1.0, 0.0, 2.0, 0.0, 3.0]), CONFIG, zero_found_infs=False
    )
    assert [f.item() for f in result["found_infs"]] == [1.0, 0.0, 2.0, 0.0, 3.0]
    assert _values(result) == (4.0, 0, 0)


def test_kernel_is_one_launch_for_up_to_four_flags(device: str, monkeypatch) -> None:
    launches = []
    kernel = loss_scale_triton._update_loss_scale_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(loss_scale_triton, "_update_loss_scale_kernel", Counting())
    state = _state(device, 8.0, 0, 1, [0.0, 1.0, 0.0, 0.0])
    _run(triton_ops, state, CONFIG)
    assert launches == [(1,)]


def test_bad_arguments_are_refused_by_both(device: str) -> None:
    state = _state(device, 8.0, 0, 1, [0.0])
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match="growth_tracker must be a torch.int32"):
            implementation.update_loss_scale_(
                state["scale"],
                state["growth_tracker"].long(),
                state["hysteresis_tracker"],
                state["found_infs"],
                **CONFIG,
            )
        with pytest.raises(TypeError, match="found_infs must be a non-empty list"):
            implementation.update_loss_scale_(
                state["scale"], state["growth_tracker"], state["hysteresis_tracker"], [], **CONFIG
            )
        with pytest.raises(ValueError, match="max_scale must be None or in"):
            implementation.update_loss_scale_(
                state["scale"],
                state["growth_tracker"],
                state["hysteresis_tracker"],
                state["found_infs"],
                **{**CONFIG, "max_scale": 1e39},
            )
    assert _values(state) == (8.0, 0, 1)


finite_scales = st.floats(min_value=2.0**-100, max_value=2.0**127, allow_subnormal=False, width=32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@given(
    scale=finite_scales,
    growth_tracker=st.integers(0, 5),
    hysteresis_tracker=st.integers(0, 3),
    flags=st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=1, max_size=5),
    growth_factor=st.floats(1.0001, 8.0),
    backoff_factor=st.floats(0.01, 0.99),
    growth_interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    min_scale=st.none() | st.floats(2.0**-110, 1.0),
    max_scale=st.none() | st.floats(1.0, 3.0e38),
)
def test_random_states_match_the_reference(
    device: str,
    scale: float,
    growth_tracker: int,
    hysteresis_tracker: int,
    flags: list[float],
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
) -> None:
    config = {
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "hysteresis": hysteresis,
        "min_scale": min_scale,
        "max_scale": max_scale,
    }
    state = _state(device, scale, growth_tracker, min(hysteresis_tracker, hysteresis), flags)
    result = _check(device, state, config)
    assert math.isfinite(result["scale"].item())
