"""Tolerances for comparing a converted model with its FP32 original, written down once.

Every test in amp_fx, and users testing their own models, take these numbers from here::

    >>> import torch
    >>> from amp_fx.testing import tolerances, grad_tolerances
    >>> tolerances(torch.bfloat16)
    (0.04, 0.001)
    >>> grad_tolerances(torch.float16)
    (0.02, 0.0001)

What the numbers mean: a tensor ``actual`` agrees with ``expected`` when (see `assert_close_normwise`)

    ‖actual − expected‖₂ ≤ rtol · ‖expected‖₂ + atol · √numel

that is, a norm-wise relative error, with ``atol`` an absolute floor on the root-mean-square error for
tensors that are (nearly) zero in FP32. Element-wise relative error is the wrong measure for
mixed precision: wherever a value is the difference of two larger ones (a residual stream, a
normalized activation, a gradient through LayerNorm) its relative error is unbounded, while the
tensor as a whole is as accurate as the format allows (measured: element-wise 1.6 for bf16 on a
4-layer MLP whose norm-wise error is 4e-3).

Why these values. The unit roundoff u of a format is 2^-24 (fp32), 2^-11 ≈ 4.9e-4 (fp16) and
2^-8 ≈ 3.9e-3 (bf16). A converted model rounds its inputs, weights and every low-precision op's
output, so a forward pass of a few layers accumulates several u; normalization layers keep it from
compounding. Outputs get rtol ≈ 10u (fp16 5e-3, bf16 4e-2): on random 2-8 block models with
LayerNorm, run under `torch.autocast`, the worst norm-wise output error over 20 seeds was 2.0e-3
(fp16) and 2.0e-2 (bf16). Gradients get their own, wider tolerance (`grad_tolerances`, ≈ 40u): the
backward pass multiplies rounded activations by rounded output gradients, so it carries the
forward's error and its own, and crossing ReLU kinks or max-pool ties routes a gradient differently
(measured worst over 20 seeds at 4 blocks: 8.7e-3 fp16, 5.6e-2 bf16). FP32 tolerances
(rtol 1e-5) allow a different reduction order only; O0 is checked bit-identical, not with these.
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
        (0.005, 0.0001)
    """
    return _lookup(_OUTPUT_TOLERANCES, dtype, "tolerances")


def grad_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for gradients (of inputs and parameters) of a model converted to ``dtype``.

    Wider than `tolerances` because the backward pass compounds the forward's rounding
    (module docstring).

        >>> grad_tolerances(torch.bfloat16)
        (0.16, 0.001)
    """
    return _lookup(_GRAD_TOLERANCES, dtype, "grad_tolerances")
