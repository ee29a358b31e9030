"""The relative oracle: a converted model's error against FP32, divided by its reference's.

A fixed tolerance cannot tell a correct bf16 conversion from a wrong one: bf16's rounding alone
moves outputs by 1-3%, so a tolerance that passes every correct model also passes a layer whose
weights are 5% off, and a pure-bf16 (O3) model passes the check O2 does. What a conversion
promises is relative: O1 computes what torch.autocast computes, O2 is at most as far from FP32 as
autocast with the experts of mixture-of-experts layers (``_grouped_mm``, on no autocast list) run
low as O2 runs them (O3: as the model cast to the low dtype). `error_ratio` measures that promise:

    for each tensor t (every floating output, the gradients of the inputs and of each parameter)
    and each of a few seeded batches:
        ratio(t) = ‖converted(t) − fp32(t)‖₂ / max(‖reference(t) − fp32(t)‖₂, floor(t))
        floor(t) = relative_floor(dtype) · (‖fp32(t)‖₂ + s·√numel(t))

the median of ratio(t) over the batches, for every t. ``s`` is the RMS of all FP32 outputs (for
outputs) or of all FP32 gradients (for gradients): a tensor that cancels to nearly zero is held
to the accuracy of the values it is summed from. `assert_equivalent` passes when every median is
at most `RELATIVE_BOUND` (1.5).

    >>> import amp_fx
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    >>> o2 = amp_fx.convert(model, "O2", dtype=torch.bfloat16, device_type="cpu")
    >>> measured = error_ratio(model, o2, (torch.randn(4, 8),))
    >>> measured.reference, measured.ratio <= RELATIVE_BOUND
    ('torch.autocast(cpu, torch.bfloat16) with _grouped_mm in torch.bfloat16', True)

The batches: the first is ``inputs`` as given; each further one has every floating input's entries
shuffled by a seeded permutation (the same values in other places, so magnitudes and ranges stay
what the caller chose) and its own seed for the loss weights and dropout. Integer inputs (token
ids, labels, masks) are kept.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from amp_fx.testing.comparison import ForwardBackward, Mismatch, as_module, compared_runs, root_mean_square
from amp_fx.testing.dtype_tolerances import RELATIVE_BOUND, relative_floor
from amp_fx.testing.references import infer_dtype, reference_for

__all__ = ["DEFAULT_BATCHES", "ErrorRatio", "TensorRatio", "error_ratio", "seeded_batches"]

# Batches the median is taken over: one unlucky batch (a tensor autocast happens to compute
# nearly exactly) does not decide the verdict.
DEFAULT_BATCHES = 7


@dataclass(frozen=True)
class TensorRatio:
    """One tensor's measurement: medians over the batches."""

    name: str
    ratio: float
    error: float
    reference_error: float

    def describe(self) -> str:
        """One line: the ratio and the two errors it divides, norm-wise relative to FP32's norm."""
        return (
            f"norm-wise error {self.error:.3g} is {self.ratio:.3g}x the reference's "
            f"{self.reference_error:.3g} (floored)"
        )


@dataclass(frozen=True)
class ErrorRatio:
    """What `error_ratio` measured: a ratio per tensor, and failures no ratio measures (an
    overflow, a missing gradient, integer outputs that differ where the reference's agree)."""

    tensors: tuple[TensorRatio, ...]
    mismatches: tuple[Mismatch, ...]
    reference: str
    batches: int

    @property
    def worst(self) -> TensorRatio | None:
        """The tensor with the largest ratio (None when nothing floating was compared)."""
        return max(self.tensors, key=lambda t: t.ratio, default=None)

    @property
    def ratio(self) -> float:
        """The largest ratio (0.0 when nothing floating was compared)."""
        worst = self.worst
        return 0.0 if worst is None else worst.ratio

    def failures(self, bound: float = RELATIVE_BOUND) -> list[str]:
        """One line per tensor over ``bound`` and per mismatch, for an AssertionError."""
        lines = [f"{m.name}: {m.message}" for m in self.mismatches]
        lines += [f"{t.name}: {t.describe()}" for t in self.tensors if not t.ratio <= bound]
        return lines


