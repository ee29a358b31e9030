"""How much of a converted model runs in rewritten graphs: graphs, capture time, islands, and the
share of one call's ATen ops and matrix-product FLOPs that ran inside those graphs.

`capture_summary` works on whatever `amp_fx.convert` returned: a GraphModule of the torch.fx front
end (one graph, made at convert time; its opaque nodes are its islands) or a model of the torch.export
front end (a graph per captured call structure; modules torch.export could not capture are islands).
Given the model's arguments, it runs one call and counts where the work ran::

    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(nn.Linear(4, 2), preset("O2", torch.bfloat16, "cpu"))
    >>> summary = capture_summary(model, torch.randn(3, 4))
    >>> summary.graphs, summary.op_share, summary.flop_share, summary.parameter_coverage
    (1, 1.0, 1.0, 1.0)

Parameters say little: a model whose attention runs in islands around captured Linear layers reads
every parameter in a graph, yet its softmax, masks and residual stream run outside. The ops and
FLOPs of a call say how much of the work the policy's casts actually govern.
"""

from __future__ import annotations

import dataclasses
import logging
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from amp_fx.capture.captured_model import CapturedModel, capture_states, captured_model  # noqa: F401  (doctests)
from amp_fx.capture.changes import instrument_hooks
from amp_fx.core.node_info import META_KEY, OTHER_MODE_GRAPH_KEY, POLICY_KEY
from amp_fx.core.policy import Rule
from amp_fx.inspect.report_text import REPORT_WIDTH
from amp_fx.ops.autocast_island import AutocastIsland

logger = logging.getLogger(__name__)

__all__ = ["CaptureSummary", "Work", "capture_summary", "captured_graphs"]

# Where work outside every rewritten graph and island ran (code of an unconverted wrapper).
OUTSIDE = "<outside any graph>"
# How the model itself (qualified name "") is shown.
ROOT = "<model>"

_aten = torch.ops.aten
# FLOPs (2*M*N*K for a product of M x K and K x N) of each matrix-product ATen op, as
# torch.utils.flop_counter counts them; linear and matmul reach the dispatcher as mm, addmm, bmm.
# The CPU and overridable attention kernels count as the CUDA ones do.
_FLOP_FORMULAS: dict[Any, Callable[..., int]] = dict(flop_registry)


