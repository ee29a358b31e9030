"""Tolerances for comparing a converted model with its FP32 original, written down once.

Every test in amp_fx, and users testing their own models, take these numbers from here::

    >>> import torch
    >>> from amp_fx.testing import tolerances, grad_tolerances
    >>> tolerances(torch.bfloat16)
    (0.08, 0.008)
    >>> grad_tolerances(torch.float16)
    (0.02, 0.001)

What the numbers mean: a tensor ``actual`` agrees with ``expected`` when (`compare_tensors`)

    ‖actual − expected‖₂ ≤ rtol · ‖expected‖₂ + atol · √numel

a norm-wise relative error, with ``atol`` a floor on the root-mean-square error for tensors that
are small by cancellation (logits that sum O(1) terms to 0.07). Element-wise relative error is the
wrong measure for mixed precision: wherever a value is the difference of two larger ones (a
residual stream, a normalized activation, a gradient through LayerNorm) its relative error is
unbounded, while the tensor as a whole is as accurate as the format allows (measured: element-wise
1.6 for bf16 on a 4-layer MLP whose norm-wise error is 4e-3). For gradients, `assert_equivalent`
also scales the floor by the RMS of all the model's gradients (``scale``): the gradient of a bias
followed by a normalization is exactly 0 in theory, and carries the rounding error of the
gradients it is summed from.

Why these values. The unit roundoff u of a format is 2^-24 (fp32), 2^-11 ≈ 4.9e-4 (fp16) and
2^-8 ≈ 3.9e-3 (bf16); rtol is about 20u for outputs and 40u for gradients (the backward pass
carries the forward's rounding and adds its own), atol about 2u of an O(1) activation. They were
checked on 3000 random models of `models_and_inputs` (up to 4 blocks, smooth activations), run
under torch.autocast and in pure low precision (Apex O3, the least accurate recipe): the worst
norm-wise errors were, outputs 4e-3 (fp16) and 3e-2 (bf16), gradients 5e-3 / 5e-2 (autocast)
and up to 4e-2 / 5e-2 (pure); with these tolerances 1 model in 3000 failed, in pure bf16, at
1.15x the bound (sigmoids stacked before a train-mode BatchNorm, since excluded from the strategy
as ill-conditioned). Gradients through kinks (ReLU, max-pool) are discontinuous: a rounding error
that moves an input across the kink changes the gradient by O(1), so compare the gradients of
such models by other means (the property tests compare their outputs only). FP32 tolerances
(rtol 1e-5) allow a different reduction order only; O0 is checked bit for bit, not with these.
"""

from __future__ import annotations

import torch

# (rtol, atol) per dtype: see the module docstring for what they bound and why these values.
_OUTPUT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (8e-2, 8e-3),
}
_GRAD_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-2, 1e-3),
    torch.bfloat16: (1.6e-1, 8e-3),
}


# The relative oracle (`amp_fx.testing.relative_error`): a converted model passes when its error
# against FP32 is at most this many times its reference's (autocast's; for O3 the cast model's).
# Measured on 300 random models of `models_and_inputs` (smooth activations, 7 batches): O1 and O3
# 1.0 (the same computation as their references), O2 0.6-1.5 in fp16 and bf16 (3 bf16 models at
# 1.51-1.52); one layer's weights scaled by 1.02 exceeded 1.5 on 98% (fp16) and 96% (bf16), the
# rest being query/key weights of nearly flat attention.
RELATIVE_BOUND = 1.5
# The floor under the reference's error, in units of the tensor's norm: half the dtype's unit
# roundoff u (about the RMS error of rounding the exact result once, 0.4u), so a tensor the
# reference computes exactly, or nearly, is not held to zero error; float32: its tolerance.
_RELATIVE_FLOORS: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 2.0**-12,
    torch.bfloat16: 2.0**-9,
}


def _lookup(
    table: dict[torch.dtype, tuple[float, float]], dtype: torch.dtype, what: str
) -> tuple[float, float]:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} expects a torch.dtype such as torch.float16, got {dtype!r}")
    if dtype not in table:
        known = ", ".join(str(d) for d in table)
        raise ValueError(f"{what}: no tolerance for {dtype}; use one of {known}")
    return table[dtype]


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for a converted model's outputs computed in ``dtype`` against FP32.

    ``dtype`` is the low precision the model was converted to (torch.float16 or torch.bfloat16),
    or torch.float32 for a model that runs in FP32.

        >>> tolerances(torch.float16)
        (0.01, 0.001)
    """
    return _lookup(_OUTPUT_TOLERANCES, dtype, "tolerances")


def grad_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for gradients (of inputs and parameters) of a model converted to ``dtype``.

    Wider than `tolerances` because the backward pass compounds the forward's rounding
    (module docstring).

        >>> grad_tolerances(torch.bfloat16)
        (0.16, 0.008)
    """
    return _lookup(_GRAD_TOLERANCES, dtype, "grad_tolerances")


def relative_floor(dtype: torch.dtype) -> float:
    """The least error, relative to a tensor's norm, the relative oracle charges the reference with.

    >>> relative_floor(torch.bfloat16)
    0.001953125
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"relative_floor expects a torch.dtype such as torch.float16, got {dtype!r}")
    if dtype not in _RELATIVE_FLOORS:
        known = ", ".join(str(d) for d in _RELATIVE_FLOORS)
        raise ValueError(f"relative_floor: no floor for {dtype}; use one of {known}")
    return _RELATIVE_FLOORS[dtype]


def rounding_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for two results of the same float32 math, each rounded once to ``dtype``
    (a fused kernel against its torch reference), compared element-wise.

    One unit in the last place of ``dtype`` (its eps, relative), plus float32's absolute floor:
    an entry near 0 that is a difference of O(1) terms (``g * p - g`` with p close to 1) carries
    float32's absolute error. For float32 results, float32's tolerances.

        >>> rounding_tolerances(torch.bfloat16)
        (0.0078125, 1e-06)
    """
    rtol, atol = tolerances(torch.float32)
    return (rtol, atol) if dtype == torch.float32 else (torch.finfo(dtype).eps, atol)


def rounding_error(dtype: torch.dtype) -> tuple[float, float]:
    """(relative, absolute) such that rounding a value v to nearest in ``dtype`` errs by at most
    ``relative * |v| + absolute`` (below its largest finite value): the unit roundoff (half of eps),
    and half the smallest subnormal, the fixed step of the values near 0. For any floating dtype,
    the float8 formats included; the bounds of the FP8 products' tests are built from it.

        >>> rounding_error(torch.float8_e4m3fn), rounding_error(torch.bfloat16)[0]
        ((0.0625, 0.0009765625), 0.00390625)
    """
    info = torch.finfo(dtype)
    return info.eps / 2, info.smallest_normal * info.eps / 2
