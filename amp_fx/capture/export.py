"""Convert's torch.export front end: capture one call of a model with ``torch.export`` (non-strict).

`trace` (torch.fx symbolic tracing) needs no inputs but stops at the first Python line that
looks at a tensor's value or iterates a proxy, and Hugging Face transformers 5's
``forward(self, *args, **kwargs)`` wrappers stop it at the root. ``torch.export`` with
``strict=False`` runs the model's Python for real, on fake tensors of the call's shapes, and
records the ATen ops it reaches: asserts on sizes (nanoGPT's ``assert t <= block_size``),
keyword arguments, ``ModelOutput`` results and dtype-dependent code all capture. The graph reads
parameters and buffers with ``get_attr`` under their original names and its ops are the ATen
ops torch.autocast's lists name, so the convert passes run on it unchanged.

`export_graph` captures the call's sizes, or with ``dynamic=True`` every dimension of every tensor
argument ``Dim.AUTO`` (export keeps a dimension dynamic unless the code pins it), so a smaller last
batch or another sequence length runs the same graph. `amp_fx.capture.call_signature` says
whether a call fits a captured graph (same argument structure, constants and dtypes; sizes within
the captured ranges): `accepts` reads the graph, and `call_signature` decides the same for calls
whose arguments are tensors and constants in plain Python that torch.compile traces and guards on
(Dynamo cannot trace `accepts`, and a graph break inside a model's forward makes every output of
the model, a causal LM's float32 logits, a tensor the compiled code must materialise).
It captures inside ``torch.autocast`` when asked, so Python code that reads a dtype
(``finfo(dtype).min`` for a mask, ``x.to(input_dtype)`` in an RMSNorm) sees the dtypes the
converted model runs with; the ops recorded are those before autocast, with no autocast region
in the graph.

Example::

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> gm = export_graph(model, (torch.randn(2, 4),), {}, dynamic=True)
    >>> [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    ['aten.linear.default', 'aten.relu.default']
    >>> from amp_fx.capture.call_signature import accepts
    >>> accepts(gm, (torch.randn(5, 4),), {}), accepts(gm, (torch.randn(5, 3),), {})
    (True, False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import operator
import os
import sys
import traceback
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from amp_fx.capture import autograd_functions
from amp_fx.capture.autograd_functions import intercepted_applies
from amp_fx.capture.call_signature import (
    KEYWORDS_ATTR,
    RANGES_ATTR,
    SIGNATURE_ATTR,
    in_capture_order,
    signature_of,
)
from amp_fx.capture.export_meta_kernels import fp32_grouped_mm
from amp_fx.capture.python_state import report, watching_python_state
from amp_fx.capture.torch_source import TORCH_DIR as _TORCH_DIR
from amp_fx.core.containers import Spec, flatten, leaves_in_objects, outer_objects, unflatten, write_back

logger = logging.getLogger(__name__)

__all__ = [
    "ExportError",
    "ADVICE",
    "export_graph",
    "graph_inputs",
    "ContainerCall",
    "container_call",
    "call_graph",
]

# Where a graph captured with containers keeps how it is called.
_CONTAINERS_ATTR = "_amp_fx_container_call"
# Nodes of an exported graph that check what the capture saw: the dtype asserts would refuse the
# casts the passes insert, and `accepts` checks the inputs before the graph runs.
_CAPTURE_CHECKS = {torch.ops.aten._assert_tensor_metadata.default}
_GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
_GUARDS_MODULE = "_guards_fn"


class ExportError(RuntimeError):
    """``torch.export`` could not capture a call; the message names the line that stopped it.

    ``kind`` is what stopped it (a key of `ADVICE`: ``"container"``, ``"data-dependent"``,
    ``"custom-backward"`` or ``"other"``) and ``advice`` what would let the call capture.
    """

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.advice = ADVICE[kind]


# What stops torch.export, recognised by its message, and what makes the code capture.
_MARKERS = {
    "container": ("not a known type", "unsupported input type", "register a pytree", "pytree container"),
    "data-dependent": ("data-dependent", "data dependent", "guard_on_data_dependent", ".item()"),
    "custom-backward": ("customautogradfunction",),
}
ADVICE = {
    "container": (
        "a value of a type torch.export cannot flatten crosses the module's boundary, and amp_fx "
        "could not take it apart by its attributes either: pass and return its tensors instead"
    ),
    "data-dependent": (
        "control flow or a size depends on a tensor's values: make that line independent of "
        "them (torch.where, torch.cond, or sizes known from the inputs' shapes)"
    ),
    "custom-backward": (
        "the code calls a torch.autograd.Function, whose own backward a graph would lose (it would "
        "differentiate the forward's ops instead): the island runs it eagerly, backward included"
    ),
    "other": "the module's own code runs correctly in the island; the error is what torch.export refused",
}


def _failure_kind(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".lower()
    return next((kind for kind, markers in _MARKERS.items() if any(m in text for m in markers)), "other")


def _dynamic_shapes(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], ints: bool
) -> dict[str, Any]:
    # By the forward's parameter names, as torch.export matches them (a *args parameter holds a
    # tuple, a **kwargs one a dict); every dimension of every tensor AUTO, and with ``ints`` every
    # int argument (the counts a container holds, `amp_fx.core.containers`).
    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {dim: torch.export.Dim.AUTO for dim in range(value.dim())}
        if ints and type(value) is int:
            return torch.export.Dim.AUTO
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: pytree.tree_map(spec, value, is_leaf=lambda x: x is None) for name, value in bound.items()}


# Frames of the capture's own code, which a stopping line is never in.
_OWN_FILES = (__file__, autograd_functions.__file__)


def _stopping_line(error: BaseException) -> str:
    """``file:line: source`` of the innermost frame outside torch that the error passed through."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith((_TORCH_DIR, "<")) and frame.filename not in _OWN_FILES
    ]
    if not frames:
        return "inside torch"
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno}: {(frame.line or '').strip()}"


