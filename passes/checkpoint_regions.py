"""After the rewrite, for graphs of the torch.export front end: checkpointed layers run checkpointed.

A layer with activation checkpointing on (Hugging Face's ``gradient_checkpointing_enable``) runs
its forward through ``torch.utils.checkpoint`` eagerly: its activations are recomputed in the
backward instead of kept. A capture records the layer's ops inline (the capture runs with
checkpointing off, so torch.export never traces the checkpoint machinery), so this pass puts it
back: the ops each checkpointed module computed (``nn_module_stack``) are cut out into a
submodule, called through the module's own checkpoint function
(`amp_fx.ops.checkpoint.CheckpointedRegion`).

Example (a layer ``layers.0`` checkpointed)::

    before                                   after
    x_to_bf16 = to(x, bfloat16)              fused_0 = fused_0(x, w0, w1)   # CheckpointedRegion
    linear = linear(x_to_bf16, w0)           out = add(fused_0, x)
    relu = relu(linear)
    linear_1 = linear(relu, w1)
    out = add(linear_1, x)

Each region is a maximal run of consecutive nodes (in the graph's order, which is topological) that
belong to one checkpointed module; nodes the passes added (casts) belong where their users do. A
run of consecutive nodes is convex, so cutting it out keeps the graph acyclic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from amp_fx.ops.checkpoint import CheckpointedRegion

__all__ = ["checkpoint_regions"]

_PREFIX = "checkpointed_"


def _module_paths(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values()]


def _region_keys(gm: torch.fx.GraphModule, checkpointed: set[str]) -> dict[torch.fx.Node, str | None]:
    """The checkpointed module each computing node belongs to (None: outside every one)."""
    keys: dict[torch.fx.Node, str | None] = {}
    for node in reversed(gm.graph.nodes):  # users first: a node the passes added joins its users
        if node.op not in ("call_function", "call_method", "call_module"):
            keys[node] = None
            continue
        paths = _module_paths(node)
        if paths:
            keys[node] = next((path for path in paths if path in checkpointed), None)
        else:
            users = {keys.get(user) for user in node.users}
            keys[node] = users.pop() if len(users) == 1 else None
    return keys


def checkpoint_regions(
    gm: torch.fx.GraphModule, checkpoints: dict[str, Callable[..., Any]]
) -> torch.fx.GraphModule:
    """Run the ops of each module named in ``checkpoints`` (qualified name -> its checkpoint
    function, called as ``fn(module, *args)``) through that function; see the module docstring.

    >>> from functools import partial
    >>> from torch.utils.checkpoint import checkpoint
    >>> from amp_fx.passes.export import export_graph
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> gm = export_graph(model, (torch.randn(3, 4),), {})
    >>> gm = checkpoint_regions(gm, {"1": partial(checkpoint, use_reentrant=False)})
    >>> [type(m).__name__ for m in gm.children() if isinstance(m, CheckpointedRegion)]
    ['CheckpointedRegion']
    """
    if not checkpoints:
        return gm
    keys = _region_keys(gm, set(checkpoints))
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
        return gm
    before = {name for name, _ in gm.named_children()}
    gm = fuse_by_partitions(gm, [nodes for _, nodes in runs], prefix=_PREFIX)
    fused = [name for name, _ in gm.named_children() if name not in before and name.startswith(_PREFIX)]
    for name in fused:
        index = int(name[len(_PREFIX) :])
        setattr(gm, name, CheckpointedRegion(getattr(gm, name), checkpoints[runs[index][0]]))
    gm.recompile()
    return gm
