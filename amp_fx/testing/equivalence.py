"""`assert_equivalent`: does a converted model compute what the FP32 original computes?

    >>> import torch, amp_fx
    >>> from amp_fx.testing import assert_equivalent
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16, device_type="cpu")
    >>> assert_equivalent(model, converted, (torch.randn(4, 8),))  # raises AssertionError if not

By default the measure is relative (`amp_fx.testing.relative_error`): the converted model's
norm-wise error against FP32, per output and gradient, at most `RELATIVE_BOUND` (1.5) times its
reference's (torch.autocast; for O3 the model cast to the low dtype), median over a few seeded
batches. ``measure="fixed"`` compares with FP32 within the dtype's fixed tolerances instead
(`amp_fx.testing.tolerances`), ``exact=True`` demands the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Literal

import torch

from amp_fx.testing.comparison import (
    ForwardBackward,
    Mismatch,
    as_module,
    compare_tensors,
    compared_runs,
    root_mean_square,
)
from amp_fx.testing.dtype_tolerances import RELATIVE_BOUND, grad_tolerances, tolerances
from amp_fx.testing.references import infer_dtype
from amp_fx.testing.relative_error import DEFAULT_BATCHES, error_ratio

__all__ = ["MEASURES", "assert_equivalent"]

MEASURES = ("relative", "fixed")


def assert_equivalent(
    original: torch.nn.Module | Callable[..., Any],
    converted: torch.nn.Module | Callable[..., Any],
    inputs: Sequence[Any],
    *,
    keyword_inputs: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    check_grads: bool = True,
    exact: bool = False,
    measure: Literal["relative", "fixed"] = "relative",
    reference: torch.nn.Module | Callable[..., Any] | None = None,
    bound: float = RELATIVE_BOUND,
    batches: int = DEFAULT_BATCHES,
    lowered_ops: Collection[str] | None = None,
) -> None:
    """Assert that ``converted`` computes ``original``'s outputs and gradients as accurately as promised.

    Both run on their own copies of ``inputs`` (positional) and ``keyword_inputs`` (floating ones
    get ``requires_grad``), under the same RNG seed (dropout masks match when the op order does),
    in their current train/eval mode; their ``.grad`` fields and buffers are restored afterwards.
    With ``check_grads`` a scalar loss, Σ⟨output, W⟩ in FP32 with seeded random W, is
    backpropagated through both and the gradients of floating inputs and of parameters (matched
    by name; converted parameters may be fp16/bf16) are compared too.

    ``measure="relative"`` (default): `error_ratio` over ``batches`` seeded batches; every output
    and gradient's error against FP32 must be at most ``bound`` times ``reference``'s (default:
    torch.autocast for O1/O2 and models of unknown origin, the model cast to ``dtype`` for O3;
    see `reference_for`; ``lowered_ops`` as in `error_ratio`: O2's mixture-of-experts experts are
    judged against autocast with them run low too). ``measure="fixed"``: one batch, each tensor
    within the fixed tolerances of ``dtype`` (`tolerances`, `grad_tolerances`, norm-wise as `compare_tensors`;
    for gradients with the RMS of all the original's gradients as ``scale``). ``exact=True``:
    one batch, bit-identical outputs and gradients (O0 against the original, O1 against
    `with_autocast`, O3 against `low_precision_copy`).

    ``dtype`` is the low precision the model was converted to; by default it is read from the
    converted model's policy or its parameters (`infer_dtype`).

    Raises AssertionError listing every tensor that failed and by how much.

        >>> import copy
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> rounded = copy.deepcopy(model).half().float()  # weights rounded to fp16, as autocast does
        >>> assert_equivalent(model, rounded, (torch.randn(2, 4),), dtype=torch.float16)
        >>> with torch.no_grad():
        ...     _ = rounded[2].weight.mul_(1.02)  # a 2% error in the last layer
        >>> assert_equivalent(model, rounded, (torch.randn(2, 4),), dtype=torch.float16)
        Traceback (most recent call last):
        AssertionError: converted model's error against FP32 exceeds 1.5x ...
    """
    if not callable(original) or not callable(converted):
        raise TypeError(
            "assert_equivalent expects two callables (nn.Module or GraphModule) and a tuple of inputs"
        )
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"inputs must be a tuple of positional arguments, e.g. (x,), got {type(inputs).__name__}"
        )
    if keyword_inputs is not None and not isinstance(keyword_inputs, Mapping):
        raise TypeError(
            f"keyword_inputs must be a dict of keyword arguments, got {type(keyword_inputs).__name__}"
        )
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    if dtype is None:
        dtype = infer_dtype(converted) if isinstance(converted, torch.nn.Module) else torch.float32
    if measure == "relative" and not exact:
        measured = error_ratio(
            original,
            converted,
            inputs,
            keyword_inputs=keyword_inputs,
            reference=reference,
            dtype=dtype,
            check_grads=check_grads,
            batches=batches,
            lowered_ops=lowered_ops,
        )
        if lines := measured.failures(bound):
            listing = "\n".join(f"  {line}" for line in lines)
            raise AssertionError(
                f"converted model's error against FP32 exceeds {bound:g}x {measured.reference}'s "
                f"(median over {batches} seeded batches, {dtype}):\n{listing}"
            )
        return
    _assert_within_tolerances(original, converted, inputs, keyword_inputs, dtype, check_grads, exact)


def _assert_within_tolerances(
    original: Any,
    converted: Any,
    inputs: Sequence[Any],
    keyword_inputs: Mapping[str, Any] | None,
    dtype: torch.dtype,
    check_grads: bool,
    exact: bool,
) -> None:
    """The fixed-tolerance and the exact measures: one batch, each tensor against FP32's."""
    out_rtol, out_atol = (0.0, 0.0) if exact else tolerances(dtype)
    grad_rtol, grad_atol = (0.0, 0.0) if exact else grad_tolerances(dtype)
    actual, (expected,) = compared_runs(
        as_module(converted), [("original", as_module(original))], inputs, check_grads,
        keyword_inputs=keyword_inputs,
    )  # fmt: skip
    mismatches: list[Mismatch] = []
    for name, a, e in zip(expected.names, actual.outputs, expected.outputs, strict=True):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            mismatch = compare_tensors(a, e, rtol=out_rtol, atol=out_atol, name=name)
        elif a != e:
            mismatch = Mismatch(name, f"{a!r} != expected {e!r}")
        else:
            mismatch = None
        if mismatch is not None:
            mismatches.append(mismatch)
    if check_grads:
        mismatches += _compare_gradients(actual, expected, converted, rtol=grad_rtol, atol=grad_atol)
    if mismatches:
        lines = "\n".join(f"  {m.name}: {m.message}" for m in mismatches)
        demand = (
            "bit-identical results"
            if exact
            else f"{dtype} tolerances: outputs rtol/atol {out_rtol:g}/{out_atol:g}, "
            f"gradients {grad_rtol:g}/{grad_atol:g}"
        )
        raise AssertionError(f"converted model disagrees with the original ({demand}):\n{lines}")


def _compare_gradients(
    actual: ForwardBackward, expected: ForwardBackward, converted: Any, *, rtol: float, atol: float
) -> list[Mismatch]:
    scale = root_mean_square(
        [g for g in [*expected.input_grads, *expected.param_grads.values()] if g is not None]
    )
    mismatches: list[Mismatch] = []
    for i, (a, e) in enumerate(zip(actual.input_grads, expected.input_grads, strict=True)):
        name = f"grad of input[{i}]"
        if e is None and a is None:
            continue
        if a is None or e is None:
            which = "converted" if a is None else "original"
            mismatches.append(Mismatch(name, f"the {which} model produced no gradient"))
        elif (m := compare_tensors(a, e, rtol=rtol, atol=atol, scale=scale, name=name)) is not None:
            mismatches.append(m)
    converted_params = dict(converted.named_parameters()) if isinstance(converted, torch.nn.Module) else {}
    for param_name, e in expected.param_grads.items():
        name = f"grad of parameter {param_name!r}"
        a = actual.param_grads.get(param_name)
        if a is None:
            why = "has no gradient" if param_name in converted_params else "has no parameter of that name"
            mismatches.append(Mismatch(name, f"the converted model {why}"))
        elif (m := compare_tensors(a, e, rtol=rtol, atol=atol, scale=scale, name=name)) is not None:
            mismatches.append(m)
    return mismatches
