"""`amp_fx.convert`: a model in, a mixed-precision model with explicit casts out.

    >>> import torch, amp_fx
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> gm = amp_fx.convert(model, "O1", dtype=torch.bfloat16, device_type="cpu")
    >>> gm(torch.randn(4, 8)).dtype
    torch.bfloat16
    >>> from amp_fx.core.node_info import node_info
    >>> [n.name for n in gm.graph.nodes if node_info(n).is_cast]  # gm.print_readable() shows them
    ['input_1_to_bfloat16', '_0_weight_to_bfloat16', '_0_bias_to_bfloat16',
     '_2_weight_to_bfloat16', '_2_bias_to_bfloat16']

Two front ends capture the model (docs/DESIGN.md): torch.fx symbolic tracing (`amp_fx.capture.fx`)
when it takes the forward whole, else torch.export call by call (`amp_fx.capture.captured_model`). Either
hands its graph to one pipeline of passes (`amp_fx.pipeline`). The input model is not modified,
unless ``in_place=True`` asks for it to become the converted model (the torch.export front end).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.capture.captured_model import CapturedModel, capture_states, captured_model
from amp_fx.capture.fx import TraceError, trace
from amp_fx.capture.graph_follower import GraphFollower
from amp_fx.capture.traced_graph_module import FOLLOWER_ATTR, copy_graph
from amp_fx.core.dtypes import default_device_type, low_precision_dtype, short_repr
from amp_fx.core.node_info import (
    OTHER_MODE_GRAPH_KEY,
    POLICY_KEY,
    UNTRACEABLE_MODULES_KEY,
    node_info,
)
from amp_fx.core.opt_levels import check_opt_level
from amp_fx.core.policy import Policy, preset
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.optim.model_load_hooks import follow_model_loads, masters_for_stored_low
from amp_fx.optim.step_checks import record_conversion
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.pipeline import rewrite_graph

logger = logging.getLogger(__name__)

__all__ = ["convert", "FRONT_ENDS"]

# "auto": torch.fx when it traces the forward whole (no inputs needed, shape-agnostic), else
# torch.export call by call; "fx" and "export" force one.
FRONT_ENDS = ("auto", "fx", "export")


def _check_model(model: Any) -> None:
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    if isinstance(model, wrappers):
        raise TypeError(
            f"convert got a model wrapped in {type(model).__name__}; convert model.module, then wrap "
            f"the result in {type(model).__name__}: "
            f"{type(model).__name__}(amp_fx.convert(model.module, ...))"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"convert expects a torch.nn.Module, got {type(model).__name__}; pass the model itself "
            "(wrap a plain function in an nn.Module whose forward calls it)"
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"convert got a TorchScript module ({type(model).__name__}); TorchScript modules cannot be "
            "converted (their forward is compiled TorchScript, not Python that torch.fx or torch.export "
            "can capture): pass the original nn.Module, before torch.jit.script / torch.jit.trace"
        )
    _check_not_meta(model)


def _check_not_meta(model: nn.Module) -> None:
    on_meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if on_meta:
        shown = ", ".join(on_meta[:3]) + (", ..." if len(on_meta) > 3 else "")
        raise ValueError(
            f"convert got a model with {len(on_meta)} tensors on the meta device ({shown}); meta tensors "
            "hold no values, so there is nothing to convert: materialise the model first, e.g. "
            "model.to_empty(device='cpu') then initialise it (reset_parameters() / your init) or load "
            "its weights with model.load_state_dict(...), then convert it"
        )


def _check_example_inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            f"example_inputs must be a tuple of the forward's positional arguments, got "
            f"{type(example_inputs).__name__}; for one input x pass example_inputs=(x,)"
        )
    return tuple(example_inputs)


def _resolve_policy(
    opt_level: str | None,
    dtype: torch.dtype | str | None,
    device_type: str | None,
    keep_batchnorm_fp32: bool | str | None,
    cast_model_outputs: torch.dtype | None,
    policy: Policy | None,
    model: nn.Module,
) -> Policy:
    if policy is None:
        if opt_level is None:
            raise TypeError(
                "convert needs an opt_level ('O0', 'O1', 'O2' or 'O3') or a policy: "
                "amp_fx.convert(model, 'O2') or amp_fx.convert(model, policy=amp_fx.preset('O2', ...))"
            )
        return preset(
            opt_level,
            dtype=torch.float16 if dtype is None else dtype,
            device_type=device_type if device_type is not None else default_device_type(model),
            keep_batchnorm_fp32=keep_batchnorm_fp32,
            cast_model_outputs=cast_model_outputs,
        )
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be an amp_fx.Policy (e.g. amp_fx.preset('O2').set_op('softmax', 'fp32')), "
            f"got {type(policy).__name__}"
        )
    if opt_level is not None:
        check_opt_level(opt_level)  # the same message as without a policy
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    conflicts = []
    if opt_level is not None and opt_level != policy.opt_level:
        conflicts.append(f"opt_level {opt_level!r} vs the policy's {policy.opt_level!r}")
    if dtype is not None and low_precision_dtype(dtype) != policy.dtype:
        conflicts.append(f"dtype {low_precision_dtype(dtype)} vs the policy's {policy.dtype}")
    if device_type is not None and policy.device_type is not None and device_type != policy.device_type:
        conflicts.append(f"device_type {device_type!r} vs the policy's {policy.device_type!r}")
    if keep_batchnorm_fp32 is not None and keep_batchnorm_fp32 not in (
        policy.keep_batchnorm_fp32,
        str(policy.keep_batchnorm_fp32),
    ):
        conflicts.append(
            f"keep_batchnorm_fp32={keep_batchnorm_fp32} vs the policy's {policy.keep_batchnorm_fp32}"
        )
    if cast_model_outputs is not None and cast_model_outputs != policy.cast_model_outputs:
        conflicts.append(
            f"cast_model_outputs={cast_model_outputs} vs the policy's {policy.cast_model_outputs}"
        )
    if conflicts:
        raise ValueError(
            f"convert got a policy and arguments that disagree ({'; '.join(conflicts)}); the policy "
            "decides: build it with amp_fx.preset(opt_level, dtype, device_type, ...) and pass only "
            "the policy"
        )
    # A policy without a device type takes the model's (or the device_type argument's).
    return policy.for_device(device_type if device_type is not None else default_device_type(model))


def _is_converted(model: nn.Module) -> bool:
    return isinstance(model, torch.fx.GraphModule) and POLICY_KEY in model.meta


def _rewrite_each_mode(gm: torch.fx.GraphModule, context: Conversion) -> None:
    """Rewrite ``gm.graph`` and, where the forward reads ``self.training``, the other mode's graph
    (`amp_fx.capture.traced_graph_module.TracedGraphModule`), each by the whole pipeline on
    the one module."""
    if OTHER_MODE_GRAPH_KEY in gm.meta:
        training, other = gm.meta[OTHER_MODE_GRAPH_KEY]
        own = gm.graph
        gm.graph = other
        rewrite_graph(gm, context)
        gm.meta[OTHER_MODE_GRAPH_KEY] = (training, gm.graph)
        gm.graph = own
    # The graph of the mode traced in last: the report and gm.meta describe it.
    rewrite_graph(gm, context)


def _traced_graphs(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """Copies of ``gm``'s graphs as traced (its own, then the other mode's where it has one)."""
    graphs = [gm.graph]
    if OTHER_MODE_GRAPH_KEY in gm.meta:
        graphs.append(gm.meta[OTHER_MODE_GRAPH_KEY][1])
    return [copy_graph(graph) for graph in graphs]


def _rewrite_again(gm: torch.fx.GraphModule, added: frozenset[str]) -> None:
    """Run the passes again on ``gm``'s graphs as traced (`GraphFollower` keeps them), with the
    modules it holds now: a change made after conversion (a leaf replaced, a norm's ``eps``, a hook
    on a module a pass fused) then runs. The tensors named in ``added`` are stored as conversion
    stores them (their objects kept: an optimizer may hold them); the others keep their dtypes.
    A rewrite that fails leaves ``gm`` as it was."""
    follower = gm.__dict__[FOLLOWER_ATTR]
    policy = gm.meta[POLICY_KEY]
    saved_graph, saved_meta = gm.graph, dict(gm.meta)
    tensors = dict([*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)])
    before = [(tensors[name], tensors[name].data) for name in added]
    sources = [copy_graph(graph) for graph in follower.sources]
    try:
        if len(sources) > 1:
            gm.meta[OTHER_MODE_GRAPH_KEY] = (saved_meta[OTHER_MODE_GRAPH_KEY][0], sources[1])
        gm.graph = sources[0]
        # Plan only the added tensors; the rest are stored already.
        _rewrite_each_mode(gm, Conversion(policy, unstored_parameters=added))
        _capture_untraceable_children(gm, policy)
    except BaseException:
        for tensor, data in before:
            tensor.data = data
        gm.meta.clear()
        gm.meta.update(saved_meta)
        gm.graph = saved_graph
        raise
    lowered = [(t, data) for t, data in before if t.dtype != data.dtype and isinstance(t, nn.Parameter)]
    masters_for_stored_low(lowered)


def _capture_untraceable_children(gm: torch.fx.GraphModule, policy: Policy) -> None:
    """Each submodule torch.fx could not trace (not those named in ``leaf_modules``) becomes a
    torch.export-captured copy (`amp_fx.capture.captured_model`) that the graph calls directly, in place of
    the autocast island the passes made for it: its code then runs in rewritten graphs too.

    The passes already stored its parameters as for an island (each module's op decides, as
    `captured_model` decides), and treated its outputs as of unknown dtype, so the copy leaves its
    outputs in the dtype its graph computes (no float32 cast of model outputs in mid-graph)."""
    untraceable = gm.meta.get(UNTRACEABLE_MODULES_KEY, {})
    if not untraceable or not policy.level.lowers_precision:
        return
    graphs = [gm.graph]
    if OTHER_MODE_GRAPH_KEY in gm.meta:
        graphs.append(gm.meta[OTHER_MODE_GRAPH_KEY][1])
    islands = set()
    for graph in graphs:
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            module = gm.get_submodule(node.target)
            if isinstance(module, AutocastIsland) and module.name in untraceable:
                islands.add(node.target)
                node.target = module.name
                info = node_info(node)
                info.notes = [note for note in info.notes if not note.startswith("runs in ")]
            if node.target in untraceable:
                node_info(node).reason = (
                    f"{untraceable[node.target]}; captured with torch.export call by call "
                    "(amp_fx.capture_summary shows its graphs)"
                )
    child_policy = dataclasses.replace(policy, cast_model_outputs=None)
    for name in untraceable:
        parent_name, _, attribute = name.rpartition(".")
        child = gm.get_submodule(name)
        if isinstance(child, CapturedModel):
            continue  # captured already: the graph was rewritten again (`_rewrite_again`)
        captured = captured_model(child, child_policy)
        _share_tensors(captured, child)
        capture_states(captured)[0][1].unstored.clear()  # the passes stored every one of them
        setattr(gm.get_submodule(parent_name), attribute, captured)
        logger.info("%s: torch.fx stopped in %r; it is captured with torch.export", type(gm).__name__, name)
    for path in islands:
        gm.delete_submodule(path)
    gm.recompile()


def _share_tensors(copy: nn.Module, original: nn.Module) -> None:
    """Give ``copy`` (a copy of ``original``) the original's parameters and buffers under the same
    names: weights tied to the rest of the model (an embedding and an output projection) stay tied,
    and optimizers see the tensors the passes stored."""
    originals = dict(original.named_modules(remove_duplicate=False))
    for path, module in copy.named_modules(remove_duplicate=False):
        source = originals[path]
        module._parameters.update({k: source._parameters[k] for k in module._parameters})
        module._buffers.update({k: source._buffers[k] for k in module._buffers})


def convert(
    model: nn.Module,
    opt_level: str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device_type: str | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    policy: Policy | None = None,
    example_inputs: Sequence[Any] | None = None,
    leaf_modules: Sequence[type | str] = (),
    concrete_args: dict[str, Any] | None = None,
    front_end: str = "auto",
    in_place: bool = False,
) -> nn.Module:
    """Convert `model` to mixed precision at an Apex opt level; returns a new GraphModule.

    Args:
        model: the model (an nn.Module, not wrapped in DDP/DataParallel); not modified, unless
            `in_place`.
        opt_level: "O0" (identity), "O1" (torch.autocast's op lists, fp32 weights), "O2" (low
            weights, FP32 islands, BatchNorm fp32), "O3" (pure low precision). May be left out
            when `policy` is given (the policy's opt level decides).
        dtype: torch.float16 (default) or torch.bfloat16, or a name of one ("fp16", "half",
            "bf16", "bfloat16", ...: `amp_fx.core.dtypes.LOW_PRECISION_DTYPE_NAMES`). With a
            `policy`, a dtype other than the policy's is refused.
        device_type: "cuda" or "cpu", selects autocast's op lists; default: the device of the
            model's parameters (cpu without any).
        keep_batchnorm_fp32, cast_model_outputs: Apex's overrides (default True at O2 /
            float32 outputs at O2 and O3).
        policy: an `amp_fx.Policy` to use instead of the preset (it then decides opt_level, dtype,
            keep_batchnorm_fp32 and cast_model_outputs, and device_type if it names one; else
            the model's is used): ``convert(model, policy=amp_fx.preset("O2").set_op(...))``.
        example_inputs: a tuple of forward arguments; makes dtype propagation exact (run on fake
            tensors, no compute), so no cast is ever a no-op.
        leaf_modules: module types or qualified names to keep opaque (run in an autocast island).
        concrete_args: forward arguments to specialise while tracing (as torch.fx).
        front_end: "auto" (default): torch.fx symbolic tracing when it takes the top-level forward
            (the result is a GraphModule), else the torch.export front end (the result is a copy of
            the model, of its class, that captures each new argument structure at its first call;
            see `amp_fx.capture.captured_model`). "fx" or "export" forces one. `leaf_modules`,
            `concrete_args` and `example_inputs` are torch.fx's.
        in_place: convert `model` itself, with the torch.export front end, and return it: the
            object the caller holds (a Hugging Face model that later calls ``save_pretrained``, a
            trainer's model) is the one that trains. Its class becomes the converted subclass of
            its own, its Parameter objects stay (an optimizer built over them keeps training them)
            and their storage takes the policy's dtypes; keep ``{id(p): p.data}`` before the call
            for the FP32 values.

    Raises:
        TypeError: `model` is not an nn.Module, is wrapped in DDP/DataParallel or is a TorchScript
            module; neither
            `opt_level` nor `policy` given; `policy` or
            `example_inputs` of the wrong type; the top-level forward cannot be traced (TraceError).
        ValueError: `model` has tensors on the meta device; unknown opt level, dtype, device type;
            a policy naming an unknown op;
            arguments that contradict `policy`; `leaf_modules` or `concrete_args` with
            ``front_end="export"`` or `in_place`; `in_place` with ``front_end="fx"``.

    The result has every parameter and buffer of ``model`` under its name, also those the forward
    never reads (cast by the rule for the rest of their module), so state dicts load both ways strictly.
    It stores the policy in ``gm.meta["amp_fx_policy"]`` and the traced graph before any
    cast in ``gm.meta["amp_fx_original_code"]`` (read by `amp_fx.report`). Converting a converted
    GraphModule again with the same arguments inserts nothing.
    """
    # Validate everything before any work: a bad argument never leaves a half-converted copy.
    _check_model(model)
    resolved = _resolve_policy(
        opt_level, dtype, device_type, keep_batchnorm_fp32, cast_model_outputs, policy, model
    )
    examples = _check_example_inputs(example_inputs)

    if front_end not in FRONT_ENDS:
        raise ValueError(
            f"front_end must be one of {', '.join(map(repr, FRONT_ENDS))}, got {short_repr(front_end)}"
        )
    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be True or False, got {short_repr(in_place)}")
    if in_place and front_end == "fx":
        raise ValueError(
            "in_place=True converts the model object itself, which only the torch.export front end "
            "does (torch.fx makes a new GraphModule): leave front_end out, or drop in_place"
        )
    if (front_end == "export" or in_place) and (leaf_modules or concrete_args is not None):
        raise ValueError(
            "leaf_modules and concrete_args are torch.fx's: front_end='export' and in_place=True capture "
            "with torch.export, which takes neither; leave them out, or use front_end='fx'"
        )
    if isinstance(model, CapturedModel):
        raise TypeError(
            f"convert got a {type(model).__name__} that amp_fx.convert already converted; convert the "
            "original model (its FP32 weights) instead, at the level and dtype you want"
        )

    if _is_converted(model) and in_place:
        raise ValueError(
            "convert got a GraphModule amp_fx.convert already made, with in_place=True; it is converted "
            "already: use it as it is, or convert the original model in place"
        )
    if _is_converted(model):
        previous = model.meta[POLICY_KEY]
        if previous != resolved:
            # Its weights are already stored for the old policy: converting again would keep fp16
            # weights at O0 or round fp16 weights to bf16, a silent hybrid.
            raise ValueError(
                f"convert got a model amp_fx.convert already converted at {previous.opt_level} "
                f"({previous.dtype}, {previous.device_type}); converting it at {resolved.opt_level} "
                f"({resolved.dtype}, {resolved.device_type}) would mix the two: convert the original "
                "model (its FP32 weights) instead"
            )
        # Already amp_fx's: its graph is flat and annotated, and re-tracing would run the
        # autocast islands' context managers at trace time. Convert a copy of it as it is; its
        # parameters are stored already (fused calls read weights whose dtype no op decides).
        gm = copy.deepcopy(model)
        gm.__dict__.pop(FOLLOWER_ATTR, None)  # its graphs stay as they are now
    elif front_end == "export" or in_place:
        converted = captured_model(model, resolved, in_place=in_place)
        return record_conversion(model, follow_model_loads(converted))
    else:
        try:
            gm = trace(model, leaf_modules=leaf_modules, concrete_args=concrete_args)
        except TraceError as error:
            if front_end == "fx" or concrete_args is not None:
                raise
            logger.info("%s: torch.fx stopped (%s); using torch.export", type(model).__name__, error)
            if leaf_modules:
                logger.warning(
                    "%s: leaf_modules are torch.fx's and the torch.export front end ignores them",
                    type(model).__name__,
                )
            return record_conversion(model, follow_model_loads(captured_model(model, resolved)))
    stored = _is_converted(model)
    traced = None if stored else _traced_graphs(gm)
    _rewrite_each_mode(gm, Conversion(resolved, examples, parameters_stored=stored))
    _capture_untraceable_children(gm, resolved)
    logger.info(
        "converted %s at %s (%s, %s): %d cast nodes",
        type(model).__name__,
        resolved.opt_level,
        resolved.dtype,
        resolved.device_type,
        sum(1 for n in gm.graph.nodes if node_info(n).is_cast),
    )
    converted = record_conversion(model, follow_model_loads(gm))
    if traced is not None:
        # Changes made to it from here on run (`amp_fx.capture.changes.GraphFollower`).
        gm.__dict__[FOLLOWER_ATTR] = GraphFollower(gm, traced, _rewrite_again)
    return converted
