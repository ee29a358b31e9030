"""The FP8 scaled product (``amp_fx.kernels.fp8``'s ``fp8_scaled_mm``): its value is the product of
the dequantised operands, summed as the device sums it (the contract's "How the product sums")
and rounded once; and its checks refuse on the CPU what CUDA refuses, where ``torch._scaled_mm``
on the CPU accepts it (on a GPU, marked `gpu`: CUDA refuses each of them too, as torch 2.11 does,
and takes every product the checks let through).

The bounds the FP8 tests compare with are built here, from each dtype's rounding error
(``amp_fx.testing.dtype_tolerances.rounding_error``) and the FP8 tensor cores' sums:
`product_tolerance` (two sums of the same products: float32's, or with `tensor_core_magnitudes`
a CUDA one), `operand_error` (an operand against its FP8 quantisation). `tensor_core_sums`
emulates CUDA's sums on the CPU, to check the CUDA bound where no GPU runs.
"""

from __future__ import annotations

import math

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


# CUDA's FP8 tensor cores (``amp_fx.kernels.fp8``): 32 products an MMA instruction, each addend
# and the sum truncated to 13 fraction bits.
MMA_PRODUCTS, MMA_FRACTION_BITS = 32, 13


def product_tolerance(
    expected: torch.Tensor,
    magnitude: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    tensor_core_magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """How far a product of k terms, rounded to ``dtype``, may lie from another evaluation of the
    same products (``expected``, any float dtype) element-wise: one rounding to ``dtype`` plus, for
    each of the two sums, float32's error of k additions and the scales' multiplications, relative
    to ``magnitude`` (the sum of the terms' magnitudes). With ``tensor_core_magnitude`` (the sum of
    `tensor_core_magnitudes`), one sum ran on CUDA's FP8 tensor cores: plus their truncations, at
    most k + 2 per instruction units of 2^-13 of it (the arithmetic is in ``amp_fx.kernels.fp8``)."""
    relative, absolute = rounding_error(dtype)
    float32_relative = rounding_error(torch.float32)[0]
    bound = relative * expected.double().abs() + absolute
    bound = bound + 2 * (k + 2) * float32_relative * magnitude.double()
    if tensor_core_magnitude is not None:
        truncations = k + 2 * math.ceil(k / MMA_PRODUCTS)
        bound = bound + truncations * 2.0**-MMA_FRACTION_BITS * tensor_core_magnitude.double()
    return bound


def tensor_core_magnitudes(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``|data| * scale`` (float64) with each nonzero FP8 subnormal counted as the format's least
    normal: a tensor core truncates a product's addends at 2^-13 of 2^(e_a + e_b), the operands'
    exponents (a subnormal's is the least normal's), which these values' product bounds."""
    values = data.double().abs()
    counted = torch.where(values == 0, values, values.clamp(min=torch.finfo(data.dtype).smallest_normal))
    return counted * scale.double()


def _binade(x: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 |x|), 0 for 0."""
    return torch.exp2(torch.floor(torch.log2(x.abs())))


def _truncated(x: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """x rounded toward zero to a multiple of ``unit`` (x itself where the unit is 0: x is 0)."""
    return torch.where(unit == 0, x, torch.trunc(x / unit) * unit)


def tensor_core_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of FP8 matrices (unscaled, (M, K) and (K, N)) in float64, as an FP8 tensor core
    sums it (MMA-Sim's model of Hopper's, ``amp_fx.kernels.fp8``): per instruction the running sum
    and 32 products, each truncated at 2^-13 of the largest addend's 2^e, added exactly, the sum
    truncated to 13 fraction bits; never moved to float32 (an H100's sums of up to 64 terms)."""
    one = torch.tensor(1.0)
    products = a.double()[:, None, :] * b.double().t()[None, :, :]
    a_weights, b_weights = (_binade(tensor_core_magnitudes(t, one)) for t in (a, b))
    weights = a_weights[:, None, :] * b_weights.t()[None, :, :]
    total = torch.zeros(products.shape[:2], dtype=torch.float64)
    for start in range(0, a.shape[1], MMA_PRODUCTS):
        part = slice(start, start + MMA_PRODUCTS)
        unit = torch.maximum(weights[..., part].amax(-1), _binade(total)) * 2.0**-MMA_FRACTION_BITS
        step = _truncated(total, unit) + _truncated(products[..., part], unit[..., None]).sum(-1)
        total = _truncated(step, _binade(step) * 2.0**-MMA_FRACTION_BITS)
    return total


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


def assert_is_the_product(out: torch.Tensor, arguments: tuple, tensor_cores: bool) -> None:
    """``out`` is ``fp8_scaled_mm(*arguments)`` (a, b, scale_a, scale_b, bias, out_dtype) to within
    `product_tolerance` of the exact product: summed in float32, or on CUDA's ``tensor_cores``."""
    a, b, scale_a, scale_b, bias, out_dtype = arguments
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[1])
    a_values, b_values = a.double() * scale_a.double(), b.double() * scale_b.double()
    exact = a_values @ b_values + (0 if bias is None else bias.double())
    magnitude = a_values.abs() @ b_values.abs() + (0 if bias is None else bias.double().abs())
    summed = None
    if tensor_cores:
        summed = tensor_core_magnitudes(a, scale_a) @ tensor_core_magnitudes(b, scale_b)
    bound = product_tolerance(exact, magnitude, a.shape[1], out_dtype, summed)
    assert ((out.double() - exact).abs() <= bound).all()


def emulated_cuda_scaled_mm(a, b, scale_a, scale_b, *, bias=None, out_dtype) -> torch.Tensor:
    """``fp8_scaled_mm`` as CUDA computes it, on the CPU: `tensor_core_sums`, then the scales and
    the bias in float32, rounded once to ``out_dtype``."""
    out = tensor_core_sums(a, b).float() * scale_a * scale_b
    return (out if bias is None else out + bias.float()).to(out_dtype)


@given(product_cases())
def test_scaled_mm_is_the_dequantised_product_rounded_once(case) -> None:
    a, b, scale_a, scale_b, bias, out_dtype = case
    out = reference.fp8_scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert_is_the_product(out, case, tensor_cores=False)


@given(product_cases())
def test_the_cuda_bound_holds_for_tensor_core_sums(case) -> None:
    """The bound the GPU tests use, against CUDA's arithmetic emulated: it holds in any case."""
    a, b, scale_a, scale_b, bias, out_dtype = case
    out = emulated_cuda_scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert_is_the_product(out, case, tensor_cores=True)


@pytest.mark.parametrize(
    ("terms", "expected"),
    [
        ({0: (16.0, 16.0), 1: (0.125, 0.125)}, 256.0),  # 2^-6 is below 2^-13 of 256's 2^8: dropped
        ({0: (16.0, 16.0), 1: (0.25, 0.125)}, 256.0 + 2.0**-5),  # 2^-5 is 2^-13 of it: kept
        ({0: (16.0, 16.0), 32: (0.125, 0.125)}, 256.0),  # the running sum aligns the next instruction
        ({0: (2.0**-9, 448.0), 1: (2.0**-4, 2.0**-9)}, 0.875),  # a subnormal aligns at 2^-6: 2^-13 < 2^-11
    ],
)
def test_tensor_core_sums_truncate_as_the_model_says(terms: dict, expected: float) -> None:
    """`tensor_core_sums` on worked sums of e4m3 products ``a_i * b_i`` (K = 64)."""
    a, b = torch.zeros(1, 64), torch.zeros(64, 16)
    for i, (a_i, b_i) in terms.items():
        a[0, i], b[i, 0] = a_i, b_i
    assert tensor_core_sums(a.to(E4M3), b.to(E4M3))[0, 0].item() == expected


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
    and is the product within the bound of CUDA's FP8 sums."""
    a, b, scale_a, scale_b = operands(17, 64, 48, *formats, scaling=scaling, device="cuda")
    for out_dtype in OUTPUT_DTYPES:
        bias = None if out_dtype == torch.float32 else _bias(out_dtype, "cuda", 48)
        out = reference.fp8_scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
        assert_is_the_product(out, (a, b, scale_a, scale_b, bias, out_dtype), tensor_cores=True)
