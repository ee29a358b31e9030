"""The FP8 scaled product (``amp_fx.kernels.fp8``'s ``fp8_scaled_mm``): its value is the product of
the dequantised operands, rounded once; and its checks refuse on the CPU what CUDA refuses, where
``torch._scaled_mm`` on the CPU accepts it (on a GPU, marked `gpu`: CUDA refuses each of them too,
as torch 2.11 does, and takes every product the checks let through).

The bounds the FP8 tests compare with are built here, from each dtype's rounding error
(``amp_fx.testing.dtype_tolerances.rounding_error``): `product_tolerance` (two float32 sums of the
same products) and `operand_error` (an operand against its FP8 quantisation).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference
from amp_fx.kernels.fp8 import AMAX_FLOOR, FP8_MAX
from amp_fx.kernels.fp8.arguments import OUTPUT_DTYPES
from amp_fx.testing.dtype_tolerances import rounding_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = [16, 32, 48, 64]  # CPU scaled products run at ~60 MFLOP/s: keep them at most 64 wide
# The operand formats CUDA multiplies (not both e5m2), with either scaling.
FORMAT_PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]


# ---- the bounds the FP8 tests share -----------------------------------------------------------


def product_tolerance(
    expected: torch.Tensor, magnitude: torch.Tensor, k: int, dtype: torch.dtype
) -> torch.Tensor:
    """How far a float32-accumulated product of k terms, rounded to ``dtype``, may lie from another
    evaluation of the same products (``expected``, any float dtype) element-wise: one rounding to
    ``dtype`` plus, for each of the two sums, float32's error of k additions and the scales'
    multiplications, relative to ``magnitude`` (the sum of the terms' magnitudes)."""
    relative, absolute = rounding_error(dtype)
    float32_relative = rounding_error(torch.float32)[0]
    return relative * expected.double().abs() + absolute + 2 * (k + 2) * float32_relative * magnitude.double()


def operand_error(operand: torch.Tensor, fp8_dtype: torch.dtype | None, along: int | None) -> torch.Tensor:
    """Element-wise bound on |dequantised - operand| after FP8 quantisation with amax scales along
    ``along`` (None: one scale), float64: the format's rounding, relative, plus half its smallest
    subnormal at the group's dequantisation scale (at most 2 * amax / FP8_MAX with power-of-2
    scales), and float32's rounding of the scale. Zero for an operand left in its dtype (None)."""
    values = operand.double()
    if fp8_dtype is None:
        return torch.zeros_like(values)
    relative, absolute = rounding_error(fp8_dtype)
    magnitudes = values.abs()
    amax = magnitudes.amax() if along is None else magnitudes.amax(dim=along, keepdim=True)
    largest_scale = 2 * amax.clamp(min=AMAX_FLOOR) / FP8_MAX[fp8_dtype]
    return (relative + 2**-21) * magnitudes + absolute * largest_scale


def quantised_product_error(a, b, a_error, b_error) -> torch.Tensor:
    """Bound on |A_q @ B_q - A @ B| (float64) given bounds on |A_q - A| and |B_q - B|."""
    a, b = a.double().abs(), b.double().abs()
    return a_error @ (b + b_error) + a @ b_error


# ---- values -------------------------------------------------------------------------------------


@st.composite
def product_cases(draw):
    """Operands quantised by fp8_quantize (the layouts and scales a product takes), any rows,
    K and N multiples of 16, formats, output dtype and bias as CUDA allows them."""
    scaling = draw(st.sampled_from(["tensorwise", "rowwise"]))
    m, k, n = draw(st.integers(1, 64)), draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    formats = draw(st.sampled_from(FORMAT_PAIRS))
    out_dtype = draw(st.sampled_from(OUTPUT_DTYPES))
    with_bias = out_dtype != torch.float32 and draw(st.booleans())
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    # Operand magnitudes 2^e_a and 2^e_b whose product the output dtype holds (float16: up to 2^4).
    a_exponent = draw(st.integers(-30, 30))
    b_exponent = draw(st.integers(-20, 4 if out_dtype == torch.float16 else 60)) - a_exponent
    a = torch.randn(m, k, generator=generator) * 2.0**a_exponent
    b = torch.randn(k, n, generator=generator) * 2.0**b_exponent
    bias = torch.randn(n, generator=generator).to(out_dtype) if with_bias else None
    rowwise = scaling == "rowwise"
    power_of_two = draw(st.booleans())
    a_data, a_scale = reference.fp8_quantize(
        a, formats[0], along=1 if rowwise else None, power_of_two=power_of_two
    )
    b_data, b_scale = reference.fp8_quantize(
        b, formats[1], along=0 if rowwise else None, power_of_two=power_of_two, column_major=True
    )
    return a_data, b_data, a_scale, b_scale, bias, out_dtype


@given(product_cases())
def test_scaled_mm_is_the_dequantised_product_rounded_once(case) -> None:
    a, b, scale_a, scale_b, bias, out_dtype = case
    out = reference.fp8_scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[1])
    a_values, b_values = a.double() * scale_a.double(), b.double() * scale_b.double()
    exact = a_values @ b_values + (0 if bias is None else bias.double())
    magnitude = a_values.abs() @ b_values.abs() + (0 if bias is None else bias.double().abs())
    assert ((out.double() - exact).abs() <= product_tolerance(exact, magnitude, a.shape[1], out_dtype)).all()


