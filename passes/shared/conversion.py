"""What every convert pass reads besides the graph: one `Conversion` per rewrite of a graph.

The front ends build it (`amp_fx.convert` for torch.fx, `amp_fx.capture.captured_model` for
torch.export) from the policy, the example inputs and what they know of the graph they captured;
the pipeline (`amp_fx.pipeline.rewrite_graph`) adds the parameter plan once it can be made (after
`classify`, `amp_fx.passes.shared.decisions.plan_parameters`) and hands the one context to every
pass. Each pass takes ``(gm, context)`` and returns torch.fx's `PassResult` (the graph module, and
whether the pass modified it), as torch.fx's own pass infrastructure does.

    >>> from amp_fx.core.policy import preset
    >>> context = Conversion(preset("O2", torch.bfloat16, "cpu"))
    >>> context.policy.opt_level, context.example_inputs, context.training
    ('O2', None, None)
    >>> context.parameter_plan
    Traceback (most recent call last):
    ...
    RuntimeError: the conversion has no parameter plan yet: ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.infra.pass_base import PassResult

from amp_fx.core.policy import Policy

__all__ = ["Conversion", "PassResult"]


@dataclass(frozen=True)
class Conversion:
    """The policy, the example inputs, the front end's facts about the graph and the parameter plan
    of one rewrite; made before the first pass, never changed by a pass."""

    policy: Policy
    # The values of the graph's placeholders, in order (`propagate_dtypes` then runs on fake
    # tensors of them and is exact); None: the static dtype rules.
    example_inputs: tuple[Any, ...] | None = None
    # Indices of the graph's flat outputs that keep the dtype they are computed in (a KV cache's
    # tensors, a container's state after the call), not cast per ``cast_model_outputs``
    # (torch.export front end, `amp_fx.capture.export.kept_dtypes`).
    keep_output_dtype: frozenset[int] = frozenset()
    # Indices of the graph's placeholders that its users see in their own dtype (a KV cache's
    # tensors passed back in), not cast at the model entry (O2/O3): state the model itself left there.
    keep_input_dtype: frozenset[int] = frozenset()
    # Qualified names of the parameters not stored yet (left FP32 at convert, see
    # `amp_fx.capture.storage`): the passes store those the graph reads and leave every other
    # parameter as it is. None: every parameter is planned (torch.fx front end).
    unstored_parameters: frozenset[str] | None = None
    # Every parameter is stored in its dtype already (a converted graph converted again): the
    # passes leave them as they are.
    parameters_stored: bool = False
    # The ``module.training`` the graph was captured in (torch.export front end); None where the
    # graph serves either mode (torch.fx).
    training: bool | None = None
    # Qualified name -> storage dtype of the parameters `cast_parameters` casts; made once by
    # `amp_fx.passes.shared.decisions.plan_parameters` (the pipeline, after `classify`).
    planned: dict[str, torch.dtype] | None = None

    @property
    def parameter_plan(self) -> dict[str, torch.dtype]:
        """The parameter plan; an error where it is not made yet."""
        if self.planned is None:
            raise RuntimeError(
                "the conversion has no parameter plan yet: make it with "
                "amp_fx.passes.shared.decisions.plan_parameters(gm, context) after classify, as "
                "amp_fx.pipeline.rewrite_graph does"
            )
        return self.planned
