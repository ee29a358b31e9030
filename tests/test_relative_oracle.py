"""The relative oracle of `assert_equivalent`: correct conversions pass, small weight errors fail.

A conversion is held to its reference's error against FP32 (torch.autocast for O1/O2, the model
cast low for O3): on the README's model a last layer scaled by 1.02 fails in fp16 and bf16, where
the fixed bf16 tolerance passes it at 1.10; and on the models hypothesis draws, a 2% change to one
layer's weights fails on at least 95% while the unchanged O1/O2/O3 conversions all pass.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from torch import nn

import amp_fx
from amp_fx.testing import (
    RELATIVE_BOUND,
    SMOOTH_ACTIVATIONS,
    assert_equivalent,
    error_ratio,
    low_precision_copy,
    models_and_inputs,
    relative_floor,
    seeded_batches,
    with_autocast,
)
from amp_fx.testing.comparison import root_mean_square
from amp_fx.testing.relative_error import DEFAULT_BATCHES

LOW_DTYPES = [torch.float16, torch.bfloat16]


def _readme_model() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """README.md's `assert_equivalent` example: Linear, GELU, Linear; a batch of 16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    return model, (torch.randn(16, 32),)


def _scaled(model: nn.Module, parameter: str, factor: float) -> nn.Module:
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.get_parameter(parameter).mul_(factor)
    return wrong


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_correct_conversions_of_the_readme_model_pass(level: str, dtype: torch.dtype) -> None:
    model, inputs = _readme_model()
    converted = amp_fx.convert(model, level, dtype=dtype, device_type="cpu")
    assert_equivalent(model, converted, inputs)
    # O1 and O3 compute what their references compute: the same error, a ratio of at most 1.
    if level != "O2":
        assert error_ratio(model, converted, inputs).ratio <= 1.0


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("factor", [1.02, 1.05, 1.10])
def test_a_scaled_last_layer_fails(factor: float, dtype: torch.dtype) -> None:
    model, inputs = _readme_model()
    converted = amp_fx.convert(_scaled(model, "2.weight", factor), "O2", dtype=dtype, device_type="cpu")
    with pytest.raises(AssertionError, match=r"exceeds 1\.5x torch\.autocast\(cpu, .*\n  output\[0\]"):
        assert_equivalent(model, converted, inputs)


def test_the_fixed_tolerance_is_kept_as_an_option_and_is_looser() -> None:
    model, inputs = _readme_model()
    wrong = amp_fx.convert(_scaled(model, "2.weight", 1.10), "O2", dtype=torch.bfloat16, device_type="cpu")
    assert_equivalent(model, wrong, inputs, measure="fixed")  # what the relative measure catches
    with pytest.raises(ValueError, match="measure must be one of"):
        assert_equivalent(model, wrong, inputs, measure="loose")


class _ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.02 * self.fc(self.norm(x))