# ---- CUDA's rules ---------------------------------------------------------------------------------


def operands(m=32, k=32, n=32, a_dtype=E4M3, b_dtype=E4M3, scaling="tensorwise", device="cpu"):
    """Valid operands of an (m, k) @ (k, n) product: a row-major, b column-major, float32 scales."""
    a = torch.randn(m, k, device=device).to(a_dtype)
    b = torch.randn(n, k, device=device).to(b_dtype).t()
    if scaling == "tensorwise":
        return a, b, torch.tensor(0.5, device=device), torch.tensor(2.0, device=device)
    return a, b, torch.rand(m, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5


def _bias(dtype, device="cpu", n=32):
    return torch.randn(n, device=device).to(dtype)


# Each case: (what CUDA refuses, arguments (a, b, scale_a, scale_b, bias, out_dtype) on a device,
# the message naming the rule). Where the CPU's torch._scaled_mm takes it too, only the checks
# stand between a CPU test and a GPU failure.
def refused_products(device: str) -> list:
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    return [
        ("e5m2 x e5m2", (*operands(a_dtype=E5M2, b_dtype=E5M2, device=device), None, bf16), "float8_e5m2"),
        ("K not a multiple of 16", (*operands(k=24, device=device), None, bf16), "K = 24"),
        ("N not a multiple of 16", (*operands(n=24, device=device), None, bf16), "N = 24"),
        (
            "row-major b",
            (*_with(operands(device=device), 1, lambda b: b.contiguous()), None, bf16),
            "column-major",
        ),
        (
            "column-major a",
            (*_with(operands(device=device), 0, lambda a: a.t().contiguous().t()), None, bf16),
            "row-major",
        ),
        (
            "bf16 scales",
            (*_with(operands(device=device), 2, lambda s: s.to(bf16)), None, bf16),
            "float32 scales",
        ),
        (
            "bias with fp32 output",
            (*operands(device=device), _bias(bf16, device), f32),
            "no bias with float32",
        ),
        ("fp16 bias, bf16 output", (*operands(device=device), _bias(f16, device), bf16), "bfloat16 bias"),
        ("bf16 bias, fp16 output", (*operands(device=device), _bias(bf16, device), f16), "float16 bias"),
        (
            "rowwise e5m2 x e5m2",
            (*operands(a_dtype=E5M2, b_dtype=E5M2, scaling="rowwise", device=device), None, bf16),
            "float8_e5m2",
        ),
        (
            "rowwise a, tensorwise b",
            (*_with(operands(scaling="rowwise", device=device), 3, lambda s: s[:, :1]), None, bf16),
            "neither tensorwise",
        ),
        (
            "strided rowwise scale",
            (
                *_with(operands(scaling="rowwise", device=device), 2, lambda s: s.repeat(1, 2)[:, :1]),
                None,
                bf16,
            ),
            "neither tensorwise",
        ),
    ]


def _with(arguments: tuple, index: int, change) -> tuple:
    return tuple(change(x) if i == index else x for i, x in enumerate(arguments))


CPU_CASES = refused_products("cpu")


@pytest.mark.parametrize(("what", "arguments", "message"), CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_checks_refuse_what_cuda_refuses(what: str, arguments: tuple, message: str) -> None:
    a, b, scale_a, scale_b, bias, out_dtype = arguments
    with pytest.raises(ValueError, match=message):
        reference.fp8_scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


@pytest.mark.parametrize(
    "what", ["e5m2 x e5m2", "K not a multiple of 16", "N not a multiple of 16", "row-major b", "bf16 scales"]
)
def test_the_cpu_product_takes_what_cuda_refuses(what: str) -> None:
    """Why the checks run on the CPU too: torch._scaled_mm there computes these products."""
    a, b, scale_a, scale_b, bias, out_dtype = next(c[1] for c in CPU_CASES if c[0] == what)
    out = torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert out.shape == (a.shape[0], b.shape[1])


def test_checks_read_no_value() -> None:
    """The checks and the product on meta tensors, which have no values."""
    a, b, scale_a, scale_b = operands(scaling="rowwise", device="meta")
    out = reference.fp8_scaled_mm(
        a, b, scale_a, scale_b, bias=_bias(torch.bfloat16, "meta"), out_dtype=torch.bfloat16
    )
    assert out.shape == (32, 32) and out.device.type == "meta"


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((torch.zeros(32, 32), None), ValueError, "a has dtype torch.float32"),
        ((torch.zeros(2, 32, 32).to(E4M3), None), ValueError, "a must be a matrix"),
        ((None, torch.zeros(32, 16).to(E4M3).t()), ValueError, "cannot be multiplied"),
    ],
)
def test_checks_refuse_operands_that_are_not_fp8_matrices(arguments, error, message) -> None:
    a, b, scale_a, scale_b = operands()
    a = a if arguments[0] is None else arguments[0]
    b = b if arguments[1] is None else arguments[1]
    with pytest.raises(error, match=message):
        reference.fp8_scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)


