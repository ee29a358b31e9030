"""The FP8 quantiser (``amp_fx.kernels.fp8``'s ``fp8_quantize``) against its definition in float64:
scales from each group's amax, values rounded once to the format, never more than half a unit in
the last place off; all-zero groups finite; an inf or NaN anywhere in a group makes the whole
group's dequantised values NaN, other groups untouched; nothing read on the host; its argument
checks. The products built on it: tests/kernels/test_fp8_scaled_mm.py and tests/ops/test_fp8_linear.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference
from amp_fx.kernels.fp8 import AMAX_FLOOR, FP8_DTYPES, FP8_MAX
from amp_fx.testing.dtype_tolerances import rounding_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HIGH_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The dtype's exponent range that random values are drawn from: wide, without overflowing it.
EXPONENTS = {torch.bfloat16: 100, torch.float16: 10, torch.float32: 100}


@st.composite
def quantize_cases(draw):
    """(tensor, fp8_dtype, along, power_of_two, column_major): any shape up to 64 x 64, values
    spread over many binades around a random magnitude, any strides (transposed views too)."""
    dtype = draw(st.sampled_from(HIGH_DTYPES))
    rows, columns = draw(st.integers(1, 64)), draw(st.integers(1, 64))
    seed = draw(st.integers(0, 2**16))
    limit = EXPONENTS[dtype]
    magnitude = draw(st.integers(-limit, limit))
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, columns, generator=generator, dtype=torch.float64)
    spread = torch.randint(-12, 1, (rows, columns), generator=generator).double()  # 12 binades below
    tensor = (values * 2.0 ** (magnitude + spread)).to(dtype)
    if draw(st.booleans()):
        tensor = tensor.t().contiguous().t()
    return (
        tensor,
        draw(st.sampled_from(FP8_DTYPES)),
        draw(st.sampled_from([None, 0, 1])),
        draw(st.booleans()),
        draw(st.booleans()),
    )


def group_amax(tensor: torch.Tensor, along: int | None) -> torch.Tensor:
    """Each element's scaling group's amax, in float64, broadcast to the tensor's shape."""
    magnitudes = tensor.double().abs()
    amax = magnitudes.amax() if along is None else magnitudes.amax(dim=along, keepdim=True)
    return amax.expand_as(magnitudes)


def expected_scale_shape(tensor: torch.Tensor, along: int | None) -> tuple[int, ...]:
    rows, columns = tensor.shape
    return {None: (), 1: (rows, 1), 0: (1, columns)}[along]


@given(quantize_cases())
def test_quantize_rounds_once_with_amax_scales(case) -> None:
    """Each group's scale maps its amax onto the format's largest value (a power of 2 at most
    that, and more than half of it, when asked); the data is the scaled value rounded once, so the
    dequantised value errs by at most half a unit in the format's last place, at that scale."""
    tensor, fp8_dtype, along, power_of_two, column_major = case
    data, scale = reference.fp8_quantize(
        tensor, fp8_dtype, along=along, power_of_two=power_of_two, column_major=column_major
    )
    assert data.dtype == fp8_dtype and data.shape == tensor.shape
    assert data.is_contiguous() != column_major or min(tensor.shape) == 1
    if column_major:
        assert data.t().is_contiguous()
    assert scale.dtype == torch.float32 and tuple(scale.shape) == expected_scale_shape(tensor, along)

    fp8_max = FP8_MAX[fp8_dtype]
    amax = group_amax(tensor, along)
    multiplier = (1 / scale.double()).expand_as(amax)  # what the quantiser multiplied by
    ideal = fp8_max / amax.clamp(min=AMAX_FLOOR)
    if power_of_two:
        assert torch.equal(multiplier, 2.0 ** torch.floor(torch.log2(multiplier)))
        assert ((multiplier <= ideal) & (multiplier > ideal / 2)).all()
    else:
        torch.testing.assert_close(multiplier, ideal, rtol=2**-22, atol=0)

    relative, absolute = rounding_error(fp8_dtype)
    # Beyond the format's rounding: float32's, of the scale, its reciprocal and the product.
    relative += 2**-21
    dequantised = data.double() * scale.double()
    error = (dequantised - tensor.double()).abs()
    bound = relative * tensor.double().abs() + absolute / multiplier
    assert (error <= bound).all(), (error - bound).max()
    # Rounding once: with a power-of-2 scale the product is exact, so the data is bit for bit
    # the float64 value cast once.
    if power_of_two:
        exact = (tensor.double() * multiplier).to(fp8_dtype)
        assert torch.equal(data.view(torch.uint8), exact.contiguous().view(torch.uint8).reshape(data.shape))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("power_of_two", [False, True])
