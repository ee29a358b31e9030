"""Test your own models the way amp_fx tests itself.

- `tolerances(dtype)` / `grad_tolerances(dtype)`: (rtol, atol) for outputs and gradients of a model
  converted to fp16/bf16, compared with FP32 by norm-wise relative error (the one place these
  numbers are written); `rounding_tolerances(dtype)` for a fused kernel against its reference
  (the same float32 math, each rounded once).
- `assert_equivalent(original, converted, inputs)`: forward and backward through both models;
  by default every output's and input/parameter gradient's error against FP32 must be at most
  `RELATIVE_BOUND` (1.5) times the reference's (torch.autocast, at O2 with mixture-of-experts
  experts run low as O2 runs them, ``lowered_ops``; for O3 the model cast low),
  median over seeded batches (`error_ratio` measures it); ``measure="fixed"`` compares within
  the fixed tolerances instead, ``exact=True`` bit for bit.
- `with_autocast(model, device_type, dtype)` and `low_precision_copy(model, dtype)`: the
  references an O1 (torch.autocast) and an O3 (Apex's ``model.half()``) conversion must match.
- `models_and_inputs()`: a hypothesis strategy for random models (linear, conv, norms,
  activations, attention, residual adds, concatenation, reductions, softmax, embedding) with
  matching inputs.

Example, a property test of your own::

    import torch
    from hypothesis import given
    import amp_fx
    from amp_fx.testing import SMOOTH_ACTIVATIONS, assert_equivalent, models_and_inputs

    @given(models_and_inputs(max_layers=3, activations=SMOOTH_ACTIVATIONS))
    def test_o2_bf16(model_and_inputs):
        model, inputs = model_and_inputs
        assert_equivalent(model, amp_fx.convert(model, "O2", dtype=torch.bfloat16), inputs)

    # And for your own model: outputs bit for bit against torch.autocast at O1.
    gm = amp_fx.convert(my_model, "O1", dtype=torch.bfloat16, device_type="cpu")
    assert_equivalent(with_autocast(my_model, "cpu", torch.bfloat16), gm, (x,), exact=True, check_grads=False)
"""

from __future__ import annotations

from typing import Any

from amp_fx.testing.comparison import (
    ForwardBackward,
    Mismatch,
    assert_close_normwise,
    compare_tensors,
    forward_backward,
    normwise_error,
)
from amp_fx.testing.dtype_tolerances import (
    RELATIVE_BOUND,
    grad_tolerances,
    relative_floor,
    rounding_tolerances,
    tolerances,
)
from amp_fx.testing.equivalence import assert_equivalent
from amp_fx.testing.references import (
    infer_dtype,
    low_precision_copy,
    lowered_unlisted_ops,
    reference_for,
    running_low,
    with_autocast,
)
from amp_fx.testing.relative_error import ErrorRatio, TensorRatio, error_ratio, seeded_batches

# The strategies need hypothesis (a test dependency); import them on first use so that
# `tolerances` and `assert_equivalent` work without it.
_STRATEGY_EXPORTS = (
    "models_and_inputs",
    "ACTIVATIONS",
    "SMOOTH_ACTIVATIONS",
    "FAMILIES",
    "SEQUENCE_LAYERS",
    "SPATIAL_LAYERS",
)


def __getattr__(name: str) -> Any:
    if name in _STRATEGY_EXPORTS:
        from amp_fx.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'amp_fx.testing' has no attribute {name!r}")


__all__ = [
    *_STRATEGY_EXPORTS,
    "RELATIVE_BOUND",
    "ErrorRatio",
    "ForwardBackward",
    "Mismatch",
    "TensorRatio",
    "assert_close_normwise",
    "assert_equivalent",
    "compare_tensors",
    "error_ratio",
    "forward_backward",
    "grad_tolerances",
    "infer_dtype",
    "low_precision_copy",
    "lowered_unlisted_ops",
    "normwise_error",
    "reference_for",
    "relative_floor",
    "rounding_tolerances",
    "running_low",
    "seeded_batches",
    "tolerances",
    "with_autocast",
]