def test_o3_is_measured_against_the_cast_model_not_autocast() -> None:
    """Pure bf16 (O3) rounds the residual stream at every add, where autocast keeps it FP32: it
    passes against its own reference (the model cast to bf16) and fails against autocast's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_ResidualBlock() for _ in range(8)], nn.Linear(32, 8))
    inputs = (torch.randn(8, 32),)
    o3 = amp_fx.convert(model, "O3", dtype=torch.bfloat16, device_type="cpu")
    assert error_ratio(model, o3, inputs).reference.startswith("the model cast to torch.bfloat16")
    assert_equivalent(model, o3, inputs)
    autocast = with_autocast(model, "cpu", torch.bfloat16)
    with pytest.raises(AssertionError, match="the given reference"):
        assert_equivalent(model, o3, inputs, reference=autocast)
    assert_equivalent(model, o3, inputs, reference=low_precision_copy(model, torch.bfloat16))


def test_keyword_inputs_reach_the_model() -> None:
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, *, x: torch.Tensor, scale: float) -> torch.Tensor:
            return self.fc(x) * scale

    torch.manual_seed(0)
    model = Keywords()
    converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16, device_type="cpu")
    assert_equivalent(model, converted, (), keyword_inputs={"x": torch.randn(3, 4), "scale": 2.0})


def test_seeded_batches_shuffle_floating_inputs_only() -> None:
    x, ids = torch.randn(3, 5), torch.randint(0, 9, (3, 5))
    batches = seeded_batches((x, ids), {"mask": ids > 2, "y": x}, 3)
    assert batches[0][0][0] is x and len(batches) == 3
    for args, kwargs in batches[1:]:
        assert not torch.equal(args[0], x) and torch.equal(
            args[0].flatten().sort().values, x.flatten().sort().values
        )
        assert torch.equal(args[1], ids) and torch.equal(kwargs["mask"], ids > 2)
    assert not torch.equal(batches[1][0][0], batches[2][0][0])  # each batch its own seed
    assert seeded_batches((x,), None, 2)[1][0][0].equal(seeded_batches((x,), None, 2)[1][0][0])
    with pytest.raises(ValueError, match="batches must be a positive int"):
        seeded_batches((x,), None, 0)


# --- the median over batches and the floor, on stand-ins with a chosen error -----------------


class _WrongOnSome(nn.Module):
    """Linear, GELU, Linear in FP32, its output doubled on the batches in ``wrong_on`` (recognized
    by value): as a converted model its error is 0 on every other batch and hundreds of times
    autocast's on those, so one such batch takes the mean of the ratios past the bound."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 10)
        self.wrong_on: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(nn.functional.gelu(self.fc1(x)))
        return 2 * y if any(torch.equal(x.detach(), batch) for batch in self.wrong_on) else y


@pytest.mark.parametrize("wrong", range(DEFAULT_BATCHES + 1))
def test_the_verdict_is_the_median_over_the_batches(wrong: int) -> None:
    """``wrong`` of the seeded batches are off. A minority is placed first (the given batch
    among them) and passes: neither the first batch nor the worst one nor the mean decides. A
    majority is placed last (the given batch a right one) and fails."""
    torch.manual_seed(0)
    model, inputs = _WrongOnSome(), (torch.randn(16, 32),)
    batches = [args[0] for args, _ in seeded_batches(inputs, None, DEFAULT_BATCHES)]
    majority = wrong > DEFAULT_BATCHES // 2
    converted = copy.deepcopy(model)
    converted.wrong_on = batches[DEFAULT_BATCHES - wrong :] if majority else batches[:wrong]
    measured = error_ratio(model, converted, inputs, dtype=torch.bfloat16)
    assert measured.batches == DEFAULT_BATCHES and measured.reference.startswith("torch.autocast")
    if not majority:
        # The right batches' ratio, exactly: the stand-in computes what the original computes.
        assert measured.ratio == 0.0, measured.failures()
        assert_equivalent(model, converted, inputs, dtype=torch.bfloat16)
        return
    assert measured.ratio > RELATIVE_BOUND
    listing = rf"median over {DEFAULT_BATCHES} seeded batches.*\n  output\[0\]"
    with pytest.raises(AssertionError, match=listing):
        assert_equivalent(model, converted, inputs, dtype=torch.bfloat16)


class _ExactInLowPrecision(nn.Module):
    """A Linear of small integers on small integers, returning y and z = y − y repeated to eight
    times y's size: integers below 256 are fp16 and bf16 values and fp32 accumulation sums them
    exactly, so autocast computes both with no error. As a converted stand-in it errs by
    ``scale`` on y (relative to y's norm) and by ``offset`` on z (absolute: z cancels to exactly
    0). z's size makes y's floor mostly its relative part (the absolute part, per entry the RMS
    of all outputs, comes to a third of the relative one), so each part decides one output."""

    def __init__(self, scale: float = 1.0, offset: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randint(-3, 4, (4, 8)))
            self.fc.bias.copy_(torch.randint(-3, 4, (4,)))
        self.scale, self.offset = scale, offset

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y * self.scale, (y - y).repeat(1, 8) + self.offset