# ---- on a GPU: the rules are CUDA's -----------------------------------------------------------

# What torch 2.11's CUDA product (H100) runs though the checks refuse it, and why they do.
TAKEN_BY_CUDA = {
    # Scales that mix the scalings: no product of the family makes them, `scaling_of` names none,
    # and the CPU's product refuses them.
    "rowwise a, tensorwise b",
}


@pytest.mark.gpu
def test_cuda_refuses_each_refused_product() -> None:
    """The products the checks refuse that CUDA runs are exactly `TAKEN_BY_CUDA`, as on torch 2.11
    (the oldest torch the project runs on GPUs): CUDA refuses every other one. A torch that
    changes either set fails here, and the rules are to be reviewed."""
    taken = []
    for what, (a, b, scale_a, scale_b, bias, out_dtype), _ in refused_products("cuda"):
        try:
            torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
            torch.cuda.synchronize()
        except (RuntimeError, ValueError):
            continue
        taken.append(what)
    assert set(taken) == TAKEN_BY_CUDA, taken


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("formats", FORMAT_PAIRS, ids=lambda f: f"{f[0]}x{f[1]}".replace("torch.float8_", ""))
def test_cuda_takes_what_the_checks_let_through(scaling: str, formats: tuple) -> None:
    """Each format pair and output dtype the checks let through runs on CUDA (17 rows: M is free),
    and is the product rounded once."""
    a, b, scale_a, scale_b = operands(17, 64, 48, *formats, scaling=scaling, device="cuda")
    for out_dtype in OUTPUT_DTYPES:
        bias = None if out_dtype == torch.float32 else _bias(out_dtype, "cuda", 48)
        out = reference.fp8_scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
        a_values, b_values = a.double() * scale_a.double(), b.double() * scale_b.double()
        exact = a_values @ b_values + (0 if bias is None else bias.double())
        magnitude = a_values.abs() @ b_values.abs() + (0 if bias is None else bias.double().abs())
        assert ((out.double() - exact).abs() <= product_tolerance(exact, magnitude, 64, out_dtype)).all()
