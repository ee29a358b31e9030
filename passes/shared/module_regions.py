"""Cutting the ops one module computed out of a captured graph into a submodule of their own.

A graph of the torch.export front end inlines every module the captured call ran; its nodes keep
the module they came from (``node.meta["nn_module_stack"]``). `cut_module_regions` cuts the ops of
chosen modules out, each call of one into a submodule the graph then calls (`checkpoint_regions`
calls them through a checkpoint function, `shard_regions` through the module itself, so that
FSDP2's hooks run).

A region is a maximal run of consecutive nodes (in the graph's order, which is topological) that
belong to one chosen module; nodes the passes added (casts) belong where their users do, and are
moved to just before their first user: a cast placed after its input, with other ops between it
and its user (a head fused with its loss, which comes later), would otherwise be a run, and a
call of the module, of its own. A run of consecutive nodes is convex, so cutting it out keeps
the graph acyclic.

>>> from amp_fx.capture.export import export_graph
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> gm = export_graph(model, (torch.randn(3, 4),), {})
>>> [(name, path) for name, path in cut_module_regions(gm, {"1"}, "cut_")]
[('cut_0', '1')]
"""

from __future__ import annotations

import torch.fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from amp_fx.passes.shared.call_nodes import is_inplace_call

__all__ = ["module_paths", "cut_module_regions"]

_COMPUTING = ("call_function", "call_method", "call_module")


def module_paths(node: torch.fx.Node) -> list[str]:
    """Qualified names of the modules whose call made ``node``, outermost first (the captured
    module itself is ``""``); empty for a node the passes added."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


def _region_keys(
    gm: torch.fx.GraphModule, modules: set[str], with_reads: bool
) -> dict[torch.fx.Node, str | None]:
    """The chosen module each node belongs to (None: outside every one), the outermost where
    chosen modules nest. ``with_reads``: attribute reads join their users' region too."""
    computing = (*_COMPUTING, "get_attr") if with_reads else _COMPUTING
    keys: dict[torch.fx.Node, str | None] = {}
    for node in reversed(gm.graph.nodes):  # users first: a node the passes added joins its users
        if node.op not in computing:
            keys[node] = None
            continue
        paths = module_paths(node)
        if paths:
            keys[node] = next((path for path in paths if path in modules), None)
        else:
            users = {keys.get(user) for user in node.users}
            keys[node] = users.pop() if len(users) == 1 else None
    return keys


def _sink_to_users(gm: torch.fx.GraphModule, keys: dict[torch.fx.Node, str | None]) -> None:
    """Move each node the passes added that joined a region to right before its first user."""
    position = {node: float(index) for index, node in enumerate(gm.graph.nodes)}
    for node in reversed(list(gm.graph.nodes)):  # users first: a chain of added nodes moves as one
        if keys[node] is None or module_paths(node) or node.op == "get_attr" or is_inplace_call(node):
            continue
        first = min(node.users, key=position.__getitem__)
        if first.prev is node:
            continue
        position[node] = (position[first.prev] + position[first]) / 2
        first.prepend(node)


def _read_once_per_user(gm: torch.fx.GraphModule) -> None:
    # Each user gets its own read, placed right before it, so the read joins the user's run.
    for node in list(gm.graph.find_nodes(op="get_attr")):
        for user in list(node.users):
            with gm.graph.inserting_before(user):
                read = gm.graph.get_attr(node.target)
            read.meta.update(node.meta)
            user.replace_input_with(node, read)
        gm.graph.erase_node(node)


def cut_module_regions(
    gm: torch.fx.GraphModule, modules: set[str], prefix: str, *, with_reads: bool = False
) -> list[tuple[str, str]]:
    """Cut each call of a module named in ``modules`` out of ``gm`` (in place) into a submodule
    named ``prefix`` + a number; returns (submodule name, module name) of each, in graph order.

    ``with_reads``: the parameters and buffers a region reads are read inside it (not passed in),
    so that a module's call is what makes them available."""
    if with_reads:
        _read_once_per_user(gm)
    keys = _region_keys(gm, modules, with_reads)
    _sink_to_users(gm, keys)
    runs: list[tuple[str, dict[torch.fx.Node, int | None]]] = []
    previous: str | None = None
    for node in gm.graph.nodes:
        key = keys[node]
        if key is not None and node.op != "output":
            if key != previous:
                runs.append((key, {}))
            runs[-1][1][node] = None
        previous = key
    if not runs:
        return []
    fuse_by_partitions(gm, [nodes for _, nodes in runs], prefix=prefix)
    return [(f"{prefix}{index}", key) for index, (key, _) in enumerate(runs)]
