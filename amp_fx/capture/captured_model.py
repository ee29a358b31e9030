"""A converted model that captures its forward call by call: the torch.export front end of `convert`.

`amp_fx.convert` returns one of these when torch.fx cannot trace the model's forward whole
(Hugging Face transformers, nanoGPT's size assert, detection models, ...). It is a copy of the
model, of the model's own class, so it is a drop-in: the same call signature, output type,
``state_dict`` keys, ``.config`` and ``save_pretrained``. At O2/O3 its parameters are stored low
when it is made (`amp_fx.capture.storage`), so optimizers built from it see the tensors they train.

Each call runs a graph rewritten by the convert passes (`amp_fx.pipeline`): the first call of an
argument structure (keywords, constants, tensor dtypes and ranks, train/eval mode) is captured with
`amp_fx.capture.export` at its sizes, a call whose sizes no graph takes once more with dynamic
sizes. A module torch.export cannot capture runs its own forward in an autocast island of the opt
level (O2: floating outputs float32), each of its children captured on its own
(`amp_fx.capture_summary` names the causes). Moving the model (``.to``) or any other change to it
(`amp_fx.capture.changes`) drops its graphs; the next call captures again. docs/DESIGN.md
("Capture front ends") tells the whole of it.

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

import functools
import gc
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from amp_fx.capture.change_counting import install, watch_modules
from amp_fx.capture.changes import same_model, take, unchanged
from amp_fx.capture.checkpointing import checkpointed_layers, checkpointing_off
from amp_fx.capture.export import (
    ExportError,
    call_graph,
    container_call,
    export_graph,
    graph_inputs,
    kept_dtypes,
)
from amp_fx.capture.graph_choice import fits, fits_containers, structure, traced_choice
from amp_fx.capture.islands import called_children, log_islands
from amp_fx.capture.model_copy import copy_model
from amp_fx.capture.original_in_fp32 import FP32_BLOCKS, IN_FP32_CALL, run_original_in_fp32
from amp_fx.capture.sharding import is_sharded, sharded_capture, sharded_modules
from amp_fx.capture.state import (
    EXPORTING,
    JOURNALS,
    STATE_ATTR,
    CaptureState,
    Journal,
    attached_state,
    capture_states,
    record,
)
from amp_fx.capture.storage import store_added, store_parameters, storing_unstored
from amp_fx.core.containers import flatten
from amp_fx.core.node_info import TRAINING_MODE_KEY
from amp_fx.core.policy import Policy
from amp_fx.ops.casts import cast_if_floating
from amp_fx.passes.checkpoint_regions import checkpoint_regions
from amp_fx.passes.shard_regions import shard_regions
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.pipeline import rewrite_graph
from amp_fx.training.saving import master_state_dict

logger = logging.getLogger(__name__)

__all__ = ["CapturedModel", "CaptureState", "capture_states", "captured_model"]


class CapturedModel(nn.Module):
    """Base placed before the model's class in a converted model's class (see the module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if EXPORTING or IN_FP32_CALL:
            return _original_forward(self)(*args, **kwargs)
        if FP32_BLOCKS:
            return run_original_in_fp32(self, state.policy.device_type, args, kwargs)
        if torch.compiler.is_compiling():
            # The change check is traced too: Dynamo guards on what it reads, so a change made
            # later recompiles, and this call then follows it eagerly (`_compiled_graph_for`).
            graph = None
            if state.watch is not None and unchanged(state.watch):
                graph = traced_choice(state, self.training, args, kwargs)
            if graph is None:
                graph = _compiled_graph_for(self, args, kwargs)
            return _run(self, state, graph, args, kwargs)
        _follow_changes(self, state)
        journal = Journal()
        JOURNALS.append(journal)
        try:
            graph, leaves = _select_or_capture(self, args, kwargs)
            output = _run(self, state, graph, args, kwargs, leaves)
        except BaseException:
            JOURNALS.pop()
            journal.rollback()
            raise
        JOURNALS.pop()
        _after_python_ran(self, state, graph is None or bool(journal.undo))
        if journal.undo and _on_fake_tensors(args, kwargs):
            journal.rollback()  # graphs captured on fake tensors would compute fake values later
        elif JOURNALS:
            journal.merge_into(JOURNALS[-1])
        elif journal.islands:
            log_islands(self, journal.islands)
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
    state = attached_state(module)
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


def _captured_base(cls: type) -> type:
    """The converted class of a module, under the class FSDP2's fully_shard puts around it."""
    if cls.__bases__[0] is CapturedModel:
        return cls
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    if fsdp and issubclass(cls, fsdp.FSDPModule) and cls.__bases__[1].__bases__[0] is CapturedModel:
        return cls.__bases__[1]
    raise TypeError(
        f"{cls.__name__} is a converted model whose class another library replaced; the torch.export "
        "front end cannot capture it: convert a model torch.fx can trace (front_end='fx')"
    )


def _rebuild_captured(rebuild: Callable[..., Any], arguments: tuple[Any, ...]) -> nn.Module:
    module = rebuild(*arguments)
    module.__class__ = _captured_class(type(module))
    install()  # its modules' __dict__, set after this, says they are watched
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
        state = attached_state(module)
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


def _make_captured(module: nn.Module, policy: Policy, unstored: list[torch.Tensor]) -> None:
    original = type(module)
    module.__class__ = _captured_class(original)
    module.__dict__[STATE_ATTR] = CaptureState(policy, unstored=unstored)

    def undo() -> None:
        module.__class__ = original
        del module.__dict__[STATE_ATTR]

    record(undo)


def _original_forward(module: nn.Module) -> Any:
    return super(CapturedModel, module).forward


def captured_model(model: nn.Module, policy: Policy, *, in_place: bool = False) -> nn.Module:
    """A converted copy of ``model`` whose calls are captured by torch.export (module docstring).

    The model passed in is not modified, unless ``in_place``: then it is the converted model (its
    class and the storage of its parameters change; the Parameter objects stay).
    """
    converted = model if in_place else copy_model(model)
    unstored = store_parameters(converted, policy) if policy.stores_weights_low else []
    _make_captured(converted, policy, unstored)
    _make_descendants_captured(converted, policy, unstored)
    # From here on, a change to it counts (a hook registered before the first call and removed
    # after it too).
    watch_modules(converted)
    return converted


def _make_descendants_captured(module: nn.Module, policy: Policy, unstored: list[torch.Tensor]) -> None:
    # Each part holding parameters is converted too, so a call of it on its own (TRL's fused head
    # calls ``model.model(...)``; a user calls a layer) runs a rewritten graph of its own instead of
    # the original code on converted weights. Inside its parent's capture it runs its own code
    # (`EXPORTING`), so the parent's graph holds its ops.
    for child in called_children(module):
        if attached_state(child) is None and any(True for _ in child.parameters()):
            _make_captured(child, policy, unstored)
        _make_descendants_captured(child, policy, unstored)


@torch.compiler.disable
def _compiled_graph_for(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Choosing (and capturing) a graph runs eagerly; torch.compile then traces the graph chosen.
    state = _state(module)
    _follow_changes(module, state)
    graph = _select_or_capture(module, args, kwargs)[0]
    _after_python_ran(module, state, True)
    return graph


def _follow_changes(module: nn.Module, state: CaptureState) -> None:
    """Drop the graphs of a model changed since they were captured (`amp_fx.capture.changes`):
    the next capture records the change. Parameters it added are stored as `convert` stores
    them, and parts it added that hold parameters are converted, so a part called on its own
    (a LoRA layer PEFT put in) runs a graph too."""
    watch = state.watch
    if watch is not None and unchanged(watch):
        return
    now = take(module)
    if watch is None or same_model(watch, now):
        state.watch = now
        return
    logger.info(
        "%s changed since its graphs were captured (%s): capturing it again at this call",
        type(module).__name__,
        ", ".join(now.differences(watch)[:8]),
    )
    state.graphs.clear()
    state.seconds.clear()
    state.islands.clear()
    if state.policy.stores_weights_low:
        store_added(module, state, watch.tensor_ids())
    _make_descendants_captured(module, state.policy, state.unstored)
    state.watch = take(module)


def _after_python_ran(module: nn.Module, state: CaptureState, ran: bool) -> None:
    # A capture or an island runs the model's own code, which may set attributes (the capture
    # itself swaps classes and forwards): what the call's code changed is the state the graphs
    # were captured in, not a change to follow at the next call.
    if ran and (state.watch is None or not unchanged(state.watch)):
        state.watch = take(module)


def _select_or_capture(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.fx.GraphModule | None, list[Any] | None]:
    """The graph for this call (None: an island), and the call's leaves where the choice flattened
    it, so that a graph taking containers' leaves is not given a second flatten."""
    state = _state(module)
    mode = module.training
    for graph in state.graphs:
        if fits(graph, mode, args, kwargs):
            return graph, None
    flat = flatten((args, kwargs))
    for graph in state.graphs:
        if fits_containers(graph, mode, flat):
            return graph, flat[0]
    key = structure(module, flat)
    if key in state.islands:
        return None, None
    dynamic = any(graph.meta[TRAINING_MODE_KEY] == mode for graph in state.graphs)
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
    original = _original_class(_captured_base(cls))
    checkpoints = checkpointed_layers(module)
    sharded = is_sharded(module)
    if sharded and checkpoints:
        raise TypeError(
            f"{cls.__name__} is sharded by FSDP2 and checkpoints layers {sorted(checkpoints)[:3]}; amp_fx "
            "does not combine the two yet: call gradient_checkpointing_disable() on the model"
        )
    try:
        # Entered before the class changes: it finds FSDP2's modules by their classes.
        with sharded_capture(module):
            module.__class__ = original
            EXPORTING.append(True)
            try:
                with checkpointing_off(module):
                    graph = _export_with_containers(module, args, kwargs, region, dynamic, containers)
            finally:
                EXPORTING.pop()
                module.__class__ = cls
    except ExportError as error:
        failure = error
    else:
        failure = None
    if failure is None:
        graph.meta[TRAINING_MODE_KEY] = module.training
        # Parameters the graph is first to read are stored now (`amp_fx.capture.storage`), not
        # those of a model FSDP2 shards or of a call on fake tensors (its graph is dropped after it).
        decide = not sharded and not _on_fake_tensors(args, kwargs)
        with storing_unstored(module, state, graph, decide) as unstored:
            keep_outputs, keep_inputs = kept_dtypes(graph)
            context = Conversion(
                policy,
                tuple(graph_inputs(graph, args, kwargs)),
                keep_output_dtype=keep_outputs,
                keep_input_dtype=keep_inputs,
                unstored_parameters=unstored,
                training=module.training,
            )
            rewrite_graph(graph, context)
        graph = checkpoint_regions(graph, checkpoints)
        if sharded:
            graph = shard_regions(graph, module, sharded_modules(module))
        for hook in state.capture_hooks:
            hook(graph)
    else:
        _become_island(module, state, key, failure)
        graph = None
    del failure  # its traceback holds this frame, and so the caller's frame and outputs
    # torch.export and the passes leave reference cycles behind (tracebacks holding the frames of
    # this call). Until Python next collects them, they keep the caller's frame alive and with it
    # the first call's outputs: GPT-2's FP32 logits and key/value cache, 4 GiB at 16 x 1024. They
    # are young: collecting the two young generations frees them in 1 ms, a full collection takes
    # 0.5 s.
    gc.collect(1)
    if graph is None:
        return None
    state.graphs.append(graph)
    state.seconds.append(time.perf_counter() - start)

    def undo() -> None:
        state.graphs.remove(graph)
        state.seconds.pop()

    record(undo)
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


def _become_island(
    module: nn.Module, state: CaptureState, key: tuple[Any, ...], failure: ExportError
) -> None:
    state.islands[key] = f"{failure}; fix: {failure.advice}"
    record(lambda: state.islands.pop(key))
    if JOURNALS:
        JOURNALS[-1].islands.append((module, state.islands[key]))
    # Its parts were converted with it; one added to the model since is converted now.
    _make_descendants_captured(module, state.policy, state.unstored)


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
