"""`assert_equivalent`: does a converted model compute what the FP32 original computes?

    >>> import torch, amp_fx
    >>> from amp_fx.testing import assert_equivalent
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16, device_type="cpu")
    >>> assert_equivalent(model, converted, (torch.randn(4, 8),))  # raises AssertionError if not

Both models run forward on copies of the same inputs, then backward from the same scalar loss,
and outputs, input gradients and parameter gradients (matched by name) are compared in FP32 with
the norm-wise measure and the dtype's tolerances from `amp_fx.testing.tolerances`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.node_info import POLICY_KEY
from amp_fx.testing.dtype_tolerances import grad_tolerances, tolerances

# Fixed seed for the loss weights and for dropout: both models see the same randomness.
_SEED = 0


@dataclass(frozen=True)
class Mismatch:
    """One tensor that did not agree: what it is and by how much."""

    name: str
    message: str


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖₂ / ‖expected‖₂ computed in float64 (inf when expected is all zero).

    >>> normwise_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    0.0
    """
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    diff = (a - e).norm().item()
    ref = e.norm().item()
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref


def compare_tensors(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    scale: float = 0.0,
    name: str = "tensor",
) -> Mismatch | None:
    """Check ``‖actual − expected‖₂ ≤ rtol·(‖expected‖₂ + scale·√n) + atol·√n``; return what failed or None.

    ``n`` is the number of elements. ``scale`` (default 0) is the typical magnitude of the values
    ``expected`` was summed from: a gradient that cancels to nearly zero (the bias of a layer
    followed by a normalization, whose exact gradient is 0) carries rounding error relative to
    the gradients it is a sum of, not to its own near-zero value; `assert_equivalent` passes the
    root-mean-square of all the original model's gradients.

    Shapes must match; integer and bool tensors must be equal; where ``expected`` is inf or NaN
    ``actual`` must be the same, and ``actual`` may be non-finite nowhere else (an overflow in
    fp16 is a failure, never averaged away). Dtypes may differ: both are compared in float64.

        >>> compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001]), rtol=1e-3, atol=0.0)
    """
    if actual.shape != expected.shape:
        return Mismatch(name, f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if not expected.is_floating_point() or not actual.is_floating_point():
        if actual.dtype != expected.dtype or not torch.equal(actual.detach().cpu(), expected.detach().cpu()):
            return Mismatch(name, f"{actual.dtype} values differ from expected {expected.dtype} values")
        return None
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    finite = torch.isfinite(e)
    if not torch.equal(torch.isfinite(a), finite) or not torch.equal(
        a[~finite].nan_to_num(), e[~finite].nan_to_num()
    ):
        bad = int((torch.isfinite(a) != finite).sum())
        return Mismatch(
            name,
            f"{bad} element(s) are inf/NaN in one result but not the other "
            f"(actual {actual.dtype}: {int((~torch.isfinite(a)).sum())} non-finite, "
            f"expected: {int((~finite).sum())}); an overflow in {actual.dtype}?",
        )
    a, e = a[finite], e[finite]
    if a.numel() == 0:
        return None
    diff = (a - e).norm().item()
    ref = e.norm().item()
    bound = rtol * (ref + scale * math.sqrt(a.numel())) + atol * math.sqrt(a.numel())
    if diff <= bound:
        return None
    abs_err = (a - e).abs()
    worst = int(abs_err.argmax())
    return Mismatch(
        name,
        f"norm-wise error ‖a−e‖/‖e‖ = {diff / ref if ref else math.inf:.3g} exceeds rtol {rtol:g} "
        f"(‖a−e‖ = {diff:.3g} > bound {bound:.3g} with atol {atol:g}, scale {scale:.3g}); "
        f"max abs error {abs_err.max().item():.3g} "
        f"at flat index {worst} (actual {a[worst].item():.6g}, expected {e[worst].item():.6g}); "
        f"shape {tuple(actual.shape)}, actual dtype {actual.dtype}",
    )


def assert_close_normwise(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    scale: float = 0.0,
    name: str = "tensor",
) -> None:
    """`compare_tensors`, raising AssertionError with the message when the tensors disagree.

    >>> assert_close_normwise(torch.ones(3), torch.ones(3), rtol=1e-5, atol=0.0)
    """
    mismatch = compare_tensors(actual, expected, rtol=rtol, atol=atol, scale=scale, name=name)
    if mismatch is not None:
        raise AssertionError(f"{mismatch.name}: {mismatch.message}")


def infer_dtype(converted: torch.nn.Module) -> torch.dtype:
    """The precision a converted model computes in: the policy's dtype (FP32 for O0), else the
    lowest-precision floating dtype among its parameters and buffers, else torch.float32."""
    policy = converted.meta.get(POLICY_KEY) if isinstance(converted, torch.fx.GraphModule) else None
    if policy is not None:
        return policy.dtype if policy.level.lowers_precision else torch.float32
    for tensor in [*converted.parameters(), *converted.buffers()]:
        if tensor.dtype in LOW_PRECISION_DTYPES:
            return tensor.dtype
    return torch.float32


def _rms(tensors: list[torch.Tensor]) -> float:
    values = [t.detach().to(torch.float64).flatten() for t in tensors if t.is_floating_point()]
    flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    flat = flat[torch.isfinite(flat)]
    return flat.square().mean().sqrt().item() if flat.numel() else 0.0


def _copy_inputs(inputs: Sequence[Any]) -> tuple[Any, ...]:
    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_(True) if y.is_floating_point() else y
        return x

    return tuple(pytree.tree_map(copy, list(inputs)))


def _loss_weights(outputs: list[Any]) -> list[torch.Tensor | None]:
    # A random projection of every floating output: plain `.sum()` gives zero gradients through
    # softmax or a LayerNorm without affine (their outputs sum to a constant), hiding bugs.
    generator = torch.Generator().manual_seed(_SEED)
    weights: list[torch.Tensor | None] = []
    for out in outputs:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            weights.append(torch.randn(out.shape, generator=generator, dtype=torch.float32).to(out.device))
        else:
            weights.append(None)
    return weights


@dataclass
class ForwardBackward:
    """What `forward_backward` observed: flattened outputs, their structure, and the gradients."""

    outputs: list[Any]
    spec: Any
    input_grads: list[torch.Tensor | None]
    param_grads: dict[str, torch.Tensor]


def forward_backward(
    model: torch.nn.Module, inputs: Sequence[Any], check_grads: bool = True
) -> ForwardBackward:
    """Run ``model`` forward (and backward) the way `assert_equivalent` does, leaving it as it was.

    The inputs are copied (floating ones with ``requires_grad``); the loss is Σ⟨output, W⟩ in FP32
    with fixed random W; the model's ``.grad`` fields and buffers are restored afterwards.

        >>> run = forward_backward(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
        >>> sorted(run.param_grads), run.input_grads[0].shape
        (['bias', 'weight'], torch.Size([4, 3]))
    """
    params = dict(model.named_parameters())
    saved_grads = {name: p.grad for name, p in params.items()}
    saved_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    for p in params.values():
        p.grad = None
    args = _copy_inputs(inputs)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            with torch.set_grad_enabled(check_grads):
                out = model(*args)
        outputs, spec = pytree.tree_flatten(out)
        input_grads: list[torch.Tensor | None] = []
        param_grads: dict[str, torch.Tensor] = {}
        if check_grads:
            terms = [
                (o.float() * w).sum()
                for o, w in zip(outputs, _loss_weights(outputs), strict=True)
                if w is not None and o.requires_grad
            ]
            if terms:
                torch.stack(terms).sum().backward()
            input_grads = [
                a.grad if isinstance(a, torch.Tensor) else None for a in pytree.tree_leaves(list(args))
            ]
            param_grads = {name: p.grad for name, p in params.items() if p.grad is not None}
        return ForwardBackward(
            [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs],
            spec,
            input_grads,
            param_grads,
        )
    finally:
        # Leave the models as they were: gradients the caller had, running statistics.
        for name, p in params.items():
            p.grad = saved_grads[name]
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved_buffers[name])