def seeded_batches(
    inputs: Sequence[Any], keyword_inputs: Mapping[str, Any] | None, count: int
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``count`` batches: the given one, then copies whose floating tensors are seeded shuffles.

    >>> batches = seeded_batches((torch.arange(4.0), torch.arange(3)), None, 2)
    >>> sorted(batches[1][0][0].tolist()), batches[1][0][1].tolist()
    ([0.0, 1.0, 2.0, 3.0], [0, 1, 2])
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"batches must be a positive int, got {count!r}")
    keyword_inputs = dict(keyword_inputs or {})
    batches = [(tuple(inputs), keyword_inputs)]
    for seed in range(1, count):
        generator = torch.Generator().manual_seed(seed)

        def shuffle(value: Any, generator: torch.Generator = generator) -> Any:
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() < 2:
                return value
            order = torch.randperm(value.numel(), generator=generator).to(value.device)
            return value.detach().reshape(-1)[order].reshape(value.shape)

        args, kwargs = pytree.tree_map(shuffle, (list(inputs), keyword_inputs))
        batches.append((tuple(args), kwargs))
    return batches


def error_ratio(
    original: torch.nn.Module | Callable[..., Any],
    converted: torch.nn.Module | Callable[..., Any],
    inputs: Sequence[Any],
    *,
    keyword_inputs: Mapping[str, Any] | None = None,
    reference: torch.nn.Module | Callable[..., Any] | None = None,
    dtype: torch.dtype | None = None,
    check_grads: bool = True,
    batches: int = DEFAULT_BATCHES,
    lowered_ops: Collection[str] | None = None,
) -> ErrorRatio:
    """Measure ``converted``'s error against the FP32 ``original``, relative to ``reference``'s.

    ``reference`` defaults to `reference_for` (torch.autocast for O1/O2, the model cast to the
    low dtype for O3); ``dtype`` (the floor's precision) to `infer_dtype`. ``lowered_ops``: the
    ATen ops on no autocast list that the default reference runs in the low dtype too (default:
    those the conversion's policy lowers, ``("_grouped_mm",)`` at O2, so mixture-of-experts
    experts are judged against experts run low the same way; ``()``: plain autocast, as the
    numerics of ``set_op("_grouped_mm", "fp32")`` promise). Outputs, and with
    ``check_grads`` the gradients of floating inputs and of parameters (matched by name), are
    measured as the module docstring says; raises AssertionError when the output structures differ.

        >>> model = torch.nn.Linear(8, 4)
        >>> measured = error_ratio(model, model, (torch.randn(2, 8),), dtype=torch.float16)
        >>> measured.ratio, measured.failures()
        (0.0, [])
    """
    if dtype is None:
        dtype = infer_dtype(converted) if isinstance(converted, torch.nn.Module) else torch.float32
    original_module = as_module(original)
    if reference is not None and lowered_ops is not None:
        raise ValueError(
            "lowered_ops shapes the default (autocast) reference; with a reference= of your own, "
            "leave lowered_ops out"
        )
    if reference is None:
        ops = None if lowered_ops is None else tuple(lowered_ops)
        reference_module, described = reference_for(original_module, converted, dtype, ops)
    else:
        reference_module, described = as_module(reference), "the given reference"
    floor = relative_floor(dtype)
    measured: dict[str, list[tuple[float, float, float]]] = {}
    mismatches: dict[str, Mismatch] = {}
    for seed, (args, kwargs) in enumerate(seeded_batches(inputs, keyword_inputs, batches)):
        actual, (expected, ref) = compared_runs(
            as_module(converted),
            [("original", original_module), ("reference", reference_module)],
            args,
            check_grads,
            keyword_inputs=kwargs,
            seed=seed,
        )
        for name, a, r, e, scale in _tensor_triples(actual, ref, expected, converted, mismatches):
            errors = _ratio(a, r, e, floor, scale, name)
            if isinstance(errors, Mismatch):
                mismatches.setdefault(name, errors)
            else:
                measured.setdefault(name, []).append(errors)
    tensors = tuple(
        TensorRatio(
            name,
            statistics.median(r for r, _, _ in values),
            statistics.median(a for _, a, _ in values),
            statistics.median(ref for _, _, ref in values),
        )
        for name, values in measured.items()
        if name not in mismatches
    )
    return ErrorRatio(tensors, tuple(mismatches.values()), described, batches)


