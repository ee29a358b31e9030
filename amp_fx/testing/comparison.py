"""The measurements `assert_equivalent` is made of: running a model forward and backward the same
way each time (`forward_backward`), and the norm-wise comparison of two tensors (`compare_tensors`).

    >>> run = forward_backward(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    >>> compare_tensors(run.outputs[0], run.outputs[0], rtol=0.0, atol=0.0) is None
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "ForwardBackward",
    "Mismatch",
    "as_module",
    "assert_close_normwise",
    "compare_tensors",
    "forward_backward",
    "normwise_error",
    "root_mean_square",
]

# The seed of the first batch's loss weights and dropout: both models see the same randomness.
DEFAULT_SEED = 0


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


def root_mean_square(tensors: list[torch.Tensor]) -> float:
    """The RMS of every finite entry of the floating ``tensors`` (0.0 when there are none).

    >>> root_mean_square([torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])])
    3.5355...
    """
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


@functools.cache
def _has_accelerator() -> bool:
    # Asked once: without CUDA, torch.cuda.is_available() tries to load NVML on every call.
    return torch.accelerator.is_available()


def _manual_seed(seed: int) -> None:
    """`torch.manual_seed` where an accelerator is present; else the CPU's generator alone, the
    same seeding: there torch.manual_seed also queues a seed for each absent backend (CUDA, XPU,
    MTIA), formatting the call stack each time, about 2 ms a call under pytest, more than a small
    model's forward and backward."""
    if _has_accelerator():
        torch.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)


def _loss_weights(outputs: list[Any], seed: int) -> list[torch.Tensor | None]:
    # A random projection of every floating output: plain `.sum()` gives zero gradients through
    # softmax or a LayerNorm without affine (their outputs sum to a constant), hiding bugs.
    generator = torch.Generator().manual_seed(seed)
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
    model: torch.nn.Module,
    inputs: Sequence[Any],
    check_grads: bool = True,
    *,
    keyword_inputs: Mapping[str, Any] | None = None,
    seed: int = DEFAULT_SEED,
) -> ForwardBackward:
    """Run ``model`` forward (and backward) the way `assert_equivalent` does, leaving it as it was.

    The inputs (positional ``inputs``, then ``keyword_inputs``) are copied (floating ones with
    ``requires_grad``); the loss is Σ⟨output, W⟩ in FP32 with random W drawn from ``seed``, which
    also seeds dropout; the model's ``.grad`` fields and buffers are restored afterwards.
    ``input_grads`` lists the gradients of the positional inputs' leaves, then the keyword ones'.

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
    kwargs = dict(zip(keyword_inputs or {}, _copy_inputs(list((keyword_inputs or {}).values())), strict=True))
    try:
        with torch.random.fork_rng(devices=[]):
            _manual_seed(seed)
            with torch.set_grad_enabled(check_grads):
                out = model(*args, **kwargs)
        outputs, spec = pytree.tree_flatten(out)
        input_grads: list[torch.Tensor | None] = []
        param_grads: dict[str, torch.Tensor] = {}
        if check_grads:
            terms = [
                (o.float() * w).sum()
                for o, w in zip(outputs, _loss_weights(outputs, seed), strict=True)
                if w is not None and o.requires_grad
            ]
            if terms:
                torch.stack(terms).sum().backward()
            leaves = pytree.tree_leaves([*args, *kwargs.values()])
            input_grads = [a.grad if isinstance(a, torch.Tensor) else None for a in leaves]
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
        # Only buffers the run changed: a copy bumps a buffer's version, and a graph the caller
        # still holds (an output not yet backpropagated) may have saved it. Compared by value, not
        # by version: BatchNorm's kernels update running statistics without bumping theirs.
        with torch.no_grad():
            for name, b in model.named_buffers():
                if not torch.equal(b, saved_buffers[name]):
                    b.copy_(saved_buffers[name])


class _FunctionModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def as_module(fn: Callable[..., Any]) -> torch.nn.Module:
    """``fn`` itself if it is a module, else a module whose forward calls it (no parameters)."""
    return fn if isinstance(fn, torch.nn.Module) else _FunctionModule(fn)
