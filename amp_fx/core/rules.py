"""The vocabulary of a policy's answers: a `Rule` per op call, and the `Decision` that carries it.

>>> Rule("fp32") is Rule.FP32, Decision(Rule.FP32, "softmax is unstable", None).rule.value
(True, 'fp32')
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["Decision", "OpRule", "Rule"]


class Rule(str, enum.Enum):
    """How an op's floating inputs are cast before it runs."""

    # Cast floating inputs to the policy's low dtype (fp16/bf16).
    LOWER = "lower"
    # Cast floating inputs to float32.
    FP32 = "fp32"
    # Cast floating inputs to the widest floating input dtype, like autocast's promote.
    PROMOTE = "promote"
    # Dtype-agnostic: run on whatever flows in, no casts.
    PASSTHROUGH = "passthrough"
    # Untraced module/function; where the opt level says so (`OptLevel.autocast_opaque`) it runs
    # inside a torch.autocast island of the policy's dtype.
    OPAQUE = "opaque"


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one op call.

    ``param_dtype`` is the storage dtype for the calling module's own parameters and floating
    buffers; None leaves them as they are (levels that keep weights FP32, and calls that are not
    modules' own).
    """

    rule: Rule
    reason: str
    param_dtype: torch.dtype | None


@dataclass(frozen=True)
class OpRule:
    """A preset's op-level entry: the rule and where it comes from."""

    rule: Rule
    reason: str
