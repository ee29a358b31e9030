"""Cutting a converted Sequential's graph at its layers' boundaries: the graphs of its slice.

``gm[1:3]`` of a `amp_fx.capture.traced_graph_module.TracedGraphModule` traced from an
``nn.Sequential`` at a low-precision level runs that part of ``gm``'s graph, casts included
(`sliced_graphs`); a cut next to a layer a pass fused with its neighbour is refused.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from amp_fx.core.node_info import OTHER_MODE_GRAPH_KEY, POLICY_KEY, node_info

__all__ = ["show_slice", "sliced_graphs"]


def sliced_graphs(gm: torch.fx.GraphModule, names: list[str], index: slice) -> dict[bool, torch.fx.Graph]:
    """The graph of each mode of ``gm``, a converted Sequential of the layers ``names``, cut to the
    layers ``names[index]`` (by training mode, the mode of ``gm.graph`` first; empty for an empty
    slice). Raises TypeError where a graph cannot be cut there."""
    selected = list(range(len(names)))[index]
    policy = gm.meta[POLICY_KEY]
    graphs = {gm.training: gm.graph}  # the graph of each mode (one where the modes share it)
    if OTHER_MODE_GRAPH_KEY in gm.meta:
        training, other = gm.meta[OTHER_MODE_GRAPH_KEY]
        graphs = {not training: gm.graph, training: other}
    boundaries = sorted({b for i in selected for b in (i, i + 1) if 0 < b < len(names)}) if selected else []
    if index.step in (None, 1):
        boundaries = [b for b in (selected[0], selected[-1] + 1) if 0 < b < len(names)] if selected else []
    sliced = {}
    for training, graph in graphs.items():
        layers = _Layers(graph, names, gm)
        reason = next((r for b in boundaries if (r := layers.cut_error(b)) is not None), layers.error)
        if reason is not None:
            raise TypeError(
                f"gm[{show_slice(index)}] of this Sequential converted at {policy.opt_level} cannot be "
                f"cut from its graph: {reason}. Slice where no fused layers meet, or convert the slice of "
                f"the FP32 model instead: amp_fx.convert(model[{show_slice(index)}], "
                f"{policy.opt_level!r}, dtype={policy.dtype})"
            )
        if selected:
            sliced[training] = layers.build(selected)
    return sliced


def show_slice(index: slice) -> str:
    """``index`` as written between brackets.

    >>> show_slice(slice(1, None)), show_slice(slice(None, None, 2))
    ('1:', '::2')
    """
    parts = ["" if v is None else str(v) for v in (index.start, index.stop, index.step)]
    return ":".join(parts[:2] if index.step is None else parts)


class _Layers:
    """A converted Sequential's graph cut at its layers' boundaries.

    A node belongs to layer ``i`` by the module it calls or reads (``call_module`` / ``get_attr``
    target) or the module whose call made it (``nn_module_stack``); a node the passes added (a cast)
    belongs where its first user does, so the cast of a layer's input is its consumer's. Glue
    before the graph's output (the model's output cast) is a region of its own, ``n``. ``out[i]``
    is the value layer ``i`` hands on (the previous one's where the layer computes nothing), the
    placeholder before layer 0. Values of parameters only (a weight's cast) are ``constant``: a
    slice recomputes them wherever they are read.
    """

    def __init__(self, graph: torch.fx.Graph, names: list[str], root: nn.Module) -> None:
        from amp_fx.passes.shared.module_regions import module_paths

        modules = dict(root._modules)
        layer_of = {name: i for i, name in enumerate(names)}
        n = len(names)
        self.graph, self.n = graph, n
        nodes = list(graph.nodes)
        placeholders = [node for node in nodes if node.op == "placeholder"]
        self.output = next(node for node in nodes if node.op == "output")
        self.error: str | None = None
        if len(placeholders) != 1 or len(self.output.args) != 1:
            self.error = "its graph does not take one input and return one value"
            return
        self.input = placeholders[0]
        self.constant: set[torch.fx.Node] = set()
        owner: dict[torch.fx.Node, int] = {}
        for node in nodes:
            if node.op == "get_attr" or (
                node.op in ("call_function", "call_method")
                and node.all_input_nodes
                and all(arg in self.constant for arg in node.all_input_nodes)
            ):
                self.constant.add(node)
            heads = [node.target.split(".")[0]] if node.op in ("call_module", "get_attr") else []
            heads += [path.split(".")[0] for path in module_paths(node) if path]
            layer = next((layer_of[head] for head in heads if head in layer_of), None)
            # A call a pass put in place of a layer's ops, with no module of its own, reads its parameters.
            read = {owner[arg] for arg in node.all_input_nodes if arg in self.constant and arg in owner}
            if layer is None and len(read) == 1:
                layer = read.pop()
            if layer is not None:
                owner[node] = layer
        for node in reversed(nodes):  # the passes' nodes join their first user's layer
            if node not in owner and node.op not in ("placeholder", "output"):
                users = [n if user.op == "output" else owner.get(user) for user in node.users]
                users = [user for user in users if user is not None]
                if users:
                    owner[node] = min(users)
        self.regions: list[list[torch.fx.Node]] = [[] for _ in range(n + 1)]
        for node in nodes:
            if node in owner and node not in self.constant:
                self.regions[owner[node]].append(node)
        # What each layer hands on, and a check that each reads nothing else of the layers before it.
        self.out: list[torch.fx.Node] = []
        previous = self.input
        for i, region in enumerate(self.regions):
            inside = set(region)
            read = {a for node in region for a in node.all_input_nodes if a not in inside}
            read -= self.constant
            if read - {previous}:
                self.error = (
                    f"the graph's ops of layer {self._name(names, i)} read values of layers before it other "
                    f"than the previous one's output (layers fused across the boundary)"
                )
                return
            if i == n:
                break
            handed = {node for node in region for user in node.users if user not in inside}
            if len(handed) > 1:
                self.error = f"layer {names[i]} hands on {len(handed)} values, not one"
                return
            previous = next(iter(handed)) if handed else previous
            self.out.append(previous)
        # A torch layer (or one with parameters) whose graph holds nothing was fused into a neighbour.
        self.absorbed = {
            i
            for i, name in enumerate(names)
            if not self.regions[i] and name in modules and _computes(modules[name])
        }
        self.names = names

    @staticmethod
    def _name(names: list[str], i: int) -> str:
        return names[i] if i < len(names) else "(the output's casts)"

    def cut_error(self, boundary: int) -> str | None:
        """Why the graph cannot be cut before layer ``boundary``, or None."""
        if self.error is not None:
            return self.error
        fused = sorted({i for i in (boundary - 1, boundary) if i in self.absorbed})
        if fused:
            return (
                f"layer {self.names[fused[0]]} has no ops of its own in the graph: a pass fused it with a "
                f"neighbour (a norm with its activation), and the cut before layer {self.names[boundary]} "
                f"would split them"
            )
        return None

    def build(self, selected: list[int]) -> torch.fx.Graph:
        """One graph running layers ``selected`` in order, each fed the one before (the input cast
        to the dtype the layer's input has in the model where it was not its neighbour)."""
        from amp_fx.ops.casts import cast_if_floating

        graph = torch.fx.Graph()
        value = graph.placeholder("input")
        constants: dict[torch.fx.Node, torch.fx.Node] = {}

        def copy_constant(node: torch.fx.Node) -> torch.fx.Node:
            if node not in constants:
                constants[node] = graph.node_copy(node, copy_constant)
            return constants[node]

        previous = None
        regions = [*selected, self.n] if selected[-1] == self.n - 1 else selected
        for i in regions:
            boundary = self.out[i - 1] if i > 0 else self.input
            if previous is not None and i != previous + 1 or previous is None and i > 0:
                dtype = node_info(boundary).out_dtype
                if dtype is not None and dtype.is_floating_point:
                    value = graph.call_function(cast_if_floating, (value, dtype))
            env = {boundary: value}

            def lookup(node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node] = env) -> torch.fx.Node:
                return env[node] if node in env else copy_constant(node)

            for node in self.regions[i]:
                env[node] = graph.node_copy(node, lookup)
            if i < self.n:
                value = env.get(self.out[i], value)
            else:
                value = lookup(self.output.args[0])
            previous = i
        graph.output(value)
        graph.lint()
        return graph


def _computes(module: nn.Module) -> bool:
    """A module whose call always leaves an op in a graph: it has parameters or buffers, or is a
    torch.nn layer (which the tracer records as one call; a plain ``nn.Module`` is what stays of a
    layer it traced through)."""
    return (
        any(True for _ in module.parameters())
        or any(True for _ in module.buffers())
        or (type(module) is not nn.Module and type(module).__module__.startswith("torch.nn."))
    )
