"""The range statistics: both implementations against the statistics counted in Python on the
values as float64, at strides the kernel reads as a storage span and at strides it copies."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def python_statistics(value: torch.Tensor) -> tuple[float, list[int]]:
    """(largest magnitude of the non-NaN values, [underflow, non-finite, numel]) counted value by
    value in float64."""
    tiny = torch.finfo(value.dtype).tiny
    values = [abs(v) for v in value.double().flatten().tolist()]
    finite_or_inf = [v for v in values if not math.isnan(v)]
    largest = max(finite_or_inf, default=0.0)
    underflow = sum(1 for v in values if 0 < v < tiny)
    nonfinite = sum(1 for v in values if math.isnan(v) or math.isinf(v))
    return largest, [underflow, nonfinite, len(values)]


def make_value(numel: int, dtype: torch.dtype, seed: int, specials: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    value = (torch.randn(numel, generator=generator) * 100).to(dtype)
    if specials and numel >= 8:
        tiny = torch.finfo(dtype).tiny
        value[1], value[3], value[5], value[7] = float("inf"), float("nan"), tiny / 4, -tiny / 8
        value[0] = -float("inf")
    return value


def implementation(name: str):
    return reference if name == "reference" else triton_ops


@pytest.fixture(scope="module", params=["reference", "triton"])
def kernels(request: pytest.FixtureRequest, device: str):
    if request.param == "triton" and triton_ops is None:
        pytest.skip("no Triton")
    return implementation(request.param)


@settings(max_examples=12, deadline=None)
@given(
    numel=st.sampled_from([1, 7, 1000, 1025, 9000]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    specials=st.booleans(),
)
def test_statistics_match_python(kernels, device, numel, dtype, seed, specials) -> None:
    value = make_value(numel, dtype, seed, specials)
    amax = torch.full((6,), 0.5, device=device)  # accumulates onto what is there
    counts = torch.full((18,), 2, dtype=torch.int64, device=device)
    kernels.record_range_(value.to(device), amax, counts, 4)
    largest, expected = python_statistics(value)
    assert amax[4].item() == max(largest, 0.5)
    assert counts[12:15].tolist() == [2 + n for n in expected]
    untouched = [i for i in range(6) if i != 4]
    assert amax[untouched].tolist() == [0.5] * 5
    assert counts[:12].tolist() == [2] * 12 and counts[15:].tolist() == [2] * 3


@pytest.mark.parametrize("layout", ["transposed", "sliced", "empty"])
def test_layouts(kernels, device, layout) -> None:
    value = make_value(60, torch.float16, 3, specials=True).view(6, 10).to(device)
    value = {"transposed": value.t(), "sliced": value[:, 2:7], "empty": value[:0]}[layout]
    amax, counts = torch.zeros(1, device=device), torch.zeros(3, dtype=torch.int64, device=device)
    kernels.record_range_(value, amax, counts, 0)
    largest, expected = python_statistics(value.cpu())
    assert amax.item() == largest and counts.tolist() == expected


def test_implementations_agree_bit_for_bit(device) -> None:
    if triton_ops is None:
        pytest.skip("no Triton")
    value = make_value(5000, torch.bfloat16, 11, specials=True).to(device)
    results = []
    for kernels in (reference, triton_ops):
        amax, counts = torch.zeros(2, device=device), torch.zeros(6, dtype=torch.int64, device=device)
        kernels.record_range_(value, amax, counts, 1)
        results.append((amax, counts))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"value": torch.ones(2, dtype=torch.float64)}, "value dtype torch.float64"),
        ({"amax": torch.zeros(2, dtype=torch.float16)}, "amax must be a contiguous float32"),
        ({"counts": torch.zeros(6, dtype=torch.int32)}, "counts must be a contiguous int64"),
        ({"counts": torch.zeros(5, dtype=torch.int64)}, "3 entries per entry of amax"),
        ({"index": 2}, r"index must be an int in \[0, 2\)"),
    ],
)
def test_bad_arguments_are_refused(change, message) -> None:
    arguments = {
        "value": torch.ones(2),
        "amax": torch.zeros(2),
        "counts": torch.zeros(6, dtype=torch.int64),
        "index": 1,
    } | change
    for kernels in (reference, *([triton_ops] if triton_ops is not None else [])):
        amax_before = arguments["amax"].clone()
        with pytest.raises(ValueError, match=message):
            kernels.record_range_(**arguments)
        assert torch.equal(arguments["amax"], amax_before)
