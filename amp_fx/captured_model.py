"""A converted model that captures its forward call by call: the torch.export front end of `convert`.

`amp_fx.convert` returns one of these when torch.fx cannot trace the model's forward whole
(Hugging Face transformers, nanoGPT's size assert, detection models, ...). It is a copy of the
model, of the model's own class, so it is a drop-in: the same call signature (``input_ids=``,
``labels=``, ``pixel_values=``), the same output type (a ``ModelOutput`` with ``.loss``), the same
``state_dict`` keys, ``.config`` and ``save_pretrained``. At O2/O3 its parameters are stored in
the low dtype when it is made (BatchNorm's and FP32-ruled modules' stay float32), so optimizers
built from it see the tensors they will train.

Each call is run by a graph rewritten by the convert passes (`amp_fx.pipeline`):

- the first call of a given argument structure (which keywords, constants such as
  ``use_cache=False``, tensor dtypes and ranks, train/eval mode) is captured with
  `amp_fx.passes.export` at the call's sizes (about 1-3 s on CPU for a small transformer);
- a call whose sizes the graph does not take (a smaller last batch, another sequence length) is
  captured once more with dynamic sizes; that graph then takes every size its code allows;
- a module torch.export cannot capture (data-dependent control flow, C extensions) runs its own
  forward inside an autocast island of the opt level (O1/O2: ``torch.autocast``; O2: floating
  outputs float32), and each of its child modules is captured on its own, so only the code
  between them runs in the island. `amp_fx.capture_summary` names the cause of each island and,
  given a call's arguments, the share of its ATen ops and FLOPs that ran inside rewritten graphs.

Moving the model (``.to``, ``.cuda``) drops its graphs; they are captured again at the next call.

Example::

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = nn.Linear(4, 4)
    ...     def forward(self, x, *, scale=None):
    ...         assert x.shape[-1] == 4
    ...         return self.fc(x) * (1 if scale is None else scale)
    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(Net(), preset("O2", torch.bfloat16, "cpu"))
    >>> model(torch.randn(2, 4), scale=2.0).dtype
    torch.float32
    >>> len(capture_states(model)[0][1].graphs)
    1
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from amp_fx.core.containers import Spec, flatten
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.module_ops import module_op
from amp_fx.core.node_info import PARAMETERS_STORED_KEY
from amp_fx.core.policy import Policy, Rule
from amp_fx.ops.casts import cast_if_floating
from amp_fx.passes.checkpoint_regions import checkpoint_regions
from amp_fx.passes.export import (
    ExportError,
    accepts,
    call_graph,
    call_signature,
    container_call,
    export_graph,
    graph_inputs,
)
from amp_fx.passes.shared.model_copy import copy_model
from amp_fx.pipeline import rewrite_graph
from amp_fx.saving import master_state_dict

logger = logging.getLogger(__name__)

__all__ = ["CapturedModel", "CaptureState", "capture_states", "captured_model", "running_original_in_fp32"]

_STATE = "_amp_fx_capture"


@dataclasses.dataclass
class CaptureState:
    """What the torch.export front end keeps on each captured module (read by `amp_fx.capture_summary`)."""

    policy: Policy
    graphs: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    # Argument structure (see `_structure`) -> why calls of that structure run in an island.
    islands: dict[tuple[Any, ...], str] = dataclasses.field(default_factory=dict)
    # Whether the module's forward ran eagerly yet (an island descends past children never called).
    called: bool = False

    def __deepcopy__(self, memo: dict[int, Any]) -> CaptureState:
        # Graphs hold the model's tensors; a copy of the model captures its own.
        return CaptureState(self.policy, islands=dict(self.islands), called=self.called)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled without graphs, as deep-copied: they are captured again at the next call.
        return {"policy": self.policy, "islands": dict(self.islands), "called": self.called}

    def __setstate__(self, values: dict[str, Any]) -> None:
        self.__init__(**values)  # type: ignore[misc]


class _Journal:
    """What one eager call changed in the capture state, undone if the call fails.

    Capture is transactional: a call that raises (a typo'd keyword, float token ids) and a call
    on fake tensors (someone else's torch.export of the model) leave every module's graphs,
    islands and class as they were. Nested calls hand their changes to the enclosing call's
    journal; the outermost one logs the islands made, as one notice.
    """

    def __init__(self) -> None:
        self.undo: list[Callable[[], None]] = []
        self.islands: list[tuple[nn.Module, str]] = []

    def rollback(self) -> None:
        for action in reversed(self.undo):
            action()

    def merge_into(self, outer: _Journal) -> None:
        outer.undo += self.undo
        outer.islands += self.islands


# Open journals of the eager calls in progress, innermost last; and whether one of our own
# torch.export captures is running (then captured descendants run their own code, so the graph
# being captured records it and no graph is captured on the capture's fake tensors).
_JOURNALS: list[_Journal] = []
_EXPORTING: list[bool] = []
# `running_original_in_fp32` blocks open, and whether such a call is already running its code.
_FP32_BLOCKS: list[bool] = []
_IN_FP32_CALL: list[bool] = []


@contextlib.contextmanager
def running_original_in_fp32() -> Iterator[None]:
    """Inside the block, converted models of this front end run the original model's code in
    FP32 (low-precision weights upcast, no casts, no autocast): Apex's ``amp.disable_casts``.

    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(nn.Linear(4, 2), preset("O2", torch.bfloat16, "cpu"))
    >>> with running_original_in_fp32():
    ...     model(torch.randn(3, 4)).dtype
    torch.float32
    """
    _FP32_BLOCKS.append(True)
    try:
        yield
    finally:
        _FP32_BLOCKS.pop()


def _run_original_in_fp32(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    upcast = {
        name: tensor.float()
        for name, tensor in [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
        if tensor.dtype in LOW_PRECISION_DTYPES
    }
    _IN_FP32_CALL.append(True)
    try:
        with torch.autocast(_state(module).policy.device_type, enabled=False):
            return torch.func.functional_call(module, upcast, args, kwargs)
    finally:
        _IN_FP32_CALL.pop()


def _record(undo: Callable[[], None]) -> None:
    if _JOURNALS:
        _JOURNALS[-1].undo.append(undo)


class CapturedModel(nn.Module):
    """Base placed before the model's class in a converted model's class (see the module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if _EXPORTING or _IN_FP32_CALL:
            return _original_forward(self)(*args, **kwargs)
        if _FP32_BLOCKS:
            return _run_original_in_fp32(self, args, kwargs)
        if torch.compiler.is_compiling():
            graph = _traced_choice(state, self.training, args, kwargs)
            if graph is None:
                graph = _compiled_graph_for(self, args, kwargs)
            return _run(self, state, graph, args, kwargs)
        journal = _Journal()
        _JOURNALS.append(journal)
        try:
            state.called = True
            graph, leaves = _select_or_capture(self, args, kwargs)
            output = _run(self, state, graph, args, kwargs, leaves)
            if graph is None:
                _descend_past_uncalled(self, state.policy)
        except BaseException:
            _JOURNALS.pop()
            journal.rollback()
            raise
        _JOURNALS.pop()
        if journal.undo and _on_fake_tensors(args, kwargs):
            journal.rollback()  # graphs captured on fake tensors would compute fake values later
        elif _JOURNALS:
            journal.merge_into(_JOURNALS[-1])
        elif journal.islands:
            _log_islands(self, journal.islands)
        return output

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Buffers are replaced by new tensors (``.to``, ``.cuda``): graphs would read the old ones.
        result = super()._apply(fn, *args, **kwargs)
        _drop_graphs(self)
        return result

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The class is made at run time (`_captured_class`), so pickle could not find it by name:
        # the model pickles as its original class and becomes a converted one again when loaded.
        cls = type(self)
        self.__class__ = _original_class(cls)
        try:
            rebuild, arguments, *rest = self.__reduce_ex__(protocol)
        finally:
            self.__class__ = cls
        return (_rebuild_captured, (rebuild, arguments), *rest)


def _run(
    module: nn.Module,
    state: CaptureState,
    graph: torch.fx.GraphModule | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: list[Any] | None = None,
) -> Any:
    if graph is None:
        return _run_island(module, state.policy, args, kwargs)
    # The graph's casts are explicit: an autocast region around it would cast again.
    with torch.autocast(state.policy.device_type, enabled=False):
        return call_graph(graph, args, kwargs, leaves)


def _state(module: nn.Module) -> CaptureState:
    state = module.__dict__.get(_STATE)
    if state is None:
        raise RuntimeError(
            f"this {type(module).__name__} was built from amp_fx's converted class, not by "
            "amp_fx.convert, so it has no policy: build or load the model with its original class "
            f"({_original_class(type(module)).__name__}), then amp_fx.convert it"
        )
    return state


def _on_fake_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return torch._guards.detect_fake_mode(pytree.tree_leaves((args, kwargs))) is not None


_CLASSES: dict[type, type] = {}


def _original_class(cls: type) -> type:
    return cls.__bases__[1]


def _rebuild_captured(rebuild: Callable[..., Any], arguments: tuple[Any, ...]) -> nn.Module:
    module = rebuild(*arguments)
    module.__class__ = _captured_class(type(module))
    return module


def _refuse_from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
    original = _original_class(cls)
    raise TypeError(
        f"{cls.__name__}.from_pretrained was called on amp_fx's converted class, which has no opt "
        f"level to load at: load with the original class and convert the result, "
        f"amp_fx.convert({original.__name__}.from_pretrained(...), 'O2')"
    )


def _save_pretrained_with_masters(self: nn.Module, *args: Any, state_dict: Any = None, **kwargs: Any) -> Any:
    # The FP32 masters an amp_fx optimizer holds, not their rounded copies, under the config's
    # float32: the original class's from_pretrained then gives back exactly the masters.
    if state_dict is None:
        state_dict = master_state_dict(self)
    return super(CapturedModel, self).save_pretrained(*args, state_dict=state_dict, **kwargs)


def _set_gradient_checkpointing_and_recapture(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # Hugging Face's gradient_checkpointing_enable/disable (every version) set the layers' flags
    # here; graphs captured before would keep the old setting.
    # The code takes another path (Hugging Face turns the cache off), so islands are tried again.
    result = super(CapturedModel, self)._set_gradient_checkpointing(*args, **kwargs)
    _drop_graphs(self, islands=True)
    return result


def _drop_graphs(model: nn.Module, islands: bool = False) -> None:
    for module in model.modules():
        state = module.__dict__.get(_STATE)
        if state is not None:
            state.graphs.clear()
            if islands:
                state.islands.clear()


def _captured_class(cls: type) -> type:
    if issubclass(cls, CapturedModel):
        return cls
    if cls not in _CLASSES:
        original_forward = cls.forward

        @functools.wraps(original_forward)
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return CapturedModel.forward(self, *args, **kwargs)

        # The original's signature (functools.wraps): Hugging Face's Trainer reads it to choose
        # dataset columns.
        namespace: dict[str, Any] = {"__module__": cls.__module__, "forward": forward}
        if hasattr(cls, "from_pretrained"):
            namespace["from_pretrained"] = classmethod(_refuse_from_pretrained)
        if hasattr(cls, "save_pretrained"):
            namespace["save_pretrained"] = _save_pretrained_with_masters
        if hasattr(cls, "_set_gradient_checkpointing"):
            namespace["_set_gradient_checkpointing"] = _set_gradient_checkpointing_and_recapture
        _CLASSES[cls] = type(cls.__name__, (CapturedModel, cls), namespace)
    return _CLASSES[cls]


def _make_captured(module: nn.Module, policy: Policy) -> None:
    original = type(module)
    module.__class__ = _captured_class(original)
    module.__dict__[_STATE] = CaptureState(policy)

    def undo() -> None:
        module.__class__ = original
        del module.__dict__[_STATE]

    _record(undo)


def _original_forward(module: nn.Module) -> Any:
    return super(CapturedModel, module).forward


def _store_parameters(model: nn.Module, policy: Policy) -> None:
    """O2/O3: store each module's parameters (and its floating buffers) in the dtype the policy
    decides for the op the module is, as `cast_parameters` does for traced modules; a tensor
    shared by several modules is float32 if any of them wants float32."""
    wanted: dict[int, torch.dtype] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        own = [*module.parameters(recurse=False)]
        if not own:
            continue
        decision = policy.decide(module_op(module), name, type(module))
        if decision.rule is Rule.OPAQUE or decision.param_dtype is None:
            continue
        for tensor in [*own, *module.buffers(recurse=False)]:
            if tensor.is_floating_point() and tensor.dtype != torch.float64:
                key = id(tensor)
                tensors[key] = tensor
                current = wanted.get(key)
                wanted[key] = (
                    torch.float32
                    if torch.float32 in (current, decision.param_dtype)
                    else decision.param_dtype
                )
    for key, dtype in wanted.items():
        tensors[key].data = tensors[key].data.to(dtype)


def captured_model(model: nn.Module, policy: Policy) -> nn.Module:
    """A converted copy of ``model`` whose calls are captured by torch.export (module docstring).

    The model passed in is never modified.
    """
    converted = copy_model(model)
    if policy.cast_parameters:
        _store_parameters(converted, policy)
    _make_captured(converted, policy)
    return converted


def _fits(
    graph: torch.fx.GraphModule,
    training: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    traced: bool = False,
) -> bool:
    """Whether ``graph`` computes this call: its `CallSignature` decides (plain Python, microseconds,
    and traceable by torch.compile); `accepts`, which reads the graph and checks sizes with sympy,
    only where there is none (container arguments), and never in ``traced`` code."""
    if graph.meta["amp_fx_training"] != training or container_call(graph) is not None:
        return False
    signature = call_signature(graph)
    if signature is not None:
        return signature.matches(args, kwargs)
    return not traced and accepts(graph, args, kwargs)


def _traced_choice(
    state: CaptureState, training: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.fx.GraphModule | None:
    # Under torch.compile, the graph for this call chosen in code Dynamo traces and guards on: a
    # graph break here would make the model's whole output, float32 logits included, tensors the
    # compiled code must materialise. None: the call needs `accepts` or a capture, which run
    # eagerly (`_compiled_graph_for`): a graph break, which Dynamo's code for that call keeps (so
    # the model is called once before it is compiled; docs/DESIGN.md).
    for graph in state.graphs:
        if _fits(graph, training, args, kwargs, traced=True):
            return graph
    if any(container_call(graph) for graph in state.graphs):
        flat = flatten((args, kwargs))
        for graph in state.graphs:
            if _fits_containers(graph, training, flat, traced=True):
                return graph
    return None


@torch.compiler.disable
def _compiled_graph_for(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Choosing (and capturing) a graph runs eagerly; torch.compile then traces the graph chosen.
    return _select_or_capture(module, args, kwargs)[0]


def _structure(module: nn.Module, flat: tuple[list[torch.Tensor], Spec]) -> tuple[Any, ...]:
    """What a graph is captured for, sizes aside: the mode, the nesting with every non-tensor
    value and type (`amp_fx.core.containers`), and each tensor's dtype, rank and device type."""
    leaves, spec = flat
    described = tuple(
        (leaf.dtype, leaf.dim(), leaf.device.type) if isinstance(leaf, torch.Tensor) else int
        for leaf in leaves
    )
    return (module.training, spec, described)


def _fits_containers(
    graph: torch.fx.GraphModule,
    training: bool,
    flat: tuple[list[torch.Tensor], Spec],
    *,
    traced: bool = False,
) -> bool:
    """`_fits` for a graph captured with containers: the same nesting, and its tensors fit."""
    call = container_call(graph)
    if call is None or graph.meta["amp_fx_training"] != training or call.arguments != flat[1]:
        return False
    leaves, signature = tuple(flat[0]), call_signature(graph)
    if signature is not None:
        return signature.matches(leaves, {})
    return not traced and accepts(graph, leaves, {})


def _select_or_capture(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.fx.GraphModule | None, list[Any] | None]:
    """The graph for this call (None: an island), and the call's leaves where the choice flattened
    it, so that a graph taking containers' leaves is not given a second flatten."""
    state = _state(module)
    mode = module.training
    for graph in state.graphs:
        if _fits(graph, mode, args, kwargs):
            return graph, None
    flat = flatten((args, kwargs))
    for graph in state.graphs:
        if _fits_containers(graph, mode, flat):
            return graph, flat[0]
    key = _structure(module, flat)
    if key in state.islands:
        return None, None
    dynamic = any(graph.meta["amp_fx_training"] == mode for graph in state.graphs)
    # A module whose calls needed containers once (a cache it returns) needs them again.
    containers = flat[1].objects > 0 or any(container_call(graph) for graph in state.graphs)
    return _capture(module, state, args, kwargs, key, dynamic, containers), flat[0]


def _capture(
    module: nn.Module,
    state: CaptureState,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    key: tuple[Any, ...],
    dynamic: bool,
    containers: bool,
) -> torch.fx.GraphModule | None:
    policy = state.policy
    start = time.perf_counter()
    # Capture inside the autocast region the converted model runs like, so code that reads a dtype
    # sees the converted dtypes; the graph records the ops before autocast.
    region = (policy.device_type, policy.dtype) if policy.level.lowers_precision else None
    # The module's own class runs during the capture (CapturedModel.forward would recurse).
    cls = type(module)
    if cls.__bases__[0] is not CapturedModel:
        raise TypeError(
            f"{cls.__name__} is a converted model whose class another library replaced (FSDP2's "
            "fully_shard does); the torch.export front end cannot capture it: shard the model's "
            "submodules, or convert a model torch.fx can trace (front_end='fx')"
        )
    module.__class__ = _original_class(cls)
    _EXPORTING.append(True)
    checkpoints = _checkpointed_layers(module)
    try:
        with _checkpointing_off(module):
            graph = _export_with_containers(module, args, kwargs, region, dynamic, containers)
    except ExportError as error:
        failure = error
    else:
        failure = None
    finally:
        _EXPORTING.pop()
        module.__class__ = cls
    if failure is not None:
        _become_island(module, state, key, failure)
        return None
    graph.meta[PARAMETERS_STORED_KEY] = True
    graph.meta["amp_fx_training"] = module.training
    rewrite_graph(graph, policy, tuple(graph_inputs(graph, args, kwargs)))
    graph = checkpoint_regions(graph, checkpoints)
    state.graphs.append(graph)
    state.seconds.append(time.perf_counter() - start)

    def undo() -> None:
        state.graphs.remove(graph)
        state.seconds.pop()

    _record(undo)
    sizes = "dynamic" if dynamic else "static"
    logger.info("captured %s (%s sizes) in %.2f s", type(module).__name__, sizes, state.seconds[-1])
    return graph


def _export_with_containers(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    region: tuple[str, torch.dtype] | None,
    dynamic: bool,
    containers: bool,
) -> torch.fx.GraphModule:
    # Arguments holding a cache go through `amp_fx.core.containers` at once; a cache made inside
    # the call shows only in its output, so a refused output is captured once more that way.
    try:
        return export_graph(module, args, kwargs, autocast=region, dynamic=dynamic, containers=containers)
    except ExportError as error:
        if containers or error.kind != "container":
            raise
    return export_graph(module, args, kwargs, autocast=region, dynamic=dynamic, containers=True)


def _checkpointed_layers(module: nn.Module) -> dict[str, Callable[..., Any]]:
    """Qualified name -> checkpoint function of the layers that checkpoint themselves in training
    (Hugging Face's ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``): the
    innermost flagged modules, as a flagged model (GPT2Model) leaves the checkpointing to its layers."""
    if not module.training:
        return {}
    flagged = {
        name: sub._gradient_checkpointing_func
        for name, sub in module.named_modules()
        if getattr(sub, "gradient_checkpointing", False) is True
        and callable(getattr(sub, "_gradient_checkpointing_func", None))
    }
    # The module itself is left out: its class's own wrapper checkpoints the call that runs this
    # graph (transformers wraps the forward of every subclass of a checkpointing layer, ours too).
    return {
        name: function
        for name, function in flagged.items()
        if name and not any(other.startswith(f"{name}.") for other in flagged)
    }


def _run_plainly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


@contextlib.contextmanager
def _checkpointing_off(module: nn.Module) -> Iterator[None]:
    # torch.export records the layers' ops, not the checkpoint machinery (`checkpoint_regions`
    # puts it back on the rewritten graph); the flags stay on, so the code checkpointing changes
    # (Hugging Face turns the cache off) is what is captured.
    flagged = [sub for sub in module.modules() if callable(sub.__dict__.get("_gradient_checkpointing_func"))]
    functions = [sub.__dict__["_gradient_checkpointing_func"] for sub in flagged]
    for sub in flagged:
        sub._gradient_checkpointing_func = _run_plainly
    try:
        yield
    finally:
        for sub, function in zip(flagged, functions, strict=True):
            sub._gradient_checkpointing_func = function


def _become_island(
    module: nn.Module, state: CaptureState, key: tuple[Any, ...], failure: ExportError
) -> None:
    state.islands[key] = f"{failure}; fix: {failure.advice}"
    _record(lambda: state.islands.pop(key))
    if _JOURNALS:
        _JOURNALS[-1].islands.append((module, state.islands[key]))
    _capture_children(module, state.policy)


def _capture_children(module: nn.Module, policy: Policy) -> None:
    """The children an island's code calls are captured on their own (those holding parameters)."""
    for child in _called_children(module):
        if _STATE not in child.__dict__ and any(True for _ in child.parameters()):
            _make_captured(child, policy)


def _descend_past_uncalled(module: nn.Module, policy: Policy) -> None:
    # After an island's run: a captured child its code never called (it called the child's own
    # children, or ``child.inner.forward``) hands the capture down a level, at any depth.
    for child in _called_children(module):
        state = child.__dict__.get(_STATE)
        if state is not None and not state.called:
            _capture_children(child, policy)
            _descend_past_uncalled(child, policy)


def _called_children(module: nn.Module) -> list[nn.Module]:
    # ModuleList/ModuleDict are never called: the island's code calls their items.
    children = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            children += _called_children(child)
        else:
            children.append(child)
    return children


def _log_islands(model: nn.Module, islands: list[tuple[nn.Module, str]]) -> None:
    """One notice for the islands one call made, modules with the same cause listed together."""
    names = {id(module): name or "<model>" for name, module in model.named_modules()}
    by_reason: dict[str, list[str]] = {}
    for module, reason in islands:
        name = names.get(id(module), type(module).__name__)
        cause = reason.replace(type(module).__name__, "<module>")
        by_reason.setdefault(cause, []).append(f"{name} ({type(module).__name__})")
    lines = [f"  {', '.join(modules)}: {cause}" for cause, modules in by_reason.items()]
    logger.warning(
        "%s: %d module(s) run in autocast islands for calls like this one; their own code runs under "
        "torch.autocast and the modules they call are captured on their own "
        "(amp_fx.capture_summary(model) tells more):\n%s",
        type(model).__name__,
        len(islands),
        "\n".join(lines),
    )


def _run_island(module: nn.Module, policy: Policy, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    forward = _original_forward(module)
    if not policy.autocast_opaque:
        return forward(*args, **kwargs)
    with torch.autocast(policy.device_type, dtype=policy.dtype):
        output = forward(*args, **kwargs)
    target = policy.cast_model_outputs
    if target is None:
        return output
    # As the fx front end casts outputs of unknown dtype: floating ones, float64 left as it is.
    return pytree.tree_map_only(torch.Tensor, lambda t: cast_if_floating(t, target), output)


def capture_states(model: nn.Module) -> list[tuple[str, CaptureState]]:
    """(qualified name, its `CaptureState`) for ``model`` and each descendant the torch.export front
    end captures, in ``named_modules`` order; empty for a model of the torch.fx front end."""
    return [
        (name, module.__dict__[_STATE]) for name, module in model.named_modules() if _STATE in module.__dict__
    ]