_MESSAGE_LIMIT = 300


def _first_line(error: BaseException) -> str:
    """The error's type and its first sentence (torch's own advice follows it, and is about
    torch.export, not about the user's model), cut at a word past `_MESSAGE_LIMIT`."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    end = text.find(". ")
    if end > 0:
        text = text[: end + 1]
    if len(text) <= _MESSAGE_LIMIT:
        return text
    return text[: text.rfind(" ", 0, _MESSAGE_LIMIT)] + " ..."


# When a capture meets data-dependent code, torch logs and prints the partial graph (hundreds of
# lines); the ExportError, or the island's warning, names the line instead. The graph goes to
# amp_fx's DEBUG log; what a capture that succeeds writes to stderr is passed on as it was.
_NOISY_TORCH_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export")


@contextlib.contextmanager
def _torch_failure_output_to_debug_log() -> Any:
    loggers = [logging.getLogger(name) for name in _NOISY_TORCH_LOGGERS]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.ERROR)
    printed = io.StringIO()
    failed = False
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)
        if failed:
            logger.debug("torch.export's output:\n%s", printed.getvalue())
        else:
            sys.stderr.write(printed.getvalue())


def _export(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: bool, containers: bool
) -> Any:
    shapes = _dynamic_shapes(model, args, kwargs, ints=containers) if dynamic else None
    # An FP32 model's grouped expert products capture too (torch's meta kernel takes bf16/fp16 only).
    with intercepted_applies(_refuse_custom_backward), fp32_grouped_mm():
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=False)


class CustomAutogradFunction(RuntimeError):
    """The captured code called a ``torch.autograd.Function`` where gradients flow: torch.export
    records its forward's ops, and the graph would differentiate those instead of its backward."""


