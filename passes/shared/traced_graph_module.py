"""The GraphModule `amp_fx.passes.trace.trace` returns: called like the model it was traced from.

Its forward has the model's signature, and where the model's forward reads ``self.training`` it
holds a graph for each mode and runs the one of its own mode (`TracedGraphModule`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.core.node_info import (
    FORWARD_SIGNATURE_KEY,
    OTHER_MODE_GRAPH_KEY,
)

__all__ = ["TracedGraphModule", "rebuild_traced_graph_module"]


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
        >>> from amp_fx.passes.trace import trace
        >>> class Noisy(nn.Module):
        ...     def forward(self, x, *, p=1.0):
        ...         return F.dropout(x, p, self.training)
        >>> gm = trace(Noisy().eval())
        >>> inspect.signature(gm.forward)
        <Signature (x, *, p=1.0)>
        >>> gm(torch.ones(2)), gm.train()(torch.ones(2))
        (tensor([1., 1.]), tensor([0., 0.]))
    """

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
        return python_code

    def __deepcopy__(self, memo: dict[int, Any]) -> TracedGraphModule:
        copied = super().__deepcopy__(memo)
        copied.recompile()  # its meta is set after GraphModule's own recompile
        return copied

    def __reduce__(self) -> tuple[Any, ...]:
        # GraphModule pickles the code of `gm.graph` only and loads as a plain GraphModule: keep
        # the signature, the other mode's code and the meta with it.
        _, (body, import_block) = super().__reduce__()
        meta = {k: v for k, v in self.meta.items() if k != OTHER_MODE_GRAPH_KEY}
        body = {**body, "meta": meta}  # a Graph does not pickle
        other = None
        if OTHER_MODE_GRAPH_KEY in self.meta:
            training, graph = self.meta[OTHER_MODE_GRAPH_KEY]
            code = graph.python_code(root_module="self")
            other = (training, code.src, _import_block(code.globals))
        return (rebuild_traced_graph_module, (body, import_block, meta, other))


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