def assert_equivalent(
    original: torch.nn.Module | Callable[..., Any],
    converted: torch.nn.Module | Callable[..., Any],
    inputs: Sequence[Any],
    *,
    dtype: torch.dtype | None = None,
    check_grads: bool = True,
    exact: bool = False,
) -> None:
    """Assert that ``converted`` computes ``original``'s outputs and gradients within tolerance.

    Both run on their own copies of ``inputs`` (floating inputs get ``requires_grad``), under
    the same RNG seed (dropout masks match when the op order does), in their current train/eval
    mode; their ``.grad`` fields and buffers are restored afterwards. With ``check_grads`` a
    scalar loss, Σ⟨output, W⟩ in FP32 with fixed random W, is backpropagated through both and
    the gradients of floating inputs and of parameters (matched by name; converted parameters
    may be fp16/bf16, compared in FP32) are compared with `grad_tolerances(dtype)`, outputs
    with `tolerances(dtype)`, using the norm-wise measure of `compare_tensors`; for gradients
    its ``scale`` is the RMS of all the original's gradients, so a gradient that cancels to ~0
    is held to the accuracy of the gradients it is summed from.

    ``dtype`` is the low precision the model was converted to; by default it is read from the
    GraphModule's policy (``gm.meta["amp_fx_policy"]``) or its parameters. ``exact=True``
    demands bit-identical outputs and gradients instead (O0 against the original, O1 against
    `with_autocast`).

    Raises AssertionError listing every tensor that disagreed, with its norm-wise error, largest
    absolute error and where it occurred.

        >>> model = torch.nn.Linear(4, 3)
        >>> import copy
        >>> rounded = copy.deepcopy(model).half().float()  # weights rounded to fp16
        >>> assert_equivalent(model, rounded, (torch.randn(2, 4),), dtype=torch.float16)
    """
    if not callable(original) or not callable(converted):
        raise TypeError(
            "assert_equivalent expects two callables (nn.Module or GraphModule) and a tuple of inputs"
        )
    if isinstance(inputs, torch.Tensor) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"inputs must be a tuple of positional arguments, e.g. (x,), got {type(inputs).__name__}"
        )
    if dtype is None:
        dtype = infer_dtype(converted) if isinstance(converted, torch.nn.Module) else torch.float32
    out_rtol, out_atol = (0.0, 0.0) if exact else tolerances(dtype)
    grad_rtol, grad_atol = (0.0, 0.0) if exact else grad_tolerances(dtype)
    expected = forward_backward(_as_module(original), inputs, check_grads)
    actual = forward_backward(_as_module(converted), inputs, check_grads)

    mismatches: list[Mismatch] = []
    if actual.spec != expected.spec:
        raise AssertionError(
            f"output structure differs: converted returns {actual.spec}, original {expected.spec}"
        )
    for i, (a, e) in enumerate(zip(actual.outputs, expected.outputs, strict=True)):
        name = f"output[{i}]"
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