def _exact_in_low_precision() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return _ExactInLowPrecision(), (torch.randint(-4, 5, (16, 8)).float(),)


def _erring(model: nn.Module, **error: float) -> nn.Module:
    wrong = copy.deepcopy(model)
    for name, value in error.items():
        setattr(wrong, name, value)
    return wrong


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
def test_the_floor_holds_where_autocast_is_exact(dtype: torch.dtype) -> None:
    """Autocast's error is 0 here, so the ratio's denominator is the floor alone: an error at
    or below it passes, and one ten bounds above it fails. Gradients are left out: autocast's
    are not exact (the seeded loss weights are rounded to ``dtype`` in its backward)."""
    model, inputs = _exact_in_low_precision()
    reference = with_autocast(model, "cpu", dtype)
    for exact, computed in zip(model(*inputs), reference(*inputs), strict=True):
        assert computed.dtype == dtype and torch.equal(computed.float(), exact)  # no error at all
    floor = relative_floor(dtype)
    # The absolute floor's unit: the RMS of all FP32 outputs (per entry, as `error_ratio` has it).
    rms = root_mean_square(list(model(*inputs)))

    def check(converted: nn.Module) -> None:
        assert_equivalent(model, converted, inputs, dtype=dtype, check_grads=False)

    assert error_ratio(model, _erring(model), inputs, dtype=dtype, check_grads=False).ratio == 0.0
    for passing in (
        _erring(model, scale=1.0 + floor),
        _erring(model, scale=1.0 - floor),
        _erring(model, offset=floor * rms),
    ):
        check(passing)
    far = 10 * RELATIVE_BOUND * floor
    for failing, output in ((_erring(model, scale=1.0 + far), 0), (_erring(model, offset=far * rms), 1)):
        with pytest.raises(AssertionError, match=rf"\n  output\[{output}\]: norm-wise error"):
            check(failing)


# --- the property: drawn models -------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, models",
    [
        (torch.bfloat16, 6),
        pytest.param(torch.float16, 40, marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, 40, marks=pytest.mark.slow),
    ],
    ids=["bf16-6", "fp16-40", "bf16-40"],
)
def test_a_two_percent_weight_change_fails_on_drawn_models(dtype: torch.dtype, models: int) -> None:
    """Counted over the drawn models: every correct O1/O2/O3 conversion passes, and scaling one
    layer's weights (a parameter of two or more dimensions, chosen by a seed) by 1.02 fails on at
    least 95% of them. The ones it may miss change something the output barely depends on (a
    query weight of attention whose softmax is nearly flat)."""
    caught: list[bool] = []

    @settings(
        max_examples=models,
        database=None,
        derandomize=True,
        deadline=None,
        phases=[Phase.generate],  # a count, not a search: no shrinking
        suppress_health_check=list(HealthCheck),
    )
    @given(models_and_inputs(max_layers=4, activations=SMOOTH_ACTIVATIONS))
    def check(model_and_inputs) -> None:
        model, inputs = model_and_inputs
        for level in ("O1", "O2", "O3"):
            assert_equivalent(model, amp_fx.convert(model, level, dtype=dtype, device_type="cpu"), inputs)
        weights = [name for name, p in model.named_parameters() if p.dim() >= 2]
        generator = torch.Generator().manual_seed(len(caught))
        chosen = weights[int(torch.randint(len(weights), (1,), generator=generator))]
        wrong = amp_fx.convert(_scaled(model, chosen, 1.02), "O2", dtype=dtype, device_type="cpu")
        caught.append(error_ratio(model, wrong, inputs).ratio > RELATIVE_BOUND)

    check()
    assert len(caught) == models
    assert sum(caught) >= 0.95 * len(caught), f"caught {sum(caught)} of {len(caught)}"
