"""The convert passes in order, on a captured graph: one pipeline for every front end.

`amp_fx.convert` captures a model with `amp_fx.capture.fx` (torch.fx) or, call by call, with
`amp_fx.capture.export` (torch.export); both hand their GraphModule to `rewrite_graph`, which runs
`PASSES`. That tuple is the one place the order is written: docstrings and docs/DESIGN.md name
passes, never their positions. The front end builds the conversion's context
(`amp_fx.passes.shared.conversion.Conversion`: policy, example inputs, its facts about the graph);
the pipeline adds the parameter plan and hands the one context to every pass.

    >>> [step.name for step in PASSES][:4]
    ['drop_empty_concats', 'simplify_attention', 'normalize_ops', 'classify']
    >>> from amp_fx.core.policy import preset
    >>> from amp_fx.capture.fx import trace
    >>> gm = rewrite_graph(trace(torch.nn.Linear(4, 2)), Conversion(preset("O1", torch.bfloat16, "cpu")))
    >>> gm(torch.randn(3, 4)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import torch
import torch.fx

from amp_fx.core.fusions import FUSIONS, Fusion
from amp_fx.core.node_info import ORIGINAL_CODE_KEY, POLICY_KEY
from amp_fx.passes.cast_outputs import cast_outputs
from amp_fx.passes.cast_parameters import cast_parameters
from amp_fx.passes.classify import classify
from amp_fx.passes.drop_empty_concats import drop_empty_concats
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.propagate_dtypes import propagate_dtypes
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.decisions import plan_parameters
from amp_fx.passes.simplify_attention import simplify_attention
from amp_fx.passes.simplify_casts import simplify_casts
from amp_fx.passes.use_fp8_linears import use_fp8_linears

__all__ = ["Pass", "PASSES", "ORIGINAL_CODE_AFTER", "PARAMETER_PLAN_AFTER", "rewrite_graph"]


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass of the pipeline: its function, called with the graph and the conversion's context."""

    run: Callable[[torch.fx.GraphModule, Conversion], PassResult]

    @property
    def name(self) -> str:
        return self.run.__name__

    def __call__(self, gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
        return self.run(gm, context)


def _fusion_pass(fusion: Fusion) -> Pass:
    """The pass of a row of `amp_fx.core.fusions`: the function of module ``amp_fx.passes.<name>``."""
    module = importlib.import_module(f"amp_fx.passes.{fusion.pass_name}")
    return Pass(getattr(module, fusion.pass_name))


# The passes after capture, in the order they run; the fused kernels' passes last, in the order of
# their table (`amp_fx.core.fusions.FUSIONS`). Each pass's module docstring is its specification.
PASSES: tuple[Pass, ...] = (
    Pass(drop_empty_concats),
    Pass(simplify_attention),
    Pass(normalize_ops),
    Pass(classify),
    Pass(propagate_dtypes),
    Pass(insert_casts),
    Pass(cast_parameters),
    Pass(simplify_casts),
    Pass(cast_outputs),
    Pass(use_fp8_linears),
    *(_fusion_pass(fusion) for fusion in FUSIONS),
)

# `amp_fx.report` shows the graph's code after this pass as the model's code before amp_fx's casts:
# every call has its canonical op name and no pass has decided a dtype yet.
ORIGINAL_CODE_AFTER = "normalize_ops"
# The parameter plan (`amp_fx.passes.shared.decisions.plan_parameters`) is made after this pass:
# every call has its op name and rule, and no pass has inserted a cast or stored a parameter yet.
PARAMETER_PLAN_AFTER = "classify"


def rewrite_graph(gm: torch.fx.GraphModule, context: Conversion) -> torch.fx.GraphModule:
    """Run `PASSES` on ``gm`` in place, then lint and recompile it; returns ``gm``.

    ``context`` is the front end's (its ``example_inputs`` are the values of ``gm``'s placeholders,
    in order: dtype propagation then runs on fake tensors of them and is exact); the pipeline adds
    its parameter plan after `PARAMETER_PLAN_AFTER`. The policy and the graph's code before any cast
    are kept in ``gm.meta`` for `amp_fx.report`.
    """
    original_code = gm.code
    for step in PASSES:
        gm = step(gm, context).graph_module
        if step.name == ORIGINAL_CODE_AFTER:
            original_code = gm.code
        if step.name == PARAMETER_PLAN_AFTER:
            context = plan_parameters(gm, context)
    gm.graph.lint()
    gm.recompile()
    gm.meta[POLICY_KEY] = context.policy
    gm.meta[ORIGINAL_CODE_KEY] = original_code
    return gm