def with_autocast(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of ``model`` whose forward runs under ``torch.autocast(device_type, dtype)``.

    Parameter names are the model's own, so it is a reference for `assert_equivalent`: an O1
    conversion on CPU must match it bit for bit.

        >>> reference = with_autocast(torch.nn.Linear(4, 2), "cpu", torch.bfloat16)
        >>> reference(torch.randn(3, 4)).dtype
        torch.bfloat16
    """
    copied = copy.deepcopy(model)
    forward = copied.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    copied.forward = autocast_forward
    return copied


def low_precision_copy(
    model: torch.nn.Module, dtype: torch.dtype, output_dtype: torch.dtype | None = torch.float32
) -> torch.nn.Module:
    """A deep copy of ``model`` in pure ``dtype``: parameters, buffers and floating inputs cast.

    Floating outputs are cast to ``output_dtype`` (None: left in ``dtype``). This is Apex's O3
    (``model.half()``), so an O3 conversion must match it bit for bit; parameter names are the
    model's own, for `assert_equivalent`.

        >>> low = low_precision_copy(torch.nn.Linear(4, 2), torch.float16)
        >>> low.weight.dtype, low(torch.randn(3, 4)).dtype
        (torch.float16, torch.float32)
    """
    copied = copy.deepcopy(model).to(dtype)
    forward = copied.forward

    def cast(value: Any, to: torch.dtype | None) -> Any:
        if to is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(to)
        return value

    def low_precision_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map(lambda v: cast(v, dtype), (args, kwargs))
        return pytree.tree_map(lambda v: cast(v, output_dtype), forward(*args, **kwargs))

    copied.forward = low_precision_forward
    return copied


def _compare_gradients(
    actual: ForwardBackward, expected: ForwardBackward, converted: Any, *, rtol: float, atol: float
) -> list[Mismatch]:
    scale = _rms([g for g in [*expected.input_grads, *expected.param_grads.values()] if g is not None])
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


class _FunctionModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _as_module(fn: Callable[..., Any]) -> torch.nn.Module:
    return fn if isinstance(fn, torch.nn.Module) else _FunctionModule(fn)
