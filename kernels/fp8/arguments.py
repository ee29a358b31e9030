"""The FP8 kernels' argument checks, shared by both implementations, and CUDA's rules for an FP8
matrix product, enforced on every device.

``torch._scaled_mm`` on the CPU accepts what CUDA refuses (two e5m2 operands, K or N not a
multiple of 16, a row-major second operand, bf16 scales, a bias with float32 output); code tested
only on the CPU would then fail on the first GPU run. `fp8_product_refusal` states CUDA's rules on
shapes and dtypes alone, so that a caller (the op's up-front check, a policy deciding which
products run in FP8) can ask before any tensor exists; `check_fp8_scaled_mm_arguments` adds the
rules on tensors (formats, layouts, scales, devices). The rules are those of torch 2.11 on an H100,
the oldest torch the project runs on GPUs: there both scalings run on cuBLASLt (rowwise through
its outer-vector scales, cuBLAS >= 12.9) and take the same formats and output dtypes. Older torch
ran rowwise products on CUTLASS's kernel, which took e4m3 operands and wrote bf16 only. One
product 2.11 runs is refused here: scales that mix the scalings (per-row for a, one for b), which
`scaling_of` does not name, no product of this family makes, and the CPU's product refuses. All
checks read metadata only, never a value: they never synchronize with the device.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from amp_fx.kernels.arguments import KERNEL_DTYPES, check_dtype
from amp_fx.kernels.fp8 import FP8_DTYPES
from amp_fx.kernels.fp8.recipes import SCALINGS

__all__ = [
    "OUTPUT_DTYPES",
    "check_fp8_quantize_arguments",
    "check_fp8_scaled_mm_arguments",
    "cpu_scales_per_row",
    "fp8_product_refusal",
    "scaling_of",
]

# The output dtypes CUDA's FP8 product writes, with either scaling (float8 outputs exist for
# tensorwise scaling but are no product's here).
OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
_MULTIPLE = 16
_RULE = "CUDA's FP8 matrix product (torch._scaled_mm) requires"


def fp8_product_refusal(
    m: int,
    k: int,
    n: int,
    first: torch.dtype,
    second: torch.dtype,
    scaling: str,
    out_dtype: torch.dtype,
    bias_dtype: torch.dtype | None = None,
) -> str | None:
    """Why CUDA refuses the FP8 product of an (m, k) ``first`` and a (k, n) ``second`` operand
    with ``scaling`` writing ``out_dtype`` (plus a bias of ``bias_dtype``), with the fix; None when
    it takes it. Shapes and dtypes only. ``scaling`` is checked by name; on torch 2.11 both
    scalings take the same products.

    Example:
        >>> e4m3 = torch.float8_e4m3fn
        >>> fp8_product_refusal(64, 64, 64, e4m3, e4m3, "rowwise", torch.bfloat16) is None
        True
        >>> fp8_product_refusal(64, 24, 64, e4m3, e4m3, "rowwise", torch.bfloat16)[:44]
        'K = 24, the dimension the product sums over,'
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling {scaling!r} is not one of {', '.join(SCALINGS)}")
    if k % _MULTIPLE:
        return (
            f"K = {k}, the dimension the product sums over, is not a multiple of {_MULTIPLE}, which {_RULE}; "
            f"pad it to a multiple of {_MULTIPLE} or run this product in the high dtype"
        )
    if n % _MULTIPLE:
        return (
            f"N = {n}, the product's output columns, is not a multiple of {_MULTIPLE}, which {_RULE}; "
            f"pad it to a multiple of {_MULTIPLE} or run this product in the high dtype"
        )
    for name, dtype in (("first", first), ("second", second)):
        if dtype not in FP8_DTYPES:
            return f"the {name} operand is {dtype}, not a float8 format; quantise it with fp8_quantize"
    if first == second == torch.float8_e5m2:
        return (
            f"both operands are float8_e5m2, which {_RULE} not to be (cuBLASLt has no e5m2 x e5m2 "
            "kernel); quantise one of them to float8_e4m3fn"
        )
    if out_dtype not in OUTPUT_DTYPES:
        names = ", ".join(str(d) for d in OUTPUT_DTYPES)
        return f"{_RULE} an output of {names}, not {out_dtype}; run the layer in one of those"
    if bias_dtype is not None:
        if out_dtype == torch.float32:
            return (
                f"{_RULE} no bias with float32 output; add the bias after the product, or write "
                "bfloat16 or float16"
            )
        if bias_dtype != out_dtype:
            return f"{_RULE} a {out_dtype} bias for {out_dtype} output, got {bias_dtype}; cast the bias"
    return None