def _refuse_custom_backward(cls: type, apply: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise CustomAutogradFunction(
            f"{cls.__qualname__} is a torch.autograd.Function with a backward of its own, which a "
            "captured graph would not run"
        )
    return apply(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class ContainerCall:
    """How a graph captured with ``containers=True`` is called (`call_graph`): it takes the tensors
    of ``(args, kwargs)`` (`amp_fx.core.containers.flatten`) and returns those of the output, then
    those of the call's own objects after the call, which are written back into the caller's."""

    arguments: Spec
    output: Spec
    after: Spec

    def call(
        self,
        gm: torch.fx.GraphModule,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any] | None = None,
    ) -> Any:
        """``leaves``: ``flatten((args, kwargs))``'s, where the caller has them already."""
        if leaves is None:
            leaves = flatten((args, kwargs))[0]
        originals = outer_objects((args, kwargs))
        flat = list(gm(*leaves))
        count = self.output.leaves
        states, _ = unflatten(flat[count:], self.after)
        write_back(originals, states)
        return unflatten(flat[:count], self.output, originals)[0]


def container_call(gm: torch.fx.GraphModule) -> ContainerCall | None:
    """The `ContainerCall` of a graph captured with ``containers=True``, else None."""
    return getattr(gm, _CONTAINERS_ATTR, None)


def kept_dtypes(gm: torch.fx.GraphModule) -> tuple[frozenset[int], frozenset[int]]:
    """The indices of ``gm``'s flat outputs and of its placeholders that keep their dtype (the
    conversion's ``keep_output_dtype`` and ``keep_input_dtype``); both empty for a graph captured
    without containers."""
    call = container_call(gm)
    if call is None:
        return frozenset(), frozenset()
    # A cache's tensors and a container's state keep their dtype (an O2 KV cache stays low).
    outputs = [*leaves_in_objects(call.output), *[True] * call.after.leaves]
    # And a cache passed in is seen as it is: the next call's graph then fits what this one returns.
    inputs = leaves_in_objects(call.arguments)
    return (
        frozenset(i for i, keep in enumerate(outputs) if keep),
        frozenset(i for i, keep in enumerate(inputs) if keep),
    )


def call_graph(
    gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any] | None = None
) -> Any:
    """Run a graph of `export_graph` on a call of the model it was captured from (``leaves``: see
    `ContainerCall.call`)."""
    containers = container_call(gm)
    return gm(*args, **kwargs) if containers is None else containers.call(gm, args, kwargs, leaves)


