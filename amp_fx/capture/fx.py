"""Convert's torch.fx front end: trace a model into a `torch.fx.GraphModule` whose leaves are primitive ops.

Composite modules (``nn.Sequential``, ``nn.TransformerEncoderLayer``, user blocks, ...) are traced
through; *primitive* ``torch.nn`` modules (Linear, ConvNd, norms, activations, pooling, Embedding,
...) stay as ``call_module`` leaves, so a policy can decide per module. Whatever cannot be traced
becomes an *opaque* node instead of an error:

* ``nn.MultiheadAttention`` and the RNN family are opaque by design (fused kernels with
  data-dependent fast paths);
* modules named in ``leaf_modules`` (by type or by qualified name) are opaque on purpose;
* a submodule whose forward stops the tracer (``if x.sum() > 0:``) is made opaque automatically,
  and the file, line and source that stopped the tracer are recorded;
* functions registered with ``torch.fx.wrap`` (torchvision's Swin ``shifted_window_attention``,
  ``stochastic_depth``, ...) appear as opaque ``call_function`` nodes.

torch.nn's transformer layers are traced along their non-fast path (the one autograd and autocast
take): the MHA fast path is switched off while tracing, and ``nn.TransformerEncoder``'s
shape checks, which fx cannot trace, are skipped.

Each opaque node carries ``node_info(node).rule == Rule.OPAQUE`` and an ``opaque_reason``.
Only when the top-level forward itself cannot be traced does `trace` raise `TraceError`,
naming the line and suggesting ``concrete_args``.

The model is deep-copied first, so the returned GraphModule owns its parameters, buffers and
submodules and later passes (e.g. casting parameters to fp16) never touch the input model. The
copy is the largest part of the cost (about 0.1-0.2 s for resnet50 on CPU; tracing itself takes
about 0.05 s). The result is a `TracedGraphModule`, called like the model: its forward has the
model's signature, and it follows ``gm.train()``/``gm.eval()`` as the model does. Leaf modules
(Dropout, BatchNorm) follow their own mode; code that reads ``self.training`` in traced-through
code (``F.dropout(x, p, self.training)``, ``if self.training:``) is traced in both modes and,
where the graphs differ, each call runs the graph of the root's mode.

Example::

    >>> class Gate(nn.Module):
    ...     def forward(self, x):
    ...         return x if x.sum() > 0 else -x        # data-dependent: cannot be traced
    >>> model = nn.Sequential(nn.Linear(4, 4), Gate(), nn.ReLU())
    >>> gm = trace(model)
    >>> print(gm.code)                                  # before: Sequential(Linear, Gate, ReLU)
    def forward(self, input):
        input_1 = input
        _0 = getattr(self, "0")(input_1);  input_1 = None
        _1 = getattr(self, "1")(_0);  _0 = None
        _2 = getattr(self, "2")(_1);  _1 = None
        return _2
    >>> from amp_fx.core.node_info import node_info
    >>> [node_info(n).opaque_reason for n in gm.graph.nodes if n.target == "1"]
    ['untraceable: ...:3: return x if x.sum() > 0 else -x ...']
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import keyword
import logging
import math
import os
import re
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.capture.autograd_functions import intercepted_applies, recorded_in
from amp_fx.capture.fx_wrap_registry import forget_unreachable_wraps
from amp_fx.capture.model_copy import copy_model
from amp_fx.capture.python_state import report, watching_python_state
from amp_fx.capture.torch_source import culprit_frame, frames_after_current, location
from amp_fx.capture.trace_leaves import (
    OPAQUE_TORCH_MODULES,
    is_primitive_module,
    mark_opaque,
    validate_leaf_modules,
)
from amp_fx.capture.traced_graph_module import TracedGraphModule, rebuild_traced_graph_module
from amp_fx.capture.traced_state import (
    StateUpdates,
    UnrecordedUpdate,
    drop_empty_grad_regions,
    recording_grad_modes,
    recording_random_factories,
)
from amp_fx.core.node_info import (
    FORWARD_SIGNATURE_KEY,
    OTHER_MODE_GRAPH_KEY,
    UNTRACEABLE_MODULES_KEY,
)

logger = logging.getLogger(__name__)

# The tracer's own file: its frames never hold the line that stopped the tracer.
_THIS_FILE = os.path.abspath(__file__)
# Pickles of a TracedGraphModule written before it moved to passes/shared/ name this function here.
_rebuild_traced_graph_module = rebuild_traced_graph_module

__all__ = [
    "OPAQUE_TORCH_MODULES",
    "TraceError",
    "is_primitive_module",
    "trace",
]


class TraceError(TypeError):
    """The top-level forward of a model cannot be traced by torch.fx.

    The message names the file, line and source that stopped the tracer and how to fix it
    (``concrete_args`` to specialise a flag, or a branch that does not depend on a tensor).
    """


def _forward_signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward without one (a C function): keep fx's
        return None


class _PrimitiveLeafTracer(torch.fx.Tracer):
    """A tracer whose leaves are primitive torch.nn modules plus a given set of opaque modules.

    When the forward of a traced-through module fails, the innermost such module and the
    exception are remembered in `failure` so that `trace` can make it opaque and retry.
    """

    # Each node's stack trace names the model's source line (`amp_fx.report`, a capture's notices).
    record_stack_traces = True

    # Defaults let torch.fx re-create the tracer when it unpickles a GraphModule (torch.load).
    def __init__(
        self,
        opaque_types: tuple[type, ...] = (),
        opaque_names: set[str] | None = None,
        stateful: dict[int, str] | None = None,
    ) -> None:
        super().__init__(autowrap_modules=(math,))
        self.opaque_types = opaque_types
        self.opaque_names = set() if opaque_names is None else opaque_names
        # id -> qualified name of the buffers forward updates: read as graph values, not constants.
        self.stateful = {} if stateful is None else stateful
        # (qualified module name, exception, traceback frames inside that module) of the first failure.
        self.failure: tuple[str, BaseException, list[types.FrameType]] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            module_qualified_name in self.opaque_names
            or isinstance(m, self.opaque_types)
            or isinstance(m, OPAQUE_TORCH_MODULES)
            or is_primitive_module(m)
        )

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        # torch.fx reads buffers as constants: ops on them would run once, at trace time. Those
        # forward updates are read from the module on every call instead (`_StateUpdates`).
        name = self.stateful.get(id(attr_val)) if isinstance(attr_val, torch.Tensor) else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        # `if x.is_nested:` guards torch.nn's nested-tensor paths; traced inputs are never nested.
        if isinstance(obj, torch.fx.proxy.Attribute) and obj.attr == "is_nested":
            return False
        return super().to_bool(obj)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            if type(m) is nn.TransformerEncoder and _encoder_is_traceable(*args, **kwargs):
                forward = functools.partial(_transformer_encoder_forward, m)
            return super().call_module(m, forward, args, kwargs)
        except Exception as error:
            if self.failure is None:
                # The innermost module sees the exception first; frames after this one ran inside it.
                self.failure = (self.path_of_module(m), error, frames_after_current(error))
            raise


def _encoder_is_traceable(
    src: Any, mask: Any = None, src_key_padding_mask: Any = None, is_causal: Any = None
) -> bool:
    # Without a mask or with an explicit is_causal, no data-dependent causal-mask detection is needed.
    return mask is None or is_causal is not None


def _transformer_encoder_forward(
    encoder: nn.TransformerEncoder,
    src: Any,
    mask: Any = None,
    src_key_padding_mask: Any = None,
    is_causal: bool | None = None,
) -> Any:
    """``nn.TransformerEncoder.forward``'s non-fast path (the one autograd and autocast take),
    without its shape checks, which torch.fx cannot trace (``len(src.size())``). Each layer
    canonicalises the masks itself, so they are passed on as given."""
    # torch's _detect_is_causal_mask: without a mask, or with a hint, the hint decides.
    is_causal = is_causal is True
    output = src
    for layer in encoder.layers:
        output = layer(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
    if encoder.norm is not None:
        output = encoder.norm(output)
    return output


@contextlib.contextmanager
def _mha_fast_path_disabled() -> Iterator[None]:
    """Trace torch.nn's transformer layers along their non-fast path: the fast-path checks
    (``src.dim() != 3``) cannot be traced, and the fused kernel is an inference-only shortcut
    that autograd and autocast never take either."""
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "get_fastpath_enabled"):
        yield
        return
    previous = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(previous)


def _concrete_args_hint(root: nn.Module, source: str) -> str:
    """Suggest ``concrete_args``: the forward arguments the failing line names, else those
    with defaults (which torch.fx would otherwise trace as inputs)."""
    parameters = {
        name: p
        for name, p in inspect.signature(root.forward).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    identifiers = set(re.findall(r"[A-Za-z_]\w*", source)) - set(keyword.kwlist)
    named = {
        name: "<value>" if p.default is p.empty else repr(p.default)
        for name, p in parameters.items()
        if name in identifiers
    }
    if not named:
        named = {name: repr(p.default) for name, p in parameters.items() if p.default is not p.empty}
    if named:
        example = ", ".join(f"{name!r}: {value}" for name, value in named.items())
        return (
            f"if it branches on a flag or an optional argument, pass concrete_args={{{example}}} "
            "to amp_fx.convert to specialise it"
        )
    return (
        "pass concrete_args={'<argument>': <value>} to amp_fx.convert to specialise the argument it "
        f"depends on (forward takes: {', '.join(parameters) or 'nothing'})"
    )


def trace(
    model: nn.Module,
    *,
    leaf_modules: Sequence[type | str] = (),
    concrete_args: dict[str, Any] | None = None,
) -> torch.fx.GraphModule:
    """Trace a copy of ``model`` into a GraphModule with primitive leaves and opaque nodes.

    Args:
        model: the model; it is deep-copied and never modified.
        leaf_modules: module types (matched with isinstance) or qualified module names to keep
            as opaque ``call_module`` nodes on purpose.
        concrete_args: values to specialise forward arguments on (as ``torch.fx.symbolic_trace``),
            e.g. ``{"flag": True}`` for a forward that branches on ``flag``.

    Raises:
        TypeError: ``model`` is not an nn.Module or ``leaf_modules`` holds something else.
        ValueError: ``leaf_modules`` names a module the model does not have.
        TraceError: the top-level forward cannot be traced (message: file:line, source, fix).

    Example::

        >>> gm = trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> [n.op for n in gm.graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace expects an nn.Module, got {type(model).__name__}; pass the model itself")
    if concrete_args is not None and not isinstance(concrete_args, dict):
        raise TypeError(
            "concrete_args must be a dict of forward argument name -> value, "
            f"got {type(concrete_args).__name__}"
        )
    opaque_types, leaf_names = validate_leaf_modules(model, leaf_modules)

    root = copy_model(model)
    untraceable: dict[str, tuple[str, str]] = {}  # qualified name -> (opaque_reason, the error)
    leaves = _Leaves(model, opaque_types, leaf_names, untraceable, StateUpdates(root, model))
    # Python the graph cannot record (random, time, attributes assigned) is reported, and the
    # attributes the traces assigned are put back: tracing leaves the copy as it found it.
    with watching_python_state(root) as findings:
        tracer, graph = _trace_graph(root, concrete_args, leaves)
        # Code that reads `self.training` (F.dropout(x, p, self.training), `if self.training:`) is
        # baked into a graph: trace the other mode too and keep its graph where the two differ.
        with _training_set_to(root, not root.training):
            known = (len(untraceable), len(leaves.updates.stateful))
            _, other_graph = _trace_graph(root, concrete_args, leaves)
        # The other mode stopped in more modules (opaque in both graphs) or updated more buffers.
        if (len(untraceable), len(leaves.updates.stateful)) != known:
            tracer, graph = _trace_graph(root, concrete_args, leaves)
    report(model, findings, "torch.fx")

    gm = TracedGraphModule(tracer.root, graph, type(model).__name__)
    gm.meta[FORWARD_SIGNATURE_KEY] = _forward_signature(model)
    gm.meta[UNTRACEABLE_MODULES_KEY] = {name: reason for name, (reason, _) in untraceable.items()}
    graphs = [graph]
    if _code_of(other_graph) != _code_of(graph):
        _adopt_targets(gm, tracer.root, other_graph)
        gm.meta[OTHER_MODE_GRAPH_KEY] = (not root.training, other_graph)
        graphs.append(other_graph)
        logger.info(
            "%s reads self.training in traced code: one graph per training mode", type(model).__name__
        )
    _keep_unused_state(gm, tracer.root)
    for each in graphs:
        mark_opaque(gm, each, opaque_types, leaf_names, untraceable)
    gm.recompile()
    return gm


@dataclasses.dataclass
class _Leaves:
    """What `_trace_graph` keeps as leaves: the user's ``leaf_modules`` and the submodules found
    untraceable so far (``untraceable``, which `_trace_graph` adds to). ``model`` names errors;
    ``updates`` holds the buffers forward updates, read as graph values (found as it goes too)."""

    model: nn.Module
    opaque_types: tuple[type, ...]
    leaf_names: set[str]
    untraceable: dict[str, tuple[str, str]]
    updates: StateUpdates


def _trace_graph(
    root: nn.Module, concrete_args: dict[str, Any] | None, leaves: _Leaves
) -> tuple[_PrimitiveLeafTracer, torch.fx.Graph]:
    """Trace ``root`` in its current mode; each submodule that stops the tracer is added to
    ``leaves.untraceable`` and the trace retried. Raises `TraceError` for the top level's own."""
    model = leaves.model
    forget_unreachable_wraps()  # a trace patches every registered function: only those that can run
    updates = leaves.updates
    while True:
        opaque = leaves.leaf_names | set(leaves.untraceable)
        tracer = _PrimitiveLeafTracer(leaves.opaque_types, opaque, updates.stateful)
        try:
            with (
                _mha_fast_path_disabled(),
                intercepted_applies(recorded_in(tracer)),
                updates.recording(tracer),
                recording_grad_modes(tracer),
                recording_random_factories(tracer),
            ):
                graph = tracer.trace(root, concrete_args)
        except Exception as error:
            _check_updates(model, updates)
            failure = tracer.failure
            # A failure outside every traced-through submodule, or in a module that is already a
            # leaf (making it opaque would not help), is the top-level forward's own.
            if failure is None or failure[0] in ("", *tracer.opaque_names):
                frames = frames_after_current(error) if failure is None else failure[2]
                where, source = location(culprit_frame(frames, _THIS_FILE))
                raise TraceError(
                    f"amp_fx cannot trace {type(model).__name__}.forward: at {where} `{source}`: "
                    f"{type(error).__name__}: {error}. The top-level forward must be traceable by "
                    f"torch.fx; {_concrete_args_hint(model, source)}, or make the branch not depend "
                    "on a tensor."
                ) from error
            name, error, frames = failure
            where, source = location(culprit_frame(frames, _THIS_FILE))
            leaves.untraceable[name] = (f"untraceable: {where}: {source}", f"{type(error).__name__}: {error}")
            logger.info(
                "submodule %r (%s) cannot be traced (%s at %s: %s); keeping it as an opaque node",
                name,
                type(root.get_submodule(name)).__name__,
                type(error).__name__,
                where,
                source,
            )
            continue
        # The trace updated buffers it read as constants: again, with them read as graph values.
        if not _check_updates(model, updates):
            drop_empty_grad_regions(graph)
            return tracer, graph


def _check_updates(model: nn.Module, updates: StateUpdates) -> bool:
    try:
        return updates.check()
    except UnrecordedUpdate as error:
        raise TraceError(f"amp_fx cannot trace {type(model).__name__}.forward: {error}") from error


@contextlib.contextmanager
def _training_set_to(root: nn.Module, training: bool) -> Iterator[None]:
    """Every module of ``root`` in mode ``training`` for the block, then each back in its own."""
    modes = [(module, module.training) for module in root.modules()]
    root.train(training)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _code_of(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src


def _adopt_targets(gm: torch.fx.GraphModule, root: nn.Module, graph: torch.fx.Graph) -> None:
    """Give ``gm`` each module and tensor ``graph`` calls or reads that ``gm``'s own graph does not
    (the same objects, so the two graphs share parameters, buffers and modules)."""
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            _adopt(gm, root, node.target)


def _adopt(gm: torch.fx.GraphModule, root: nn.Module, target: str) -> None:
    path, _, attribute = target.rpartition(".")
    owner, root_owner = gm, root
    for part in path.split(".") if path else []:
        root_owner = getattr(root_owner, part)
        if part not in owner._modules:
            owner.add_module(part, root_owner)  # everything under it comes with it
            return
        owner = owner._modules[part]
    if hasattr(owner, attribute):
        return
    value = getattr(root_owner, attribute)
    if isinstance(value, nn.Module):
        owner.add_module(attribute, value)
    elif isinstance(value, nn.Parameter):
        owner.register_parameter(attribute, value)
    elif isinstance(value, torch.Tensor):
        persistent = attribute not in root_owner._non_persistent_buffers_set
        owner.register_buffer(attribute, value, persistent=persistent)
    else:
        setattr(owner, attribute, value)


def _keep_unused_state(gm: torch.fx.GraphModule, root: nn.Module) -> None:
    """Give ``gm`` each parameter and buffer of ``root``'s state_dict that its graph never reads,
    under the same name (the same tensor, so tied weights stay tied).

    torch.fx copies only what the graph uses. Without this, a submodule the forward skips, or a
    buffer it never reads, would be missing from ``gm.state_dict()``: that state dict would not load
    into the original model (strict), nor would the original's checkpoints load into ``gm``.
    """
    for name in root.state_dict(keep_vars=True):
        path, _, attribute = name.rpartition(".")
        owner, root_owner = gm, root
        for part in path.split(".") if path else []:
            root_owner = root_owner._modules.get(part)
            if root_owner is None:  # a key a state_dict hook made up: no module holds it
                break
            if part not in owner._modules:
                owner.add_module(part, root_owner)  # all of its state comes with it
                break
            owner = owner._modules[part]
        else:
            if attribute in owner._parameters or attribute in owner._buffers:
                continue
            if attribute in root_owner._parameters:
                owner.register_parameter(attribute, root_owner._parameters[attribute])
            elif attribute in root_owner._buffers:
                owner.register_buffer(attribute, root_owner._buffers[attribute])
            # Anything else (a module's `_extra_state`) is the module's, kept where the graph calls
            # the module as a leaf (a module traced through becomes a container of its tensors).
