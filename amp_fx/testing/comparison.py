"""The measurements `assert_equivalent` is made of: running a model forward and backward the same
way each time (`forward_backward`), and the norm-wise comparison of two tensors (`compare_tensors`).

    >>> run = forward_backward(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    >>> compare_tensors(run.outputs[0], run.outputs[0], rtol=0.0, atol=0.0) is None
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from amp_fx.core import containers

__all__ = [
    "ForwardBackward",
    "Mismatch",
    "as_module",
    "assert_close_normwise",
    "compared_runs",
    "compare_tensors",
    "forward_backward",
    "leaf_names",
    "normwise_error",
    "root_mean_square",
    "structure_difference",
]

# The seed of the first batch's loss weights and dropout: both models see the same randomness.
DEFAULT_SEED = 0

# The entry of a mapping output (a Hugging Face ``ModelOutput``) that holds the model's loss: an
# output the converted model leaves out (logits=None where O2 fuses the head into its loss) is
# compared through it and the gradients.
LOSS_ENTRY = "loss"


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


def _copy_inputs(inputs: Sequence[Any]) -> tuple[tuple[Any, ...], list[Any]]:
    """Fresh copies of ``inputs`` and their leaves: tensors cloned (floating ones requiring grad),
    containers rebuilt, caches too, so that a model that appends to a ``DynamicCache`` it is given
    leaves the caller's (and the next model's) untouched."""
    leaves, spec = containers.flatten(list(inputs))

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_(True) if y.is_floating_point() else y
        return x

    copies = [copy(leaf) for leaf in leaves]
    return tuple(containers.unflatten(copies, spec)[0]), copies


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
    """What `forward_backward` observed: the output's leaves (`amp_fx.core.containers.flatten`:
    tensors, and the ints a cache holds), the `containers.Spec` of everything else, and the
    gradients. ``entries``: the names of a mapping output's entries that are not None (None for
    other outputs); ``omitted``: the entries left out because the model compared with returns
    none (see `forward_backward`'s ``entries``)."""

    outputs: list[Any]
    spec: Any
    input_grads: list[torch.Tensor | None]
    param_grads: dict[str, torch.Tensor]
    entries: tuple[str, ...] | None = None
    omitted: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        """A name per output leaf, where it sits: ``output[1]`` (a tuple's; ``output[0]`` a bare
        tensor), ``output.past_key_values.layers[0].keys`` (a ``ModelOutput``'s cache)."""
        return [f"output{path or '[0]'}" for path in leaf_names(self.spec)]


def forward_backward(
    model: torch.nn.Module,
    inputs: Sequence[Any],
    check_grads: bool = True,
    *,
    keyword_inputs: Mapping[str, Any] | None = None,
    seed: int = DEFAULT_SEED,
    entries: Collection[str] | None = None,
) -> ForwardBackward:
    """Run ``model`` forward (and backward) the way `assert_equivalent` does, leaving it as it was.

    The inputs (positional ``inputs``, then ``keyword_inputs``) are copied (floating ones with
    ``requires_grad``; containers such as a ``DynamicCache`` rebuilt, so a model that fills one
    leaves the caller's as it was); the loss is Σ⟨output, W⟩ in FP32 over every floating tensor
    of the output (inside caches and other objects too), with random W drawn from ``seed``, which
    also seeds dropout; the model's ``.grad`` fields and buffers are restored afterwards.
    ``input_grads`` lists the gradients of the positional inputs' leaves, then the keyword ones'.

    A mapping output's entries that are None are left out, as a ``ModelOutput`` leaves them out.
    ``entries`` (the `ForwardBackward.entries` of the model compared with) leaves out the entries
    not named, where this model's loss (the ``"loss"`` entry) is computed from them: a head fused
    with its loss returns logits=None in training, so both models are compared by the loss, what
    else both return, and the gradients. Any other entry left out raises AssertionError.

        >>> run = forward_backward(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
        >>> sorted(run.param_grads), run.input_grads[0].shape
        (['bias', 'weight'], torch.Size([4, 3]))
    """
    params = dict(model.named_parameters())
    saved_grads = {name: p.grad for name, p in params.items()}
    saved_buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    for p in params.values():
        p.grad = None
    args, arg_leaves = _copy_inputs(inputs)
    kwarg_values, kwarg_leaves = _copy_inputs(list((keyword_inputs or {}).values()))
    kwargs = dict(zip(keyword_inputs or {}, kwarg_values, strict=True))
    try:
        with torch.random.fork_rng(devices=[]):
            _manual_seed(seed)
            with torch.set_grad_enabled(check_grads):
                out = model(*args, **kwargs)
        out, omitted = _leave_out(out, entries)
        outputs, spec = containers.flatten(out)
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
            leaves = [*arg_leaves, *kwarg_leaves]
            input_grads = [a.grad if isinstance(a, torch.Tensor) else None for a in leaves]
            param_grads = {name: p.grad for name, p in params.items() if p.grad is not None}
        return ForwardBackward(
            [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs],
            spec,
            input_grads,
            param_grads,
            _entries(out),
            omitted,
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


def compared_runs(
    converted: torch.nn.Module,
    others: Sequence[tuple[str, torch.nn.Module]],
    inputs: Sequence[Any],
    check_grads: bool = True,
    *,
    keyword_inputs: Mapping[str, Any] | None = None,
    seed: int = DEFAULT_SEED,
) -> tuple[ForwardBackward, list[ForwardBackward]]:
    """`forward_backward` of ``converted``, then of each (description, model) of ``others`` with
    the entries ``converted`` returns; AssertionError naming the first place where an output's
    structure differs from the converted one's. A dtype the output holds is no part of its
    structure: it describes tensors, which are compared whatever their dtypes (a transformers 5.17
    cache layer records its tensors' dtype, low in a converted model, FP32 in the original).

        >>> linear = torch.nn.Linear(3, 2)
        >>> actual, (expected,) = compared_runs(linear, [("original", linear)], (torch.randn(4, 3),))
        >>> torch.equal(actual.outputs[0], expected.outputs[0])
        True
    """
    actual = forward_backward(converted, inputs, check_grads, keyword_inputs=keyword_inputs, seed=seed)
    runs = []
    for who, model in others:
        run = forward_backward(
            model, inputs, check_grads, keyword_inputs=keyword_inputs, seed=seed, entries=actual.entries
        )
        if run.spec != actual.spec and _first_difference(actual.spec, run.spec, "", False) is not None:
            raise AssertionError(
                f"output structure differs: {structure_difference(actual.spec, run.spec, who)}"
            )
        runs.append(run)
    return actual, runs


def structure_difference(actual: containers.Spec, expected: containers.Spec, who: str = "original") -> str:
    """Where two output structures first differ, in words (the converted model's is ``actual``);
    dtypes they hold may differ (see `compared_runs`).

    >>> spec = lambda value: containers.flatten(value)[1]
    >>> structure_difference(spec({"a": torch.ones(1), "b": None}), spec({"a": torch.ones(1), "b": 1}))
    "at ['b']: the converted model returns None, the original 1"
    """
    path = _first_difference(actual, expected, "", False)
    where, a, e = path if path is not None else ("", actual, expected)
    return f"at {where or 'the top'}: the converted model returns {_describe(a)}, the {who} {_describe(e)}"


def _first_difference(
    a: containers.Spec, e: containers.Spec, path: str, attributes: bool
) -> tuple[str, containers.Spec, containers.Spec] | None:
    if a == e or (_is_dtype(a) and _is_dtype(e)):
        return None
    if a.kind != e.kind or a.kind not in ("node", "object") or len(a.children) != len(e.children):
        return path, a, e
    if a.kind == "object":
        if a.value is not e.value:
            return path, a, e
        return _first_difference(a.children[0], e.children[0], path, True)
    if a.value != e.value:  # another type, or other keys: say which keys
        return path, a, e
    steps = [step for step, _ in _child_steps(a, attributes)]
    for step, a_child, e_child in zip(steps, a.children, e.children, strict=True):
        if (found := _first_difference(a_child, e_child, path + step, False)) is not None:
            return found
    return None  # they differ only in the dtypes they hold


def _is_dtype(spec: containers.Spec) -> bool:
    return spec.kind == "constant" and isinstance(spec.value, torch.dtype)


def _child_steps(spec: containers.Spec, attributes: bool) -> list[tuple[str, containers.Spec]]:
    node_type, context = spec.value
    keys = context.context
    if not (isinstance(keys, (tuple, list)) and len(keys) == len(spec.children)):
        keys = range(len(spec.children))
    # Attributes and a ModelOutput's fields by name (".loss"), a dict's keys by index ("['a']").
    by_name = attributes or dataclasses.is_dataclass(node_type) or not issubclass(node_type, dict)
    return [
        (f".{key}" if by_name and isinstance(key, str) else f"[{key!r}]", child)
        for key, child in zip(keys, spec.children, strict=True)
    ]


def _describe(spec: containers.Spec) -> str:
    if spec.kind == "leaf":
        return "a tensor"
    if spec.kind == "constant":
        return repr(spec.value)
    if spec.kind == "same":
        return "one of its inputs"
    if spec.kind == "object":
        return f"a {spec.value.__name__}"
    node_type, context = spec.value
    keys = context.context
    if isinstance(keys, (tuple, list)) and len(keys) == len(spec.children):
        return f"a {node_type.__name__} of {', '.join(map(str, keys))}"
    return f"a {node_type.__name__} of {len(spec.children)}"


def _entries(out: Any) -> tuple[str, ...] | None:
    return tuple(out) if isinstance(out, dict) else None


def _leave_out(out: Any, entries: Collection[str] | None) -> tuple[Any, tuple[str, ...]]:
    """``out`` without its None entries and, where ``entries`` is given, those it does not name
    (each checked to be something the loss is computed from); and the names left out for that."""
    if not isinstance(out, dict):
        return out, ()
    omitted = tuple(k for k, v in out.items() if v is not None and entries is not None and k not in entries)
    if not omitted and all(v is not None for v in out.values()):
        return out, ()
    for name in omitted:
        _check_feeds_the_loss(out, name)
    kept = {k: v for k, v in out.items() if v is not None and k not in omitted}
    # A ModelOutput is a dataclass built from its fields; a dict subclass from a dict.
    rebuilt = type(out)(**kept) if dataclasses.is_dataclass(out) else type(out)(kept)
    return rebuilt, omitted


def _check_feeds_the_loss(out: dict, name: str) -> None:
    loss, value = out.get(LOSS_ENTRY), out[name]
    problem = None
    if name == LOSS_ENTRY or type(loss) is not torch.Tensor:
        problem = f"it returns no {LOSS_ENTRY!r} to compare by"
    elif not isinstance(value, torch.Tensor) or not value.is_floating_point():
        problem = f"{name!r} is not a floating tensor here ({type(value).__name__})"
    elif loss.grad_fn is None:
        problem = "without gradients (check_grads=False) there is no graph to check it by"
    elif not _computed_from(loss, value):
        problem = f"the {LOSS_ENTRY!r} is not computed from {name!r}"
    if problem is not None:
        raise AssertionError(
            f"output structure differs: the converted model returns no {name!r}; an output may "
            f"be left out only where the model's {LOSS_ENTRY!r} is computed from it (a head "
            f"fused with its loss returns logits=None in training), but {problem}"
        )


def _computed_from(loss: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether autograd recorded ``loss`` (which has a ``grad_fn``) as computed from ``value``."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node is value.grad_fn:
            return True
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return False


def leaf_names(spec: containers.Spec) -> list[str]:
    """Where each leaf of ``spec`` sits, as attribute and index accesses ('' for a bare tensor).

    >>> leaf_names(containers.flatten({"a": [torch.ones(1), 2, torch.ones(1)]})[1])
    ["['a'][0]", "['a'][2]"]
    """
    names: list[str] = []
    _name_leaves(spec, "", False, names)
    return names


def _name_leaves(spec: containers.Spec, path: str, attributes: bool, names: list[str]) -> None:
    if spec.kind == "leaf":
        names.append(path)
        return
    if spec.kind == "object":  # one child, the attribute dict
        _name_leaves(spec.children[0], path, True, names)
        return
    if spec.kind != "node":
        return
    for step, child in _child_steps(spec, attributes):
        _name_leaves(child, path + step, False, names)


class _FunctionModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def as_module(fn: Callable[..., Any]) -> torch.nn.Module:
    """``fn`` itself if it is a module, else a module whose forward calls it (no parameters)."""
    return fn if isinstance(fn, torch.nn.Module) else _FunctionModule(fn)