@contextlib.contextmanager
def _forward_on_leaves(model: nn.Module, arguments: Spec, calls: list[ContainerCall]) -> Any:
    """While open, ``model``'s forward takes the call's tensors: it rebuilds the arguments (cache
    objects included) from them, runs the real forward and returns tensors only, so torch.export
    sees no container it does not know. The `ContainerCall` it records goes to ``calls``."""
    real = model.forward
    own = model.__dict__.get("forward")

    def forward(*leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        (args, kwargs), objects = unflatten(list(leaves), arguments)
        output = real(*args, **kwargs)
        output_leaves, output_spec = flatten(output, objects)
        after_leaves, after_spec = flatten([dict(vars(obj)) for obj in objects])
        calls.append(ContainerCall(arguments, output_spec, after_spec))
        return (*output_leaves, *after_leaves)

    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def export_graph(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    autocast: tuple[str, torch.dtype] | None = None,
    dynamic: bool = False,
    containers: bool = False,
) -> torch.fx.GraphModule:
    """Capture ``model(*args, **kwargs)`` as a GraphModule of ATen ops (see the module docstring).

    The GraphModule shares the model's parameters and buffers (same tensor objects, same
    qualified names) and takes the call's arguments as the model does, keyword arguments
    included; its output has the model's output type. ``autocast=(device_type, dtype)`` captures
    inside ``torch.autocast``. ``dynamic=True`` makes every size dynamic that the code allows
    (falling back to the call's sizes where export refuses); else the call's sizes are captured.
    ``containers=True`` captures calls whose arguments or output hold containers torch.export
    does not know (a ``DynamicCache``): the graph then takes and returns tensors only, and
    `call_graph` runs it on the model's arguments (`ContainerCall`).

    Raises:
        ExportError: torch.export could not capture the call; names the line that stopped it.
    """
    region = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
    errors: list[Exception] = []
    calls: list[ContainerCall] = []
    if containers:
        leaves, arguments = flatten((args, kwargs))
        args, kwargs = tuple(leaves), {}
        on_leaves: Any = _forward_on_leaves(model, arguments, calls)
    else:
        on_leaves = contextlib.nullcontext()
    # Python the graph cannot record (random, time, attributes assigned) is reported, and the
    # attributes the capture assigned are put back: a capture leaves the module as it found it.
    # Captured with grad on, so the forward's own no_grad() regions are in the graph even where
    # the first call ran under the caller's no_grad() (the graph serves calls in either mode).
    with watching_python_state(model) as findings, torch.enable_grad(), region, on_leaves:
        for sizes in (True, False) if dynamic else (False,):
            try:
                with _torch_failure_output_to_debug_log():
                    program = _export(model, args, kwargs, sizes, containers)
                break
            except Exception as error:  # torch.export raises many types; each is reported
                errors.append(error)
        else:
            error = errors[-1]
            raise ExportError(
                f"torch.export could not capture {type(model).__name__}: {_first_line(error)} "
                f"(stopped at {_stopping_line(error)})",
                _failure_kind(error),
            ) from error
    report(model, findings, "torch.export")
    if errors:
        logger.info("%s: dynamic sizes refused (%s); captured static sizes", type(model).__name__, errors[0])
    gm = _clean(program, type(model).__name__, kwargs)
    setattr(gm, SIGNATURE_ATTR, signature_of(gm, args, kwargs))
    if calls:
        call = calls[-1]
        setattr(gm, _CONTAINERS_ATTR, call)
    return gm


def _clean(program: Any, name: str, keywords: dict[str, Any]) -> torch.fx.GraphModule:
    exported = program.module()
    graph = exported.graph
    _inline_grad_regions(exported)
    # torch.export writes each buffer the forward updated back with copy_(buffer, new value), also
    # where the new value is the buffer itself, updated in place (`self.count += 1`): that copy
    # would only bump the buffer's version, and a backward that saved it would refuse to run.
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _CAPTURE_CHECKS:
            graph.erase_node(node)
        elif node.op == "call_module" and node.target == _GUARDS_MODULE:
            graph.erase_node(node)
        elif node.target is _COPY and _updated_in_place(node.args[1]) is node.args[0]:
            graph.erase_node(node)
    # A plain GraphModule: export's own one carries pre-hooks that check inputs (`accepts` does)
    # and a guards submodule the graph no longer calls.
    gm = torch.fx.GraphModule(exported, graph, class_name=name)
    gm._in_spec = exported._in_spec
    gm._out_spec = exported._out_spec
    setattr(gm, RANGES_ATTR, dict(program.range_constraints))
    setattr(gm, KEYWORDS_ATTR, tuple(keywords))
    gm.recompile()
    return gm


_COPY = torch.ops.aten.copy_.default


def _updated_in_place(node: Any) -> Any:
    """The tensor an in-place op (``add_(count, 1)``), or a chain of them, updated: a buffer a
    forward updated in place is the same tensor as its new value."""
    while isinstance(node, torch.fx.Node) and _writes_first_argument(node.target):
        node = node.args[0]
    return node


def _writes_first_argument(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    return (
        first is not None
        and first.is_write
        and bool(schema.returns)
        and schema.returns[0].alias_info is not None
    )


def _inline_grad_regions(gm: torch.fx.GraphModule) -> None:
    """Inline the ``torch.no_grad()`` / ``enable_grad()`` regions torch.export wraps in the
    higher-order op ``wrap_with_set_grad_enabled`` (a subgraph the passes would not enter, whose
    ops would then run uncast): their ops join the graph between ``torch._C._set_grad_enabled``
    calls, as the model's code switches the mode, so the passes rewrite them like any other."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _GRAD_REGION:
            continue
        enabled, body, *operands = node.args
        region = getattr(gm, body.target)
        _inline_grad_regions(region)
        with graph.inserting_before(node):
            previous = graph.call_function(torch.is_grad_enabled)
            graph.call_function(torch._C._set_grad_enabled, (enabled,))
            values = dict(zip(region.graph.find_nodes(op="placeholder"), operands, strict=True))
            result: Any = None
            for inner in region.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    result = torch.fx.map_arg(inner.args[0], values.__getitem__)
                    break
                if inner.op == "get_attr":  # a constant of the region becomes the root's
                    name = f"{body.target}_{inner.target}".replace(".", "_")
                    setattr(gm, name, getattr(region, inner.target))
                    values[inner] = graph.get_attr(name)
                    values[inner].meta.update(inner.meta)
                    continue
                values[inner] = graph.node_copy(inner, values.__getitem__)
            graph.call_function(torch._C._set_grad_enabled, (previous,))
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                graph.erase_node(user)
        if node.users:
            node.replace_all_uses_with(result)
        graph.erase_node(node)
        if not body.users:
            graph.erase_node(body)
            delattr(gm, body.target)


def graph_inputs(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The call's arguments in the order of ``gm``'s placeholders (pytree-flattened)."""
    if container_call(gm) is not None:
        return flatten((args, kwargs))[0]
    return pytree.tree_flatten((args, in_capture_order(gm, kwargs)))[0]
