"""Pass 8 of convert: cast the model's outputs per ``policy.cast_model_outputs``.

As in Apex, O2/O3 return float32 outputs by default (the loss is then computed in float32);
O0/O1 return outputs as computed. `propagate_dtypes` records, on the output node, the dtype
each returned value must have; this pass inserts the casts, through any nesting of tuples,
lists, dicts and namedtuples (each returned tensor is an input of the output node, or of a
tuple/namedtuple/dict constructor that only builds the return value). Integer
outputs (indices, labels) are never cast; outputs of unknown dtype get `cast_if_floating`.

Example (O2, fp16)::

    before                                    after
    logits = linear(...)       (float16)      logits = linear(...)
    return (logits, idx)                      logits_to_float32 = logits.to(torch.float32)
                                              return (logits_to_float32, idx)
"""

from __future__ import annotations

import logging

import torch.fx

from amp_fx.core.policy import Policy
from amp_fx.passes.shared import CastCache, insert_input_casts, is_output_structure

logger = logging.getLogger(__name__)

__all__ = ["cast_outputs"]


def cast_outputs(gm: torch.fx.GraphModule, policy: Policy) -> torch.fx.GraphModule:
    """Cast returned values to the dtype `propagate_dtypes` recorded on the output node.

    Example::

        >>> gm = cast_outputs(gm, preset("O2", torch.float16, "cpu"))   # doctest: +SKIP
    """
    cache: CastCache = {}
    created = 0
    for node in list(gm.graph.nodes):
        if node.op == "output" or is_output_structure(node):
            created += insert_input_casts(gm, node, cache)
    logger.debug("cast_outputs %s: %d casts to %s", policy.opt_level, created, policy.cast_model_outputs)
    return gm
