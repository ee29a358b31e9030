"""A convert pass: the dtype every node sees and produces once its rule is applied.

For each node, ``node_info(node).in_dtypes`` is the dtype of each input (one per
``node.all_input_nodes``) *as the node sees it after the casts its rule asks for*, and
``out_dtype`` the dtype it produces (None where the value is not a tensor or its dtype is not
known). Parameters are taken in the dtype `cast_parameters` will store them in. This is the single
place that decides casts: `insert_casts` and `cast_outputs` only make the graph match, inserting
a cast wherever a node sees a dtype its producer does not produce. Run on a converted graph, the
pass finds every node already seeing what its producer produces, which is why converting twice
inserts nothing.

Two ways to get the dtypes:

- static (default): transfer rules per op (`amp_fx.passes.propagate_dtypes.dtype_rules`: LOWER -> low
  dtype, FP32 -> float32, comparisons -> bool, ``x.to(d)`` -> d, otherwise torch's type promotion
  of the inputs); model inputs are taken to be float32 (an integer input is harmless: casts from
  model inputs only ever touch floating tensors). Opaque nodes produce "unknown", and casts of
  unknown values are guarded (`cast_if_floating`).
- exact, with ``example_inputs``: the graph is run on fake tensors (``FakeTensorMode``: shapes
  and dtypes only, no compute), each node on its inputs cast as its rule says, parameters faked in
  their planned dtype, opaque nodes under ``torch.autocast``.

Example (O1, CPU, bf16; model ``softmax(fc(x))``, ``fc`` LOWER, softmax PASSTHROUGH on CPU)::

    node     rule         in_dtypes               out_dtype
    x        -            ()                      float32
    fc       LOWER        (bfloat16,)             bfloat16     <- x must be cast: float32 != bfloat16
    softmax  PASSTHROUGH  (bfloat16,)             bfloat16
    output   -            (bfloat16,)             -

Where the policy casts inputs at the entry (O3, or ``cast_inputs_at_entry=True``: Apex's O2) a
floating model input is seen in the low dtype by its users, while the placeholder's own
``out_dtype`` stays the input's dtype. Otherwise (O2) its users see it as it is: ops that run in
FP32 or pass their dtype through (``x.mean()``, ``x - mean``) read it in full precision, and the
first op whose rule casts (LOWER, OPAQUE) casts it or the value computed from it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.node import map_aggregate, map_arg

from amp_fx.core.node_info import META_KEY, node_info
from amp_fx.core.policy import Rule
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.passes.propagate_dtypes.dtype_rules import (
    NOT_TENSOR,
    UNKNOWN,
    abstract_structure,
    abstract_value,
    input_cast_dtypes,
    is_eligible,
    low_parameter_dtype,
    rule_cast_dtype,
    seen_dtype,
    static_output,
)
from amp_fx.passes.shared.casts import is_output_structure
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.dtypes import (
    ASSUMED_DTYPE_NOTE,
    DERIVED_ASSUMED_DTYPE_NOTE,
    UNKNOWN_INPUT_DTYPE_NOTE,
    dtype_is_assumed,
)

logger = logging.getLogger(__name__)

__all__ = ["propagate_dtypes", "ExampleInputsMismatch"]


def _outputs_keeping_dtype(context: Conversion, output: torch.fx.Node) -> set[torch.fx.Node]:
    """The returned values ``context.keep_output_dtype`` names (a KV cache's tensors): not cast."""
    indices = context.keep_output_dtype
    flat = output.args[0] if output.args and isinstance(output.args[0], (tuple, list)) else ()
    return {flat[i] for i in indices if i < len(flat) and isinstance(flat[i], torch.fx.Node)}


def _module_state(module: nn.Module, path: str, plan: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """Planned dtype of each parameter/buffer of `module`, by its name inside the module."""
    prefix = f"{path}." if path else ""
    state = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        state[name] = plan.get(prefix + name, tensor.dtype)
    return state


def _called_module(node: torch.fx.Node, gm: torch.fx.GraphModule) -> tuple[Any, str, bool]:
    """(module or function to run, its qualified path, whether under autocast) for call_module."""
    module = gm.get_submodule(node.target)
    if isinstance(module, AutocastIsland):
        path = module.name if isinstance(module.wrapped, nn.Module) else ""
        return module.wrapped, path, True
    return module, node.target, False


class _Propagation:
    """Walks the graph in order, deciding what each node sees and computing what it produces."""

    def __init__(
        self, gm: torch.fx.GraphModule, context: Conversion, example_inputs: Sequence[Any] | None
    ) -> None:
        self.gm = gm
        self.context = context
        self.policy = context.policy
        self.plan = context.parameter_plan
        self.exact = example_inputs is not None
        self.example_inputs = list(example_inputs) if example_inputs is not None else []
        # node -> the value its users see: a dtype/marker/tuple (static) or a fake tensor (exact).
        self.env: dict[torch.fx.Node, Any] = {}
        # In exact mode, the nodes whose value is static all the same (fake tensors could not run
        # them or an input); the static rules continue from there.
        self.static_nodes: set[torch.fx.Node] = set()
        self.fake_mode: Any = None

    # -- values ---------------------------------------------------------------------------------
    def is_static(self, node: torch.fx.Node) -> bool:
        """Whether `node`'s value is a static one (a dtype or marker) rather than a fake tensor."""
        return not self.exact or node in self.static_nodes

    def abstract(self, node: torch.fx.Node) -> Any:
        value = self.env[node]
        return value if self.is_static(node) else abstract_value(value)

    def cast_value(self, value: Any, dtype: torch.dtype | None, static: bool) -> Any:
        if dtype is None:
            return value
        if static:
            return dtype if is_eligible(value) is not False else value
        if isinstance(value, torch.Tensor) and is_eligible(value.dtype) and value.dtype != dtype:
            return value.to(dtype)
        return value

    # -- per node -------------------------------------------------------------------------------
    def run(self) -> None:
        if self.exact:
            # Imported on first use: it pulls in much of torch._dynamo (seconds), which static
            # propagation never needs.
            from torch._subclasses.fake_tensor import FakeTensorMode

            self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            with self.fake_mode, _quiet_fake_tensor_errors():
                self._walk()
        else:
            self._walk()

    def _walk(self) -> None:
        placeholder_index = 0
        for node in self.gm.graph.nodes:
            info = node_info(node)
            if node.op == "placeholder":
                raw = self._placeholder_value(node, placeholder_index)
                placeholder_index += 1
                self._note_input_dtype(node, raw)
                info.in_dtypes = ()
                info.out_dtype = self._dtype_of(raw)
                # Users of a model input see it cast to the entry dtype (cast_inputs_at_entry); a
                # cache's do not. Otherwise the rule of each reader casts it (its first LOWER one).
                kept = placeholder_index - 1 in self.context.keep_input_dtype
                entry = None if kept else self.policy.entry_cast_dtype
                self.env[node] = self.cast_value(raw, entry, not self.exact)
                continue
            if node.op == "get_attr":
                self.env[node] = self._get_attr_value(node)
                info.in_dtypes = ()
                info.out_dtype = self._dtype_of(self.env[node])
                continue
            inputs = node.all_input_nodes
            values = [self.abstract(a) for a in inputs]
            # Downstream of a value fake tensors could not compute, the static rules take over.
            static = any(self.is_static(a) for a in inputs) or not self.exact
            returned = node.op == "output" or is_output_structure(node)
            if returned:
                # The returned values: seen in the cast_model_outputs dtype.
                rule, params = None, {}
                target = self.policy.cast_model_outputs
            else:
                rule, params = info.rule, self._params(node)
                target = rule_cast_dtype(rule, self.policy, [*values, *params.values()], node)
                if target is None and rule is Rule.PASSTHROUGH:
                    target = low_parameter_dtype(node, values, params)
            targets = (target,) * len(values) if returned else input_cast_dtypes(node, target, values)
            info.in_dtypes = tuple(seen_dtype(v, t) for v, t in zip(values, targets, strict=True))
            if node.op == "output":
                kept = _outputs_keeping_dtype(self.context, node)
                info.in_dtypes = tuple(
                    seen_dtype(v, None if a in kept else target) for a, v in zip(inputs, values, strict=True)
                )
                info.out_dtype = None
                continue
            if not static:
                seen = {
                    a: self.cast_value(self.env[a], t, False) for a, t in zip(inputs, targets, strict=True)
                }
                try:
                    out = (
                        self._run_returned(node, seen)
                        if returned
                        else self._run_fake(node, rule, target, seen)
                    )
                except Exception as error:  # e.g. data-dependent control flow in untraced code
                    if _rejects_shapes(error):
                        raise ExampleInputsMismatch(self._mismatch_message(node, error)) from error
                    logger.info(
                        "fake tensors cannot run %s (%s: %s); its dtypes and those downstream of it "
                        "come from the static rules",
                        node.name,
                        type(error).__name__,
                        error,
                    )
                    static = True
            if static:
                seen = {
                    a: self.cast_value(v, t, True) for a, v, t in zip(inputs, values, targets, strict=True)
                }
                if returned:
                    try:
                        out = abstract_structure(self._run_returned(node, seen))
                    except TypeError:  # built from an iterable value, e.g. tuple(x.unbind())
                        out = UNKNOWN
                else:
                    args, kwargs = (
                        map_arg(node.args, seen.__getitem__),
                        map_arg(node.kwargs, seen.__getitem__),
                    )
                    out = static_output(node, rule, target, args, kwargs, self.gm, params)
                if self.exact:
                    self.static_nodes.add(node)
            self.env[node] = out
            info.out_dtype = None if returned else self._dtype_of(abstract_value(out) if not static else out)
            self._note_assumed_dtype(node, inputs, static)

    def _note_input_dtype(self, node: torch.fx.Node, raw: Any) -> None:
        # Without example_inputs a model input's dtype is a guess: float32, or unknown for an
        # optional input (``targets=None``). Its users still see it cast at entry, so views of it
        # get a dtype; the note keeps the casts of those guarded (integer targets stay integer).
        notes = node_info(node).notes
        note = None
        if not self.exact:
            note = {torch.float32: ASSUMED_DTYPE_NOTE, UNKNOWN: UNKNOWN_INPUT_DTYPE_NOTE}.get(raw)
        for stale in (ASSUMED_DTYPE_NOTE, UNKNOWN_INPUT_DTYPE_NOTE):
            if stale != note and stale in notes:
                notes.remove(stale)
        if note is not None and note not in notes:
            notes.append(note)

    def _note_assumed_dtype(self, node: torch.fx.Node, inputs: list[torch.fx.Node], static: bool) -> None:
        # A dtype-agnostic op's static dtype is only as certain as its inputs': integer targets
        # viewed or reshaped stay integer, so the casts of such a value must stay guarded.
        notes = node_info(node).notes
        derived = (
            static
            and node_info(node).rule in (Rule.PASSTHROUGH, None)
            and node_info(node).out_dtype is not None
            and any(dtype_is_assumed(a) for a in inputs)
        )
        if derived and DERIVED_ASSUMED_DTYPE_NOTE not in notes:
            notes.append(DERIVED_ASSUMED_DTYPE_NOTE)
        elif not derived and DERIVED_ASSUMED_DTYPE_NOTE in notes:
            notes.remove(DERIVED_ASSUMED_DTYPE_NOTE)

    def _mismatch_message(self, node: torch.fx.Node, error: Exception) -> str:
        shapes = ", ".join(
            str(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__
            for v in self.example_inputs
        )
        what = node_info(node).op or node.target
        return (
            f"example_inputs do not fit the model: {node.name} ({what}) rejects the shapes they lead to: "
            f"{error} (example_inputs shapes: {shapes}); pass example_inputs of the shapes the forward "
            "takes, or leave example_inputs out"
        )

    def _run_returned(self, node: torch.fx.Node, seen: dict[torch.fx.Node, Any]) -> Any:
        """Build the returned tuple/namedtuple/dict from the values its constructor sees."""
        return node.target(*map_arg(node.args, seen.__getitem__), **map_arg(node.kwargs, seen.__getitem__))

    def _dtype_of(self, value: Any) -> torch.dtype | None:
        value = abstract_value(value) if isinstance(value, torch.Tensor) else value
        return value if isinstance(value, torch.dtype) else None

    def check_example_inputs(self) -> None:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        required = [p for p in placeholders if not p.args]
        if not len(required) <= len(self.example_inputs) <= len(placeholders):
            names = ", ".join(p.target for p in placeholders)
            raise ValueError(
                f"example_inputs has {len(self.example_inputs)} values but the model's forward takes "
                f"({names}); pass one example per forward argument, in order"
            )

    def _placeholder_value(self, node: torch.fx.Node, index: int) -> Any:
        if not self.exact:
            if node.args and not isinstance(node.args[0], torch.Tensor):
                return UNKNOWN  # an optional argument (default None/flag): may be anything
            # Assumed float32: a model input is a floating tensor unless example_inputs say otherwise.
            return torch.float32
        if index < len(self.example_inputs):
            value = self.example_inputs[index]
        else:
            value = node.args[0]  # the forward's default
        return map_aggregate(
            value, lambda v: self.fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
        )

    def _get_attr_value(self, node: torch.fx.Node) -> Any:
        try:
            attribute = self.gm.get_parameter(node.target)
        except AttributeError:
            try:
                attribute = self.gm.get_buffer(node.target)
            except AttributeError:
                attribute = _getattr_path(self.gm, node.target)
        if not isinstance(attribute, torch.Tensor):
            return NOT_TENSOR if not self.exact else attribute
        dtype = self.plan.get(node.target, attribute.dtype)
        if not self.exact:
            return dtype
        fake = self.fake_mode.from_tensor(attribute)
        return fake.to(dtype) if fake.dtype != dtype else fake

    def _params(self, node: torch.fx.Node) -> dict[str, torch.dtype]:
        """Planned dtypes of a call_module's parameters and buffers (they take part in promotion)."""
        if node.op != "call_module":
            return {}
        module, path, _ = _called_module(node, self.gm)
        if not isinstance(module, nn.Module):
            return {}
        return _module_state(module, path, self.plan)

    def _run_fake(
        self,
        node: torch.fx.Node,
        rule: Rule | None,
        target: torch.dtype | None,
        seen: dict[torch.fx.Node, Any],
    ) -> Any:
        args, kwargs = map_arg(node.args, seen.__getitem__), map_arg(node.kwargs, seen.__getitem__)
        if node.op == "call_function":
            if rule is Rule.OPAQUE and self._autocast_applies():
                with torch.autocast(self.policy.device_type, dtype=self.policy.dtype):
                    return node.target(*args, **kwargs)
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_arg, *rest = args
            if rule is Rule.OPAQUE and self._autocast_applies():
                with torch.autocast(self.policy.device_type, dtype=self.policy.dtype):
                    return getattr(self_arg, node.target)(*rest, **kwargs)
            return getattr(self_arg, node.target)(*rest, **kwargs)
        module, path, island = _called_module(node, self.gm)
        under_autocast = (island or rule is Rule.OPAQUE) and self._autocast_applies()
        if isinstance(module, nn.Module):
            state = {}
            tensors = dict([*module.named_parameters(), *module.named_buffers()])
            for name, dtype in _module_state(module, path, self.plan).items():
                fake = self.fake_mode.from_tensor(tensors[name])
                # The rule's casts apply to the module's parameters too (its functional form).
                if target is not None and rule is not Rule.OPAQUE and not island and is_eligible(dtype):
                    dtype = target
                state[name] = fake.to(dtype) if fake.dtype != dtype else fake
            call = lambda: torch.func.functional_call(module, state, tuple(args), dict(kwargs))  # noqa: E731
        else:
            call = lambda: module(*args, **kwargs)  # noqa: E731
        if under_autocast:
            with torch.autocast(self.policy.device_type, dtype=self.policy.dtype):
                return call()
        return call()

    def _autocast_applies(self) -> bool:
        return self.policy.autocast_opaque


class ExampleInputsMismatch(ValueError):
    """`example_inputs` that the model's own ops reject (a wrong shape): convert cannot continue."""


# Words of torch's argument checks about shapes ("size mismatch", "must match the size",
# "same reduction dim", "shape '[-1, 4]' is invalid").
_SHAPE_WORDS = ("shape", "size", "dim")


def _rejects_shapes(error: Exception) -> bool:
    """True when an op rejected the shapes of its fake inputs: torch's checks raise exactly
    RuntimeError/ValueError/IndexError, while what fake tensors cannot do (data-dependent
    outputs, unsupported ops) raises subclasses of them, which fall back to the static rules."""
    return type(error) in (RuntimeError, ValueError, IndexError) and any(
        word in str(error).lower() for word in _SHAPE_WORDS
    )


@contextlib.contextmanager
def _quiet_fake_tensor_errors() -> Iterator[None]:
    # FakeTensorMode logs a traceback at ERROR for every op that raises; propagate_dtypes reports
    # the failure itself (an error for a shape mismatch, else an INFO line and the static rules).
    fake_logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_logger.level
    fake_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_logger.setLevel(level)


def _getattr_path(root: Any, path: str) -> Any:
    value = root
    for part in path.split("."):
        value = getattr(value, part)
    return value


def propagate_dtypes(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Record ``in_dtypes`` and ``out_dtype`` on every node (see the module docstring).

    With ``context.example_inputs`` (one per forward argument) the dtypes are exact, from a fake-tensor run;
    if that run fails (an op fake tensors do not support), the static rules are used and a
    warning is logged. Returns ``PassResult(gm, False)`` (the graph is unchanged).

    Raises:
        ExampleInputsMismatch (a ValueError): an op of the model rejects the shapes the example
            inputs lead to (a wrong-shaped example); the graph's annotations are left as they were.

    Example::

        >>> from amp_fx.core.policy import preset
        >>> from amp_fx.passes.classify import classify
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> from amp_fx.passes.shared.decisions import plan_parameters
        >>> from amp_fx.capture.fx import trace
        >>> context = Conversion(preset("O1", torch.bfloat16, "cpu"))
        >>> gm = normalize_ops(trace(nn.Sequential(nn.Linear(4, 2)))).graph_module
        >>> gm = classify(gm, context).graph_module
        >>> gm = propagate_dtypes(gm, plan_parameters(gm, context)).graph_module
        >>> [(n.name, node_info(n).in_dtypes, node_info(n).out_dtype) for n in gm.graph.nodes]
        [('input_1', (), torch.float32), ('_0', (torch.bfloat16,), torch.bfloat16),
         ('output', (torch.bfloat16,), None)]
    """
    policy = context.policy
    example_inputs = context.example_inputs
    propagation = _Propagation(gm, context, example_inputs)
    if example_inputs is None:
        propagation.run()
        return PassResult(gm, False)
    propagation.check_example_inputs()
    devices = {v.device.type for v in example_inputs if isinstance(v, torch.Tensor)}
    if devices - {policy.device_type}:
        # Fake tensors on another device would not see this device type's autocast lists.
        logger.info(
            "example_inputs are on %s, the policy is for %s: using the static dtype rules",
            sorted(devices),
            policy.device_type,
        )
        _Propagation(gm, context, None).run()
        return PassResult(gm, False)
    saved = {node: copy.deepcopy(node.meta.get(META_KEY)) for node in gm.graph.nodes}
    try:
        propagation.run()
    except ExampleInputsMismatch:
        for node, info in saved.items():  # the graph is left as it was
            if info is None:
                node.meta.pop(META_KEY, None)
            else:
                node.meta[META_KEY] = info
        raise
    except Exception as error:  # e.g. an example input fake tensors cannot copy: all static
        logger.warning(
            "exact dtype propagation with example_inputs failed (%s: %s); using the static rules",
            type(error).__name__,
            error,
        )
        _Propagation(gm, context, None).run()
    return PassResult(gm, False)
