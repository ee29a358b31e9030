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

Each region is a maximal run of consecutive nodes that belong to one checkpointed module
(`amp_fx.passes.shared.module_regions`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx

from amp_fx.ops.checkpoint import CheckpointedRegion
from amp_fx.passes.shared.module_regions import cut_module_regions

__all__ = ["checkpoint_regions"]

_PREFIX = "checkpointed_"


def checkpoint_regions(
    gm: torch.fx.GraphModule, checkpoints: dict[str, Callable[..., Any]]
) -> torch.fx.GraphModule:
    """Run the ops of each module named in ``checkpoints`` (qualified name -> its checkpoint
    function, called as ``fn(module, *args)``) through that function; see the module docstring.

    >>> from functools import partial
    >>> from torch.utils.checkpoint import checkpoint
    >>> from amp_fx.capture.export import export_graph
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> gm = export_graph(model, (torch.randn(3, 4),), {})
    >>> gm = checkpoint_regions(gm, {"1": partial(checkpoint, use_reentrant=False)})
    >>> [type(m).__name__ for m in gm.children() if isinstance(m, CheckpointedRegion)]
    ['CheckpointedRegion']
    """
    if not checkpoints:
        return gm
    for name, path in cut_module_regions(gm, set(checkpoints), _PREFIX):
        setattr(gm, name, CheckpointedRegion(getattr(gm, name), checkpoints[path]))
    gm.recompile()
    return gm
