"""The GraphModule `amp_fx.capture.fx.trace` returns: called like the model it was traced from.

Its forward has the model's signature, and where the model's forward reads ``self.training`` it
holds a graph for each mode and runs the one of its own mode (`TracedGraphModule`). A traced
``nn.Sequential`` (``ModuleList``, ``ModuleDict``) indexes, iterates and counts its layers as the
model did, a converted Sequential's slice runs its part of the graph
(`amp_fx.capture.sequential_slices`), and a converted one refuses a cast that would break the casts
its graph holds.
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.capture.sequential_slices import show_slice, sliced_graphs
from amp_fx.core.node_info import FORWARD_SIGNATURE_KEY, META_KEY, OTHER_MODE_GRAPH_KEY, POLICY_KEY

__all__ = ["CONTAINER_KEY", "FOLLOWER_ATTR", "TracedGraphModule", "copy_graph", "rebuild_traced_graph_module"]

# The key of a converted GraphModule's ``__dict__`` holding what follows changes made to it after
# conversion (`amp_fx.capture.graph_follower.GraphFollower`): each call first calls it with the module,
# and where it rewrote the graphs (it returns True) the call runs the new ones.
FOLLOWER_ATTR = "_amp_fx_follow_changes"

# gm.meta key: for a model that was an nn.Sequential, ModuleList or ModuleDict (or a subclass),
# ``(kind, names)``: which of the three, and the names of its children in order.
CONTAINER_KEY = "amp_fx_container"

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

# The casts nn.Module offers besides `to` and `type`, and the dtype each gives floating tensors.
_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


class TracedGraphModule(torch.fx.GraphModule):
    """A GraphModule that is called like the model it was traced from.

    - ``inspect.signature(gm.forward)`` is the model's (``gm.meta[FORWARD_SIGNATURE_KEY]``), and
      calls bind as they bind to the model's forward (keyword-only arguments after ``*args``
      included), so libraries that read the signature (Hugging Face's Trainer) see the model's.
    - Where the forward reads ``self.training`` in traced code, ``gm.meta[OTHER_MODE_GRAPH_KEY]``
      holds ``(training, graph)`` for the other mode and each call runs the graph of
      ``gm.training``. Both graphs live in this one module: parameters, buffers and submodules
      are shared, ``state_dict`` and ``.to()`` are those of one model. ``gm.graph`` (what
      ``gm.code`` shows and the report reads) is the graph of the mode the model was traced in.

    Example::

        >>> import torch.nn.functional as F
        >>> from amp_fx.capture.fx import trace
        >>> class Noisy(nn.Module):
        ...     def forward(self, x, *, p=1.0):
        ...         return F.dropout(x, p, self.training)
        >>> gm = trace(Noisy().eval())
        >>> inspect.signature(gm.forward)
        <Signature (x, *, p=1.0)>
        >>> gm(torch.ones(2)), gm.train()(torch.ones(2))
        (tensor([1., 1.]), tensor([0., 0.]))
    """

    def __init__(
        self, root: nn.Module | dict[str, Any], graph: torch.fx.Graph, class_name: str = "GraphModule"
    ):
        super().__init__(root, graph, class_name)
        container = next((kind for kind in _CONTAINERS if isinstance(root, kind)), None)
        if container is not None:
            self.meta[CONTAINER_KEY] = (container.__name__, list(root._modules))
        elif isinstance(root, torch.fx.GraphModule) and CONTAINER_KEY in root.meta:
            self.meta[CONTAINER_KEY] = root.meta[CONTAINER_KEY]  # a pass rebuilt it
        _adopt_container_protocol(self)

    # -- A converted model's dtypes: its graph's casts were chosen for them. --

    def float(self) -> TracedGraphModule:
        return self._cast("float", _CASTS["float"], super().float)

    def double(self) -> TracedGraphModule:
        return self._cast("double", _CASTS["double"], super().double)

    def half(self) -> TracedGraphModule:
        return self._cast("half", _CASTS["half"], super().half)

    def bfloat16(self) -> TracedGraphModule:
        return self._cast("bfloat16", _CASTS["bfloat16"], super().bfloat16)

    def to(self, *args: Any, **kwargs: Any) -> TracedGraphModule:
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return self._cast("to", dtype, lambda: super(TracedGraphModule, self).to(*args, **kwargs))

    def type(self, dst_type: torch.dtype | str) -> TracedGraphModule:
        dtype = dst_type if isinstance(dst_type, torch.dtype) else None
        if dtype is None:
            dtype = getattr(torch, str(dst_type).rsplit(".", 1)[-1].replace("Tensor", "").lower(), None)
        return self._cast("type", dtype, lambda: super(TracedGraphModule, self).type(dst_type))

    def _cast(self, method: str, dtype: torch.dtype | None, cast: Callable[[], Any]) -> Any:
        """``cast()``, unless it would change the dtype of a floating tensor of a model whose graph
        holds a conversion's casts: they were chosen for these dtypes, and the calls would fail
        deep inside ("mat1 and mat2 must have the same dtype"). Refused before anything changes."""
        policy = self.meta.get(POLICY_KEY)
        if dtype is None or policy is None or not policy.level.lowers_precision:
            return cast()
        tensors = [*self.parameters(), *self.buffers()]
        changed = sorted({str(t.dtype) for t in tensors if t.is_floating_point() and t.dtype != dtype})
        if not changed:
            return cast()  # nothing changes dtype: `.float()` on O1's FP32 parameters
        if dtype in (torch.float32, torch.float64):
            fix = f'amp_fx.convert(model, "O0") or the FP32 model itself for {dtype}'
        else:
            fix = f"amp_fx.convert(model, {policy.opt_level!r}, dtype={dtype})"
        raise TypeError(
            f"{type(self).__name__}.{method}() would cast the parameters of a model converted at "
            f"{policy.opt_level} ({policy.dtype}) to {dtype} (now {', '.join(changed)}), but its graph's "
            f"casts were chosen for the dtypes it has and its calls would fail. Convert the FP32 model "
            f"again instead: {fix}; amp_fx.master_state_dict(converted) gives the trained FP32 weights "
            f"to load into it. .to(device) works as before."
        )

    def recompile(self) -> Any:
        python_code = super().recompile()
        cls = type(self)
        meta = self.__dict__.get("meta", {})
        graph_forward = cls.forward
        by_mode = None
        if OTHER_MODE_GRAPH_KEY in meta:
            training, other = meta[OTHER_MODE_GRAPH_KEY]
            by_mode = {training: _compiled_forward(other), not training: graph_forward}
        signature = meta.get(FORWARD_SIGNATURE_KEY)
        cls.forward = _drop_in_forward(graph_forward, by_mode, signature)
        _adopt_container_protocol(self)  # after a deepcopy or a load, whose meta comes later
        return python_code

    def __deepcopy__(self, memo: dict[int, Any]) -> TracedGraphModule:
        copied = super().__deepcopy__(memo)
        type(copied).__name__ = type(self).__name__  # fx's copy would be named "GraphModule"
        # fx's copy keeps only the attributes it knows; a module's deepcopy copies them all (the
        # change follower and the marks of the models watching it included).
        for key, value in self.__dict__.items():
            if key not in copied.__dict__:
                copied.__dict__[key] = copy.deepcopy(value, memo)
        copied.recompile()  # its meta is set after GraphModule's own recompile
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        # GraphModule pickles the code of `gm.graph` only and loads as a plain GraphModule: keep
        # the signature, the other mode's code and the meta with it.
        _, (body, import_block) = super().__reduce__()
        meta = {k: v for k, v in self.meta.items() if k != OTHER_MODE_GRAPH_KEY}
        # A Graph does not pickle, nor do the traced graphs the follower keeps: a loaded model
        # runs its graphs as they are.
        body = {**{k: v for k, v in body.items() if k != FOLLOWER_ATTR}, "meta": meta}
        other = None
        if OTHER_MODE_GRAPH_KEY in self.meta:
            training, graph = self.meta[OTHER_MODE_GRAPH_KEY]
            code = graph.python_code(root_module="self")
            other = (training, code.src, _import_block(code.globals))
        return (rebuild_traced_graph_module, (body, import_block, meta, other))


class _ContainerProtocol:
    """What a `TracedGraphModule` of an nn.Sequential, ModuleList or ModuleDict adds: indexing,
    ``len``, iteration and ``in`` as the model had them, over the layers the graph calls (shared,
    not copied). Only such modules get its methods (`_adopt_container_protocol`), so ``bool(gm)``
    and ``iter(gm)`` of any other model stay those of an ``nn.Module``."""

    def _container(self: Any) -> tuple[str, list[str]]:
        container = self.meta.get(CONTAINER_KEY)
        if container is None:
            raise TypeError(
                f"'{type(self).__name__}' object is not subscriptable (its model was not a container)"
            )
        return container

    def _layer(self: Any, name: str) -> nn.Module:
        module = self._modules.get(name)
        if module is None:
            raise KeyError(
                f"layer {name!r} of the {type(self).__name__} has no module of its own after tracing "
                f"(its graph computes it without one: fused into a neighbour, or never called)"
            )
        return module

    def __getitem__(self: Any, index: int | slice | str) -> Any:
        kind, names = self._container()
        if kind == "ModuleDict":
            if not isinstance(index, str):
                raise TypeError(f"a traced ModuleDict is indexed by name, got {type(index).__name__}")
            if index not in names:
                raise KeyError(index)
            return self._layer(index)
        if isinstance(index, slice):
            policy = self.meta.get(POLICY_KEY)
            if policy is not None and policy.level.lowers_precision and kind == "Sequential":
                return _slice_sequential(self, names, index)
            if policy is not None and policy.level.lowers_precision:
                raise TypeError(
                    f"a slice of a {kind} converted at {policy.opt_level} would run its layers without "
                    f"the casts of the graph between them; convert the slice of the FP32 model instead: "
                    f"amp_fx.convert(model[{show_slice(index)}], {policy.opt_level!r}, dtype={policy.dtype})"
                )
            layers = [(name, self._layer(name)) for name in names[index]]
            return (
                nn.Sequential(OrderedDict(layers))
                if kind == "Sequential"
                else nn.ModuleList(m for _, m in layers)
            )
        if not isinstance(index, int):
            raise TypeError(f"{kind} indices must be integers or slices, not {type(index).__name__}")
        if not -len(names) <= index < len(names):
            raise IndexError(f"index {index} is out of range for a {kind} of {len(names)}")
        return self._layer(names[index])

    def __len__(self: Any) -> int:
        return len(self._container()[1])

    def __iter__(self: Any) -> Iterator[Any]:
        kind, names = self._container()
        if kind == "ModuleDict":
            return iter(names)
        return iter([self._layer(name) for name in names])

    def __contains__(self: Any, key: object) -> bool:
        kind, names = self._container()
        if kind == "ModuleDict":
            return key in names
        return any(key is self._modules.get(name) for name in names)

    def keys(self: Any) -> list[str]:
        """A traced ModuleDict's keys, as its model's."""
        kind, names = self._container()
        if kind != "ModuleDict":
            raise AttributeError(f"'{kind}' has no keys()")
        return list(names)


def _adopt_container_protocol(gm: TracedGraphModule) -> None:
    # fx gives each GraphModule a class of its own (its `recompile` sets `forward` and `__call__`
    # there), so a container's gets the protocol's methods there too; `recompile` adopts a deepcopy
    # or a loaded pickle again, whose meta comes after GraphModule's own recompile.
    cls = type(gm)
    if CONTAINER_KEY in gm.__dict__.get("meta", {}) and "__getitem__" not in vars(cls):
        for name, method in vars(_ContainerProtocol).items():
            if callable(method):
                setattr(cls, name, method)


def _slice_sequential(gm: TracedGraphModule, names: list[str], index: slice) -> nn.Module:
    """``gm[index]`` of a converted Sequential: a converted Sequential of those layers running their
    part of ``gm``'s graph (`sliced_graphs`), casts included, and sharing ``gm``'s modules and
    parameters."""
    graphs = sliced_graphs(gm, names, index)
    if not graphs:
        return nn.Sequential()
    selected = list(range(len(names)))[index]
    graph_training, main = next(iter(graphs.items()))
    sliced = TracedGraphModule(gm, main, class_name=type(gm).__name__)
    for i in selected:  # the layers themselves, where the graph reads only some of their attributes
        if names[i] in gm._modules:
            sliced._modules[names[i]] = gm._modules[names[i]]
    sliced.meta.update(
        {
            POLICY_KEY: gm.meta[POLICY_KEY],
            CONTAINER_KEY: ("Sequential", [names[i] for i in selected]),
            FORWARD_SIGNATURE_KEY: inspect.signature(nn.Sequential.forward).replace(
                parameters=list(inspect.signature(nn.Sequential.forward).parameters.values())[1:]
            ),
        }
    )
    if len(graphs) > 1:
        sliced.meta[OTHER_MODE_GRAPH_KEY] = (not graph_training, graphs[not graph_training])
    sliced.train(gm.training)
    sliced.recompile()
    return sliced


def _import_block(globals_: dict[str, Any]) -> str:
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    return _format_import_block(globals_, sys_importer)


def rebuild_traced_graph_module(
    body: dict[str, Any], import_block: str, meta: dict[str, Any], other: tuple[bool, str, str] | None
) -> TracedGraphModule:
    """A pickled `TracedGraphModule` loaded again (what its ``__reduce__`` names)."""
    from torch.fx.graph_module import reduce_graph_module

    gm = reduce_graph_module(body, import_block)
    name = type(gm).__name__
    gm.__class__ = type("GraphModuleImpl", (TracedGraphModule,), {})  # one class per instance, as fx's
    type(gm).__name__ = name
    gm.meta.update(meta)
    if other is not None:
        training, src, other_imports = other
        other_gm = reduce_graph_module({**body, "_code": src}, other_imports)
        gm.meta[OTHER_MODE_GRAPH_KEY] = (training, other_gm.graph)
    gm.recompile()
    return gm


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose nodes' `NodeInfo` are copies too (a pass rewriting one of the two
    leaves the other as it was)."""
    copied = copy.deepcopy(graph)
    for node in copied.nodes:
        if META_KEY in node.meta:
            node.meta[META_KEY] = copy.deepcopy(node.meta[META_KEY])
    return copied


def _compiled_forward(graph: torch.fx.Graph) -> Callable[..., Any]:
    from torch.fx.graph_module import _forward_from_src

    code = graph.python_code(root_module="self")
    return _forward_from_src(code.src, code.globals)


def _drop_in_forward(
    graph_forward: Callable[..., Any],
    by_mode: dict[bool, Callable[..., Any]] | None,
    signature: inspect.Signature | None,
) -> Callable[..., Any]:
    """The forward of a `TracedGraphModule`: the graph of the module's mode, called with the
    arguments as the model's signature binds them."""
    to_graph_arguments = _argument_mapping(signature, inspect.signature(graph_forward))

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        follow = self.__dict__.get(FOLLOWER_ATTR)
        if follow is not None and follow(self):
            return type(self).forward(self, *args, **kwargs)  # the graphs were rewritten
        if to_graph_arguments is not None:
            args, kwargs = to_graph_arguments(args, kwargs)
        run = graph_forward if by_mode is None else by_mode[self.training]
        return run(self, *args, **kwargs)

    if signature is not None:
        self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[self_parameter, *signature.parameters.values()]
        )
    return forward


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _argument_mapping(
    signature: inspect.Signature | None, graph_signature: inspect.Signature
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None:
    """None where a call passes to the graph's forward as it is; else a function that binds a call
    to the model's signature and passes it on positionally. torch.fx's forward takes every named
    argument positionally (keyword-only ones before ``*args``) and renames some (``x_1``)."""
    if signature is None:
        return None
    parameters = list(signature.parameters.values())
    named = [p for p in parameters if p.kind not in _VARIADIC]
    graph_named = [p.name for p in list(graph_signature.parameters.values())[1:] if p.kind not in _VARIADIC]
    kinds = {p.kind for p in parameters}
    reordered = inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.KEYWORD_ONLY in kinds
    if [p.name for p in named] == graph_named and not reordered:
        return _positional_limit(signature)
    var_positional = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    var_keyword = next((p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def to_graph_arguments(
        args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = signature.bind(*args, **kwargs)  # a call the model would refuse fails as it would
        values = [bound.arguments.get(p.name, p.default) for p in named]
        values += bound.arguments.get(var_positional, ()) if var_positional else ()
        return tuple(values), dict(bound.arguments.get(var_keyword, {})) if var_keyword else {}

    return to_graph_arguments


def _positional_limit(
    signature: inspect.Signature,
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None:
    """Where torch.fx made keyword-only arguments positional: refuse a call that passes them
    positionally, as the model does (a cheap check, where binding each call would not be)."""
    kinds = [p.kind for p in signature.parameters.values()]
    if inspect.Parameter.KEYWORD_ONLY not in kinds:
        return None
    limit = sum(
        kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for kind in kinds
    )

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if len(args) > limit:
            raise TypeError(f"forward() takes {limit} positional arguments but {len(args)} were given")
        return args, kwargs

    return check