def _attention_flops(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> int:
    """Q @ K^T and P @ V of an attention kernel, as torch counts them, also where key and value
    have fewer heads than the query (grouped-query attention, which torch 2.11's formula refuses)."""
    *_, query_length, head_dim = query.shape
    rows = query.numel() // head_dim  # batch x query heads x query length
    return 2 * rows * key.shape[-2] * (head_dim + value.shape[-1]) if query_length else 0


# The attention kernels' forwards (CPU and overridable ones included) count with GQA in mind.
for _sdpa in (
    _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_cudnn_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_fused_attention_overrideable,
):
    _FLOP_FORMULAS[_sdpa] = _attention_flops


@dataclasses.dataclass
class Work:
    """ATen ops and matrix-product FLOPs run by one call, or by a part of it."""

    ops: int = 0
    flops: int = 0


@dataclasses.dataclass
class CaptureSummary:
    """What a converted model runs in rewritten graphs (see the module docstring).

    Attributes:
        front_end: "fx" (graphs traced at convert time) or "export" (graphs captured per call).
        graphs: rewritten graphs (the torch.fx front end's: one, or one per train/eval mode where
            the forward reads ``self.training``; the torch.export front end's: one per argument
            structure and size range captured so far, its descendants' included).
        capture_seconds: seconds each capture at a call took (export plus the passes), in order;
            empty for the torch.fx front end, whose graph is made by `convert`.
        parameter_coverage: share of the model's parameters (by element count) read by a rewritten
            graph; the rest run in islands or were not reached.
        islands: qualified module name ("" for the model itself; an fx node's name for a
            function) -> why it runs outside rewritten graphs, in an autocast island.
        call: the ATen ops and matrix-product FLOPs of the call counted; None when no arguments
            were given.
        in_graphs: the part of ``call`` that ran inside rewritten graphs.
        outside_graphs: the rest, by where it ran: the island (its qualified module name, ""
            for the model's own code) or ``<outside any graph>``.
    """

    front_end: str = "export"
    graphs: int = 0
    capture_seconds: list[float] = dataclasses.field(default_factory=list)
    parameter_coverage: float = 0.0
    islands: dict[str, str] = dataclasses.field(default_factory=dict)
    call: Work | None = None
    in_graphs: Work | None = None
    outside_graphs: dict[str, Work] = dataclasses.field(default_factory=dict)

    @property
    def op_share(self) -> float | None:
        """Share of the counted call's ATen ops that ran in rewritten graphs (None: no call)."""
        if self.call is None or self.in_graphs is None:
            return None
        return self.in_graphs.ops / self.call.ops if self.call.ops else 1.0

    @property
    def flop_share(self) -> float | None:
        """Share of the counted call's matrix-product FLOPs that ran in rewritten graphs (None: no
        call, or a call without matrix products)."""
        if self.call is None or self.in_graphs is None or not self.call.flops:
            return None
        return self.in_graphs.flops / self.call.flops

    def __str__(self) -> str:
        lines = [*self._share_lines(), self._capture_line()]
        lines += [f"island {name or ROOT}: {why}" for name, why in self.islands.items()]
        return "\n".join(_wrap(line) for line in lines)

    def _share_lines(self) -> list[str]:
        if self.call is None or self.in_graphs is None:
            return [
                "ops and FLOPs in rewritten graphs: not counted; give a call's arguments, "
                "capture_summary(model, *args, **kwargs)"
            ]
        flops = (
            f"{self.flop_share:.0%} of its {self.call.flops:,} matrix-product FLOPs"
            if self.flop_share is not None
            else "no matrix products"
        )
        ops = f"{self.op_share:.0%} of its {self.call.ops:,} ATen ops"
        lines = [f"one call: {ops} and {flops} ran in rewritten graphs"]
        ranked = sorted(self.outside_graphs.items(), key=lambda item: (-item[1].flops, -item[1].ops))
        lines += [
            f"outside, in {where or ROOT}: {work.ops:,} ops, {work.flops:,} FLOPs" for where, work in ranked
        ]
        return lines

    def _capture_line(self) -> str:
        seconds = f"{sum(self.capture_seconds):.2f} s"
        if self.front_end == "fx":
            line = f"torch.fx front end: {self.graphs} graph(s) traced at convert time"
            if self.capture_seconds:
                line += f", {len(self.capture_seconds)} more captured in {seconds}"
        else:
            line = f"torch.export front end: {self.graphs} graph(s) captured in {seconds}"
        return f"{line}; {self.parameter_coverage:.0%} of the parameters ran in rewritten graphs"


def _wrap(line: str) -> str:
    # The first line of each entry starts at the margin, the rest of it is indented under it.
    indent = "  " if line.startswith(("outside", "island")) else ""
    return "\n".join(
        textwrap.wrap(
            line, REPORT_WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False
        )
    )


def capture_summary(model: nn.Module, *args: Any, **kwargs: Any) -> CaptureSummary:
    """What ``model`` (a result of `amp_fx.convert`, either front end) runs in rewritten graphs.

    With arguments, calls ``model(*args, **kwargs)`` once and counts its ATen ops and
    matrix-product FLOPs (mm, addmm, bmm, baddbmm, convolution, attention kernels; linear and
    matmul reach the dispatcher as these), marking those that ran while a rewritten graph was
    executing. The call runs under ``torch.no_grad`` in the model's current train/eval mode, with
    the random number generators restored afterwards: no gradients, no change to the model
    beyond what a forward does (a first call of a new argument structure captures its graph,
    as any call would; the call is then counted once more, without the capture's work). Without
    arguments, it reports what is known without a call.

    >>> class Gated(nn.Module):  # torch.export stops at `if`: an island around a captured Linear
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         h = self.fc(x)
    ...         return h @ h.T if h.sum() > 0 else h.T @ h
    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(Gated(), preset("O2", torch.bfloat16, "cpu"))
    >>> summary = capture_summary(model, torch.randn(8, 8))  # doctest: +ELLIPSIS
    >>> summary.flop_share, summary.parameter_coverage  # fc: 2*8*8*8 FLOPs, the island's: the same
    (0.5, 1.0)
    >>> print(summary)  # doctest: +ELLIPSIS
    one call: ...% of its ... ATen ops and 50% of its 2,048 matrix-product FLOPs ran in rewritten graphs
      outside, in <model>: ... ops, 1,024 FLOPs
    torch.export front end: 1 graph(s) captured in ... s; 100% of the parameters ran in rewritten graphs
      island <model>: ...
    >>> capture_summary(nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    TypeError: capture_summary expects a model returned by amp_fx.convert, got Linear; ...
    """
    summary = _known_summary(model)
    if args or kwargs:
        _count_call(summary, model, args, kwargs)
    return summary


def captured_graphs(model: nn.Module) -> list[torch.fx.GraphModule]:
    """The rewritten graphs of ``model`` (a result of `amp_fx.convert`): the torch.fx front end's
    graph, or those the torch.export front end has captured so far, its children's included, in
    capture order; each can be printed or given to `amp_fx.report`.

    >>> from amp_fx.core.policy import preset
    >>> model = captured_model(nn.Linear(4, 2), preset("O1", torch.bfloat16, "cpu"))
    >>> _ = model(torch.randn(3, 4))
    >>> [type(g).__name__ for g in captured_graphs(model)]
    ['Linear']
    """
    _check_converted(model)
    own = [model] if _is_rewritten_graph(model) else []
    return own + [graph for _, state in capture_states(model) for graph in state.graphs]


def _is_rewritten_graph(module: nn.Module) -> bool:
    return isinstance(module, torch.fx.GraphModule) and POLICY_KEY in module.meta


def _check_converted(model: nn.Module) -> None:
    if _is_rewritten_graph(model) or isinstance(model, CapturedModel):
        return
    raise TypeError(
        f"capture_summary expects a model returned by amp_fx.convert, got {type(model).__name__}; "
        "convert it first: amp_fx.capture_summary(amp_fx.convert(model, opt_level))"
    )


# ---------------------------------------------------------------------------------------------
# What is known without a call
# ---------------------------------------------------------------------------------------------
def _known_summary(model: nn.Module) -> CaptureSummary:
    _check_converted(model)
    fx_root = _is_rewritten_graph(model)
    summary = CaptureSummary(front_end="fx" if fx_root else "export")
    if fx_root:
        summary.graphs = len(_fx_graphs(model))
        summary.islands.update(_fx_islands(model))
    for name, state in capture_states(model):
        summary.graphs += len(state.graphs)
        summary.capture_seconds += state.seconds
        for reason in dict.fromkeys(state.islands.values()):
            summary.islands[name] = reason
    summary.parameter_coverage = _parameter_coverage(model)
    return summary


def _fx_graphs(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """The graph of each mode an fx front-end model keeps (two where its code reads ``self.training``)."""
    other = gm.meta.get(OTHER_MODE_GRAPH_KEY)
    return [gm.graph] if other is None else [gm.graph, other[1]]


def _fx_opaque_nodes(gm: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    for node in (node for graph in _fx_graphs(gm) for node in graph.nodes):
        info = node.meta.get(META_KEY)
        if info is not None and info.rule is Rule.OPAQUE:
            yield node


def _fx_islands(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Name -> reason of each opaque node of an fx graph: the module it runs, or the node."""
    islands = {}
    for node in _fx_opaque_nodes(gm):
        info = node.meta[META_KEY]
        name = node.name
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            name = module.name if isinstance(module, AutocastIsland) else node.target
        islands[name] = info.opaque_reason or info.reason or "opaque"
    return islands


def _fx_graph_parameters(gm: torch.fx.GraphModule) -> list[nn.Parameter]:
    """Parameters an fx graph reads itself: its get_attr nodes and the modules its call_module
    nodes run, opaque ones (islands) left out."""
    found: list[nn.Parameter] = []
    for node in (node for graph in _fx_graphs(gm) for node in graph.nodes):
        info = node.meta.get(META_KEY)
        if info is not None and info.rule is Rule.OPAQUE:
            continue
        if node.op == "get_attr":
            value = _attribute(gm, node.target)
            if isinstance(value, nn.Parameter):
                found.append(value)
        elif node.op == "call_module":
            found += gm.get_submodule(node.target).parameters()
    return found


def _parameter_coverage(model: nn.Module) -> float:
    covered: set[int] = set()
    for graph in captured_graphs(model):
        if graph is model:
            covered.update(id(p) for p in _fx_graph_parameters(graph))
            continue
        for node in graph.graph.nodes:
            if node.op == "get_attr" and isinstance(value := _attribute(graph, node.target), nn.Parameter):
                covered.add(id(value))
    parameters = {id(p): p.numel() for p in model.parameters()}
    total = sum(parameters.values())
    return sum(parameters[key] for key in covered if key in parameters) / total if total else 1.0


def _attribute(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


# ---------------------------------------------------------------------------------------------
# Counting one call
# ---------------------------------------------------------------------------------------------
def _count_call(
    summary: CaptureSummary, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    before = _capture_progress(model)
    counter = _counted_call(model, args, kwargs)
    if _capture_progress(model) != before:
        # The call captured: its ops include the capture's eager checks. Count a call of the
        # graphs (and islands) as they are now.
        summary_now = _known_summary(model)
        summary.graphs, summary.capture_seconds = summary_now.graphs, summary_now.capture_seconds
        summary.islands, summary.parameter_coverage = summary_now.islands, summary_now.parameter_coverage
        counter = _counted_call(model, args, kwargs)
    summary.call, summary.in_graphs, summary.outside_graphs = counter.total, counter.inside, counter.outside


def _capture_progress(model: nn.Module) -> list[tuple[int, int]]:
    return [(len(state.graphs), len(state.islands)) for _, state in capture_states(model)]


def _counted_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _WorkCounter:
    counter = _WorkCounter(_island_names(model))
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.no_grad(), counter.tracking_modules(), counter:
        model(*args, **kwargs)
    return counter


def _island_names(model: nn.Module) -> dict[int, str]:
    """id -> name of each module whose own code runs outside rewritten graphs when called (besides
    every `AutocastIsland`): the torch.export front end's modules (their code runs only where they
    are islands), and the fx graphs' opaque modules (run directly at O0/O3)."""
    names = {id(module): name for name, module in model.named_modules() if isinstance(module, CapturedModel)}
    if _is_rewritten_graph(model):
        for node in _fx_opaque_nodes(model):
            if node.op == "call_module":
                module = model.get_submodule(node.target)
                names[id(module)] = module.name if isinstance(module, AutocastIsland) else node.target
    return names


def _is_real(tree: Any) -> bool:
    # A capture traces with fake tensors: that work is not the call's.
    return not any(
        isinstance(leaf, FakeTensor) or (isinstance(leaf, torch.Tensor) and leaf.device.type == "meta")
        for leaf in pytree.tree_leaves(tree)
    )


class _WorkCounter(TorchDispatchMode):
    """Counts each ATen op and its FLOPs where it runs: inside a rewritten graph, or in the
    innermost island (a module of ``islands``) the call is in."""

    def __init__(self, islands: dict[int, str]) -> None:
        super().__init__()
        self.islands = islands
        # (module, inside a rewritten graph, where) for the graphs and islands being run.
        self.running: list[tuple[nn.Module, bool, str]] = []
        self.total, self.inside = Work(), Work()
        self.outside: dict[str, Work] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_real((args, kwargs, out)):
            formula = _FLOP_FORMULAS.get(getattr(func, "_overloadpacket", func))
            flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
            self._add(flops)
        return out

    def _add(self, flops: int) -> None:
        inside, where = self.running[-1][1:] if self.running else (False, OUTSIDE)
        places = [self.total, self.inside if inside else self.outside.setdefault(where, Work())]
        for work in places:
            work.ops += 1
            work.flops += flops

    def _enter(self, module: nn.Module, args: Any) -> None:
        if _is_rewritten_graph(module):
            self.running.append((module, True, ""))
        elif isinstance(module, AutocastIsland):
            self.running.append((module, False, module.name))
        elif id(module) in self.islands:
            self.running.append((module, False, self.islands[id(module)]))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.running and self.running[-1][0] is module:
            self.running.pop()

    @contextmanager
    def tracking_modules(self) -> Iterator[None]:
        # Global hooks: graphs captured during the call are seen as well.
        enter = torch.nn.modules.module.register_module_forward_pre_hook(self._enter)
        leave = torch.nn.modules.module.register_module_forward_hook(self._leave, always_call=True)
        try:
            with instrument_hooks(enter, leave):
                yield
        finally:
            enter.remove()
            leave.remove()