def scaling_of(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> str:
    """``"tensorwise"`` or ``"rowwise"``, from the scales' shapes as CUDA reads them: one element
    each, or (M, 1) and (1, N), contiguous and float32; a ValueError naming the shapes otherwise.

    Example:
        >>> a, b = torch.zeros(4, 16), torch.zeros(16, 32)
        >>> scaling_of(a, b, torch.ones(4, 1), torch.ones(1, 32))
        'rowwise'
    """
    m, n = a.shape[0], b.shape[1]
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(scale, Tensor):
            raise TypeError(f"{name} must be a float32 tensor, got {type(scale).__name__}")
        if scale.dtype != torch.float32:
            raise ValueError(f"{name} is {scale.dtype}; {_RULE} float32 scales: pass {name}.float()")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensorwise"
    if (
        tuple(scale_a.shape) == (m, 1)
        and tuple(scale_b.shape) == (1, n)
        and scale_a.is_contiguous()
        and scale_b.is_contiguous()
    ):
        return "rowwise"
    raise ValueError(
        f"scales of shapes {tuple(scale_a.shape)} and {tuple(scale_b.shape)} are neither tensorwise (one "
        f"element each) nor rowwise (contiguous ({m}, 1) for a and (1, {n}) for b), the scalings {_RULE}"
    )


def _check_operand(name: str, tensor: Tensor) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be a matrix (2-D), got shape {tuple(tensor.shape)}")
    check_dtype(f"{name} has", tensor.dtype, FP8_DTYPES)


def check_fp8_scaled_mm_arguments(
    a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None, out_dtype: torch.dtype
) -> None:
    """Validate ``fp8_scaled_mm``'s arguments against CUDA's rules, on any device; raise
    TypeError/ValueError naming the rule and the fix."""
    _check_operand("a", a)
    _check_operand("b", b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"a {tuple(a.shape)} and b {tuple(b.shape)} cannot be multiplied: a's columns != b's rows"
        )
    # cuBLASLt multiplies FP8 in its "TN" layout only: a's rows and b's columns contiguous.
    if a.stride(1) != 1 or a.stride(0) < a.shape[1]:
        raise ValueError(
            f"a must be row-major (strides (>= {a.shape[1]}, 1)), got strides {a.stride()}; {_RULE} it: "
            "pass a.contiguous()"
        )
    if b.stride(0) != 1 or b.stride(1) < b.shape[0]:
        raise ValueError(
            f"b must be column-major (strides (1, >= {b.shape[0]})), got strides {b.stride()}; {_RULE} it: "
            "pass b.t().contiguous().t()"
        )
    scaling = scaling_of(a, b, scale_a, scale_b)
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {out_dtype!r}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (b.shape[1],):
            raise ValueError(f"bias must be a ({b.shape[1]},) vector, got shape {tuple(bias.shape)}")
    for name, tensor in (("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("bias", bias)):
        if tensor is not None and tensor.device != a.device:
            raise ValueError(
                f"{name} is on {tensor.device} but a is on {a.device}; move it with .to({a.device})"
            )
    m, k = a.shape
    refusal = fp8_product_refusal(
        m, k, b.shape[1], a.dtype, b.dtype, scaling, out_dtype, None if bias is None else bias.dtype
    )
    if refusal is not None:
        raise ValueError(refusal)


def check_fp8_quantize_arguments(
    tensor: Tensor, fp8_dtype: torch.dtype, along: int | None, power_of_two: bool, column_major: bool
) -> None:
    """Validate ``fp8_quantize``'s arguments; raise TypeError/ValueError naming the fix."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"tensor must be a tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2 or tensor.numel() == 0:
        raise ValueError(
            f"tensor must be a non-empty matrix (2-D), got shape {tuple(tensor.shape)}; flatten the leading "
            "dimensions with t.reshape(-1, t.shape[-1])"
        )
    check_dtype("tensor has", tensor.dtype, KERNEL_DTYPES)
    check_dtype("fp8_dtype is", fp8_dtype, FP8_DTYPES)
    if along not in (None, 0, 1) or isinstance(along, bool):
        raise ValueError(
            f"along must be None (one scale), 1 (one per row) or 0 (one per column), got {along!r}"
        )
    for name, flag in (("power_of_two", power_of_two), ("column_major", column_major)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")


@functools.cache
def cpu_scales_per_row() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes per-row scales (torch 2.14 does; 2.11
    asserts "only supports per-tensor scaling for CPU backend"). Asked once, on a 16 x 16 product.

    Example:
        >>> isinstance(cpu_scales_per_row(), bool)
        True
    """
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True
