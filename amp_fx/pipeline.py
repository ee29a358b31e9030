"""The convert passes in order, on a captured graph: one pipeline for every front end.

`amp_fx.convert` captures a model with `amp_fx.passes.trace` (torch.fx) or, call by call, with
`amp_fx.passes.export` (torch.export); both hand their GraphModule to `rewrite_graph`.

    >>> from amp_fx.core.policy import preset
    >>> from amp_fx.passes.trace import trace
    >>> gm = rewrite_graph(trace(torch.nn.Linear(4, 2)), preset("O1", torch.bfloat16, "cpu"))
    >>> gm(torch.randn(3, 4)).dtype
    torch.bfloat16
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from amp_fx.core.node_info import ORIGINAL_CODE_KEY, POLICY_KEY
from amp_fx.core.policy import Policy
from amp_fx.passes.cast_outputs import cast_outputs
from amp_fx.passes.cast_parameters import cast_parameters
from amp_fx.passes.classify import classify
from amp_fx.passes.fuse_batch_norm import fuse_batch_norm
from amp_fx.passes.fuse_linear_loss import fuse_linear_loss
from amp_fx.passes.fuse_losses import fuse_losses
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.propagate_dtypes import propagate_dtypes
from amp_fx.passes.replace_max_pool import replace_max_pool
from amp_fx.passes.simplify_attention import simplify_attention
from amp_fx.passes.simplify_casts import simplify_casts

__all__ = ["rewrite_graph"]


def rewrite_graph(
    gm: torch.fx.GraphModule, policy: Policy, example_inputs: tuple[Any, ...] | None = None
) -> torch.fx.GraphModule:
    """Run the passes after capture on ``gm`` in place and return it: simplify_attention
    -> normalize_ops -> classify ->
    propagate_dtypes -> insert_casts -> cast_parameters -> simplify_casts -> cast_outputs ->
    fuse_losses -> fuse_linear_loss -> fuse_batch_norm -> replace_max_pool, then lint and recompile.

    ``example_inputs`` are the values of ``gm``'s placeholders, in order (dtype propagation then
    runs on fake tensors of them and is exact). The policy and the graph's code before any cast
    are kept in ``gm.meta`` for `amp_fx.report`.
    """
    simplify_attention(gm)
    normalize_ops(gm)
    original_code = gm.code
    classify(gm, policy)
    propagate_dtypes(gm, policy, example_inputs)
    insert_casts(gm, policy)
    cast_parameters(gm, policy)
    simplify_casts(gm, policy)
    cast_outputs(gm, policy)
    fuse_losses(gm, policy)
    fuse_linear_loss(gm, policy)
    fuse_batch_norm(gm, policy)
    replace_max_pool(gm, policy)
    gm.graph.lint()
    gm.recompile()
    gm.meta[POLICY_KEY] = policy
    gm.meta[ORIGINAL_CODE_KEY] = original_code
    return gm