def test_amax_lands_on_the_format_top(fp8_dtype: torch.dtype, power_of_two: bool) -> None:
    """The largest magnitude of each group is the format's largest value (with power-of-2
    scales: at least half of it): the scale uses the format's range; values far above the
    format's range (1e6 > 57344 > 448) are scaled into it, not clamped."""
    tensor = torch.tensor([[1e6, -3e5, 5e4], [0.5, -0.25, 0.125]])
    data, scale = reference.fp8_quantize(tensor, fp8_dtype, along=1, power_of_two=power_of_two)
    top = data.float().abs().amax(dim=1)
    fp8_max = FP8_MAX[fp8_dtype]
    if power_of_two:
        assert ((top > fp8_max / 2) & (top <= fp8_max)).all()
    else:
        assert (top == fp8_max).all()
    torch.testing.assert_close(data.float() * scale, tensor, rtol=rounding_error(fp8_dtype)[0], atol=0)


@pytest.mark.parametrize("along", [None, 0, 1])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_all_zero_groups_stay_finite(along: int | None, power_of_two: bool) -> None:
    """amax 0 (clamped to AMAX_FLOOR) gives a finite scale and data 0: dequantised 0, no 0 * inf."""
    tensor = torch.zeros(16, 32, dtype=torch.bfloat16)
    tensor[3] = 1.0  # one row and column with values; every other group of zeros
    tensor[:, 5] = -2.0
    for fp8_dtype in FP8_DTYPES:
        data, scale = reference.fp8_quantize(tensor, fp8_dtype, along=along, power_of_two=power_of_two)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert torch.equal(data.float() * scale, tensor.float())
    data, scale = reference.fp8_quantize(torch.zeros(4, 16), E4M3, along=None, power_of_two=power_of_two)
    assert torch.equal(data.float() * scale, torch.zeros(4, 16))


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("along", [None, 0, 1])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_non_finite_values_poison_their_group(bad: float, fp8_dtype, along, power_of_two) -> None:
    """A plain cast to e4m3 clamps inf to 448; here an inf or NaN makes every dequantised value of
    its group NaN (so every product reading the group is NaN), and other groups are quantised as
    if it were not there."""
    tensor = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    clean_data, clean_scale = reference.fp8_quantize(
        tensor, fp8_dtype, along=along, power_of_two=power_of_two
    )
    poisoned = tensor.clone()
    poisoned[2, 7] = bad
    data, scale = reference.fp8_quantize(poisoned, fp8_dtype, along=along, power_of_two=power_of_two)
    dequantised = data.float() * scale
    group = torch.zeros(8, 16, dtype=torch.bool)
    if along is None:
        group[:] = True
    elif along == 1:
        group[2] = True
    else:
        group[:, 7] = True
    assert torch.isnan(dequantised[group]).all()
    assert torch.equal(dequantised[~group], (clean_data.float() * clean_scale)[~group])


def test_quantize_reads_no_value_on_the_host() -> None:
    """Meta tensors have no values: any .item() or branch on a value would raise."""
    tensor = torch.empty(32, 48, device="meta", dtype=torch.bfloat16)
    for along in (None, 0, 1):
        data, scale = reference.fp8_quantize(tensor, E4M3, along=along, power_of_two=True, column_major=True)
        assert data.device.type == "meta" and data.t().is_contiguous()
        assert tuple(scale.shape) == expected_scale_shape(tensor, along)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tensor": torch.zeros(4)}, ValueError, "non-empty matrix"),
        ({"tensor": torch.zeros(0, 4)}, ValueError, "non-empty matrix"),
        ({"tensor": torch.zeros(4, 4, dtype=torch.float64)}, ValueError, "tensor has dtype torch.float64"),
        ({"fp8_dtype": torch.bfloat16}, ValueError, "fp8_dtype is dtype torch.bfloat16"),
        ({"along": 2}, ValueError, "along must be None"),
        ({"along": True}, ValueError, "along must be None"),
        ({"power_of_two": 1}, TypeError, "power_of_two must be a bool"),
        ({"column_major": None}, TypeError, "column_major must be a bool"),
        ({"tensor": [[1.0]]}, TypeError, "tensor must be a tensor"),
    ],
)
def test_quantize_refuses_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    arguments = {
        "tensor": torch.ones(4, 4),
        "fp8_dtype": E4M3,
        "along": 1,
        "power_of_two": True,
        "column_major": False,
    }
    arguments.update(kwargs)
    tensor, fp8_dtype = arguments.pop("tensor"), arguments.pop("fp8_dtype")
    with pytest.raises(error, match=message):
        reference.fp8_quantize(tensor, fp8_dtype, **arguments)