def _tensor_triples(
    actual: ForwardBackward,
    ref: ForwardBackward,
    expected: ForwardBackward,
    converted: Any,
    mismatches: dict[str, Mismatch],
) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """(name, converted's, reference's, FP32's, floor scale) for every floating tensor compared;
    what cannot be compared as a ratio goes to ``mismatches``."""
    triples = []
    output_scale = root_mean_square([o for o in expected.outputs if isinstance(o, torch.Tensor)])
    for name, a, r, e in zip(expected.names, actual.outputs, ref.outputs, expected.outputs, strict=True):
        if isinstance(e, torch.Tensor) and e.is_floating_point() and isinstance(a, torch.Tensor):
            triples.append((name, a, r, e, output_scale))
        elif _differs(a, e) and not _differs(r, e):
            message = f"{_show(a)} differ from expected {_show(e)} (the reference's agree)"
            mismatches.setdefault(name, Mismatch(name, message))
    if not expected.input_grads and not expected.param_grads:
        return triples
    grads = [g for g in [*expected.input_grads, *expected.param_grads.values()] if g is not None]
    grad_scale = root_mean_square(grads)
    pairs = [(f"grad of input[{i}]", i) for i in range(len(expected.input_grads))]
    for name, i in pairs:
        a, r, e = actual.input_grads[i], ref.input_grads[i], expected.input_grads[i]
        if e is None and a is None:
            continue
        if a is None or e is None:
            which = "converted" if a is None else "original"
            mismatches.setdefault(name, Mismatch(name, f"the {which} model produced no gradient"))
        else:
            triples.append((name, a, r, e, grad_scale))
    converted_params = dict(converted.named_parameters()) if isinstance(converted, torch.nn.Module) else {}
    for param_name, e in expected.param_grads.items():
        name = f"grad of parameter {param_name!r}"
        a = actual.param_grads.get(param_name)
        if a is None:
            why = "has no gradient" if param_name in converted_params else "has no parameter of that name"
            mismatches.setdefault(name, Mismatch(name, f"the converted model {why}"))
        else:
            triples.append((name, a, ref.param_grads.get(param_name), e, grad_scale))
    return triples


def _ratio(
    a: torch.Tensor, r: torch.Tensor | None, e: torch.Tensor, floor: float, scale: float, name: str
) -> tuple[float, float, float] | Mismatch:
    """(ratio, converted's error, reference's floored error), errors relative to ‖e‖; or why not."""
    e = e.detach().to(torch.float64).cpu()  # once: both distances and the norm read it
    finite = torch.isfinite(e)
    all_finite = bool(finite.all())
    error = _distance(a, e, finite, all_finite, name)
    if isinstance(error, Mismatch):
        return error
    reference_error = _distance(r, e, finite, all_finite, name) if isinstance(r, torch.Tensor) else math.inf
    if isinstance(reference_error, Mismatch):
        reference_error = math.inf  # the reference overflowed (or lost the tensor): not a bound
    norm = (e if all_finite else e[finite]).norm().item()
    floored = max(reference_error, floor * (norm + scale * math.sqrt(e.numel())))
    if floored == 0.0:
        ratio = 0.0 if error == 0.0 else math.inf
    else:
        ratio = error / floored
    relative = norm if norm > 0.0 else 1.0
    return ratio, error / relative, floored / relative


def _distance(
    actual: torch.Tensor, expected: torch.Tensor, finite: torch.Tensor, all_finite: bool, name: str
) -> float | Mismatch:
    """‖actual − expected‖₂ over the ``finite`` entries of ``expected`` (float64 on the CPU, ``finite``
    its isfinite mask, ``all_finite`` whether that is all True), in float64; a Mismatch when the
    shapes differ or the non-finite entries are not the same (an overflow is never averaged away)."""
    if actual.shape != expected.shape:
        return Mismatch(name, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.float64).cpu()
    if all_finite and math.isfinite(distance := (a - expected).norm().item()):
        return distance  # the common case: no entry of either is inf/NaN, nothing to mask
    a_finite = torch.isfinite(a)
    if not torch.equal(a_finite, finite) or not torch.equal(
        a[~finite].nan_to_num(), expected[~finite].nan_to_num()
    ):
        return Mismatch(
            name,
            f"{int((a_finite != finite).sum())} element(s) are inf/NaN in one result but not "
            f"the other (actual {actual.dtype}); an overflow in {actual.dtype}?",
        )
    return (a[finite] - expected[finite]).norm().item()


def _differs(a: Any, e: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
        return a.shape != e.shape or a.dtype != e.dtype or not torch.equal(a.cpu(), e.cpu())
    if isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor):
        return True
    return bool(a != e)


def _show(value: Any) -> str:
    return f"{value.dtype} values" if isinstance(value, torch.Tensor) else repr(value)
