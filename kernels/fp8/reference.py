"""The FP8 quantiser and scaled product in plain torch: the family's contract
(``amp_fx.kernels.fp8``, which has the math) on any device, with no host synchronization."""

from __future__ import annotations

import torch
from torch import Tensor

from amp_fx.kernels.fp8 import AMAX_FLOOR, FP8_MAX
from amp_fx.kernels.fp8.arguments import check_fp8_quantize_arguments, check_fp8_scaled_mm_arguments

__all__ = ["fp8_quantize", "fp8_scaled_mm"]

# float32's sign and exponent bits: clearing the mantissa rounds a positive normal float down to a
# power of 2, exactly (a log2/exp2 round trip can land one binade off).
_EXPONENT_BITS = -(1 << 23)  # 0xFF800000 as an int32


def _power_of_two_below(scale: Tensor) -> Tensor:
    """The largest power of 2 <= each scale (positive normal float32; 0 stays 0), NaN kept NaN
    (its bits would read as inf)."""
    rounded = (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, rounded)


def fp8_quantize(
    tensor: Tensor,
    fp8_dtype: torch.dtype,
    *,
    along: int | None,
    power_of_two: bool,
    column_major: bool = False,
) -> tuple[Tensor, Tensor]:
    """``tensor`` in ``fp8_dtype`` with one scale per tensor (``along=None``), per row (1) or per
    column (0): ``(data, scale)``, the dequantised tensor being ``data.float() * scale``.

    Example:
        >>> t = torch.tensor([[1.0, -2.0], [0.0, 0.0]])
        >>> data, scale = fp8_quantize(t, torch.float8_e4m3fn, along=1, power_of_two=True)
        >>> data.float() * scale
        tensor([[ 1., -2.],
                [ 0.,  0.]])
        >>> scale.flatten().tolist()  # 1 / 128 (448 / 2 rounded down); 2**-48 (448 / 1e-12 likewise)
        [0.0078125, 3.552713678800501e-15]
    """
    check_fp8_quantize_arguments(tensor, fp8_dtype, along, power_of_two, column_major)
    fp8_max = FP8_MAX[fp8_dtype]
    values = tensor.float()
    magnitudes = values.abs()
    # amax propagates NaN, so a NaN anywhere in a group makes its scale NaN (never read on the host).
    amax = magnitudes.amax() if along is None else magnitudes.amax(dim=along, keepdim=True)
    scale = fp8_max / amax.clamp(min=AMAX_FLOOR)
    if power_of_two:
        scale = _power_of_two_below(scale)
    data = (values * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    # The layout the product takes it in (a copy of the one-byte values where it is another).
    data = data.t().contiguous().t() if column_major else data.contiguous()
    return data, scale.reciprocal()


def fp8_scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    *,
    bias: Tensor | None = None,
    out_dtype: torch.dtype,
) -> Tensor:
    """``(a.float() * scale_a) @ (b.float() * scale_b) (+ bias)`` rounded once to ``out_dtype``,
    through ``torch._scaled_mm`` after CUDA's checks (``amp_fx.kernels.fp8.arguments``).

    Example:
        >>> a = torch.ones(2, 16).to(torch.float8_e4m3fn)
        >>> b = torch.ones(16, 16).to(torch.float8_e4m3fn).t().contiguous().t()
        >>> fp8_scaled_mm(a, b, torch.tensor(0.5), torch.tensor(2.0), out_dtype=torch.float32)[0, :2]
        tensor([16., 16.])
    """
    check_fp8_scaled_mm_arguments(a, b, scale_a, scale_b, bias, out_dtype)
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
