"""A convert pass: cast the model's outputs per ``policy.cast_model_outputs``.

As in Apex, O2/O3 return float32 outputs by default (the loss is then computed in float32);
O0/O1 return outputs as computed. `propagate_dtypes` records, on the output node, the dtype
each returned value must have; this pass inserts the casts, through any nesting of tuples,
lists, dicts and namedtuples (each returned tensor is an input of the output node, or of a
tuple/namedtuple/dict constructor that only builds the return value). Integer
outputs (indices, labels) are never cast; outputs of unknown dtype get `cast_if_floating`.

A returned value the graph already copies to the wanted dtype is returned as that copy, not
copied again: a Hugging Face causal LM computes its loss on ``logits.float()`` and returns
``logits``, and a second float32 copy of the logits is the largest tensor of its step (3.3 GB
for GPT-2 at 16 x 1024). The copy is reused only when it is a plain dtype conversion and
neither it nor its source is updated in place.

Example (O2, fp16)::

    before                                    after
    logits = linear(...)       (float16)      logits = linear(...)
    return (logits, idx)                      logits_to_float32 = logits.to(torch.float32)
                                              return (logits_to_float32, idx)
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.core.op_facts import FLOATING_CONVERSION_METHODS
from amp_fx.passes.shared.casts import CastCache, insert_input_casts, is_output_structure
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.in_place_updates import updates_in_place

logger = logging.getLogger(__name__)

__all__ = ["cast_outputs"]

aten = torch.ops.aten


def _plain_conversion_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The value `node` copies when it only converts its dtype (no device, layout or memory-format
    change, no extra arguments); the dtype is the one `propagate_dtypes` recorded."""
    args, kwargs = node.args, node.kwargs
    if not args or not isinstance(args[0], torch.fx.Node):
        return None
    if (
        node.op == "call_method"
        and node.target in FLOATING_CONVERSION_METHODS
        and len(args) == 1
        and not kwargs
    ):
        return args[0]
    converts = (node.op == "call_method" and node.target == "to") or node.target is aten.to.dtype
    if converts and len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        return args[0]
    if node.target is aten._to_copy.default and len(args) == 1 and set(kwargs) == {"dtype"}:
        return args[0]
    return None


def _existing_copies(gm: torch.fx.GraphModule, returned: set[torch.fx.Node]) -> CastCache:
    """The graph's copies of a ``returned`` value to another dtype, by (value, dtype): the first of each."""
    copies: CastCache = {}
    for node in gm.graph.nodes:
        source = _plain_conversion_source(node)
        if source not in returned:
            continue
        dtype = node_info(node).out_dtype
        if dtype is None or node_info(source).out_dtype in (None, dtype):
            continue  # not known to be a copy
        if (source, dtype) not in copies and not updates_in_place(node) and not updates_in_place(source):
            copies[(source, dtype)] = node
    return copies


def cast_outputs(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Cast returned values to the dtype `propagate_dtypes` recorded on the output node.

    Example::

        >>> from amp_fx.core.policy import preset
        >>> from amp_fx.passes.classify import classify
        >>> from amp_fx.passes.normalize_ops import normalize_ops
        >>> from amp_fx.passes.propagate_dtypes import propagate_dtypes
        >>> from amp_fx.passes.shared.decisions import plan_parameters
        >>> from amp_fx.capture.fx import trace
        >>> context = Conversion(preset("O2", torch.float16, "cpu"))
        >>> gm = classify(normalize_ops(trace(torch.nn.Linear(4, 2))).graph_module, context).graph_module
        >>> context = plan_parameters(gm, context)
        >>> gm = propagate_dtypes(gm, context).graph_module
        >>> [n.name for n in cast_outputs(gm, context).graph_module.graph.nodes if node_info(n).is_cast]
        ['linear_to_float32']
    """
    policy = context.policy
    readers = [node for node in gm.graph.nodes if node.op == "output" or is_output_structure(node)]
    cache = _existing_copies(gm, {value for reader in readers for value in reader.all_input_nodes})
    created = 0
    for node in readers:
        created += insert_input_casts(gm, node, cache)
    logger.debug("cast_outputs %s: %d casts to %s", policy.opt_level, created, policy.cast_model_outputs)
    return PassResult(gm, created > 0)
