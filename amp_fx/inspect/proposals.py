"""`amp_fx.propose_policy(model)`: policy rules that keep a watched model's values in range, read from
the ranges `amp_fx.watch` recorded, each with the number that triggered it and the threshold.

The rules (thresholds below; each rule says which node and number triggered it):

- **Keep in FP32** every op whose value, computed in fp16/bf16, came within ``FP32_HEADROOM_BITS``
  of the dtype's largest finite value or overflowed, while what it read did not overflow (an op fed
  an inf or NaN overflows because of its input, not by itself). The rule names the narrowest part
  of the policy that covers the op: its module (``set_module_name``: a leaf module such as a
  Linear, or the module whose own code computes it, such as an attention's score matmul), else,
  for an op of the model's own ``forward``, the op (``set_op``). For one of amp_fx's casts (a value
  computed in FP32 that the next op reads low) the rule covers the ops that read it.
- **bf16 instead of fp16**, in place of those rules, where the policy is fp16 and they would keep
  more than ``MAX_FP32_RULES`` parts in FP32 (the range is the problem, not an op: bf16 has
  fp32's), or where an fp16 value underflowed in ``UNDERFLOW_SHARE`` of its elements or more.

Values of exactly the dtype's largest magnitude (``finfo(dtype).min`` in attention masks) are
fills, not computed values, and trigger nothing; gradients trigger nothing either (the loss scaler
keeps them in range: `amp_fx.find_overflow` says when they overflow).

    >>> import torch, amp_fx
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> _ = torch.nn.init.constant_(model[0].weight, 1.0)
    >>> gm = amp_fx.convert(model, "O2", device_type="cpu")
    >>> _ = amp_fx.watch(gm)
    >>> _ = gm(torch.full((2, 4), 30000.0))  # 4 x 30000 > 65504 in the first Linear
    >>> proposal = amp_fx.propose_policy(gm)
    >>> print(proposal)  # doctest: +ELLIPSIS
    # amp_fx.propose_policy: 1 rule from the ranges amp_fx.watch recorded
    policy = amp_fx.preset("O2", dtype=torch.float16, device_type="cpu")
    # _0 (linear): values overflowed (amax inf, headroom -inf bits), below 1 bit
    policy.set_module_name("0", "fp32")
    converted = amp_fx.convert(model, policy=policy)
    >>> proposal.policy().decide("linear", module_name="0").rule
    <Rule.FP32: 'fp32'>
"""

from __future__ import annotations

import copy
import dataclasses
import textwrap
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from amp_fx.core.dtypes import dtype_name
from amp_fx.core.node_info import POLICY_KEY, node_info
from amp_fx.core.policy import Policy, Rule
from amp_fx.inspect.graphs import ModelGraph
from amp_fx.inspect.overflow import consumers_of, origin
from amp_fx.inspect.ranges import NodeRange, watching
from amp_fx.inspect.report_text import REPORT_WIDTH
from amp_fx.passes.shared.call_nodes import calling_module

__all__ = [
    "FP32_HEADROOM_BITS",
    "MAX_FP32_RULES",
    "UNDERFLOW_SHARE",
    "PolicyProposal",
    "ProposedRule",
    "propose_policy",
]

# An fp16/bf16 value whose largest magnitude left less than this many doublings before the dtype's
# largest finite value gets an FP32 rule: activations grow as a model trains, and one more doubling
# would overflow.
FP32_HEADROOM_BITS = 1.0
# More FP32 rules than this, for an fp16 policy, give way to bf16 (fp32's range for every op).
MAX_FP32_RULES = 4
# An fp16 value with at least this share of its elements underflowing (non-zero, below fp16's
# smallest normal, 6.1e-05: they keep fewer bits or flush to zero) asks for bf16.
UNDERFLOW_SHARE = 0.2


@dataclass(frozen=True)
class ProposedRule:
    """One rule of a proposal: keep a module or an op in FP32, or run bf16 instead of fp16."""

    # "module" (``set_module_name``), "op" (``set_op``) or "dtype" (bf16 instead of fp16).
    kind: str
    target: str
    # What triggered it: the nodes, the number recorded (headroom in bits, an underflow share or
    # a count of rules) and the threshold it crossed.
    nodes: tuple[str, ...]
    number: float
    threshold: float
    why: str

    def apply(self, policy: Policy) -> Policy:
        """``policy`` with this rule: the same object, changed (a "dtype" rule: a new policy)."""
        if self.kind == "module":
            return policy.set_module_name(self.target, Rule.FP32)
        if self.kind == "op":
            return policy.set_op(self.target, Rule.FP32)
        return dataclasses.replace(policy, dtype=torch.bfloat16)

    def code(self) -> str:
        """The rule as a line of Python acting on ``policy``."""
        if self.kind == "module":
            return f'policy.set_module_name("{self.target}", "fp32")'
        if self.kind == "op":
            return f'policy.set_op("{self.target}", "fp32")'
        return "policy = dataclasses.replace(policy, dtype=torch.bfloat16)  # no loss scaling needed"


@dataclass(frozen=True)
class PolicyProposal:
    """The rules `propose_policy` proposes, on the policy the model was converted with. ``str()``
    is Python to read, edit and run; `policy` applies the rules to a copy of the policy."""

    base: Policy
    rules: tuple[ProposedRule, ...]

    def policy(self) -> Policy:
        """A copy of the base policy with every rule applied: ``amp_fx.convert(model, policy=...)``."""
        policy = copy.deepcopy(self.base)
        for rule in self.rules:
            policy = rule.apply(policy)
        return policy

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __str__(self) -> str:
        base = self.base
        if not self.rules:
            return "# amp_fx.propose_policy: nothing to change, every watched value kept its headroom"
        count = f"{len(self.rules)} rule{'s' if len(self.rules) != 1 else ''}"
        lines = [f"# amp_fx.propose_policy: {count} from the ranges amp_fx.watch recorded"]
        lines.append(
            f'policy = amp_fx.preset("{base.opt_level}", dtype=torch.{dtype_name(base.dtype)}, '
            f'device_type="{base.device_type}")'
            + ("  # and the overrides the model was converted with" if _has_overrides(base) else "")
        )
        for rule in self.rules:
            lines += [f"# {line}" for line in textwrap.wrap(rule.why, REPORT_WIDTH - 2)]
            lines.append(rule.code())
        lines.append("converted = amp_fx.convert(model, policy=policy)")
        return "\n".join(lines)


def propose_policy(model: nn.Module) -> PolicyProposal:
    """Policy rules that keep the watched ``model``'s values in range (the module docstring states
    the rules and their thresholds), from every step recorded so far: the totals and each step kept.
    Reads the device. Raises ValueError for a model `amp_fx.watch` does not watch."""
    watch = watching(model)
    if watch is None:
        raise ValueError(
            f"this {type(model).__name__} is not watched, so no ranges were recorded: call "
            "amp_fx.watch(model), train a few steps (or until it overflows), then propose_policy(model)"
        )
    graphs = watch.graphs()
    if not graphs:
        raise ValueError(
            f"this {type(model).__name__} has run no watched graph yet: call it on a batch first"
        )
    base = next(iter(graphs.values())).gm.meta[POLICY_KEY]
    nodes = watch.watched_nodes()
    # Judged on the totals and on each kept step alone: a step whose forward overflowed poisons
    # the totals of every op after the first, and the steps before it show the others' ranges.
    views = [watch.ranges(), *(watch.ranges(step) for step in watch.steps)]
    found: dict[tuple[str, str], tuple[float, NodeRange]] = {}
    underflows: dict[tuple[str, str], tuple[float, NodeRange]] = {}
    for view in views:
        by_key = {(r.graph, r.node): r for r in view}
        for r in view:
            key = (r.graph, r.node)
            stats = r.forward
            if r.dtype not in (torch.float16, torch.bfloat16) or not stats.recorded or key not in nodes:
                continue
            if _fed_an_overflow(nodes[key], graphs[r.graph], by_key):
                continue
            if stats.headroom < FP32_HEADROOM_BITS and not stats.saturated:
                if key not in found or stats.headroom < found[key][0]:
                    found[key] = (stats.headroom, r)
            if r.dtype == torch.float16 and stats.underflow_share >= UNDERFLOW_SHARE:
                if key not in underflows or stats.underflow_share > underflows[key][0]:
                    underflows[key] = (stats.underflow_share, r)
    rules = _fp32_rules(found, nodes, graphs)
    return PolicyProposal(base, tuple(_bf16_instead(base, rules, underflows)))


def _fed_an_overflow(
    node: torch.fx.Node, graph: ModelGraph, ranges: dict[tuple[str, str], NodeRange]
) -> bool:
    """Whether a value ``node`` computes from overflowed (in the same view of the ranges): the
    nearest watched values upstream, through nodes not watched (a fused op's tuple, an FP32 op)."""
    pending, seen = list(node.all_input_nodes), set()
    while pending:
        source = origin(pending.pop())
        if source in seen:
            continue
        seen.add(source)
        watched = ranges.get((graph.label, source.name))
        if watched is not None and watched.forward.recorded:
            if watched.forward.overflowed:
                return True
        elif source.op not in ("placeholder", "get_attr"):
            pending += source.all_input_nodes
    return False


def _fp32_rules(
    found: dict[tuple[str, str], tuple[float, NodeRange]],
    nodes: dict[tuple[str, str], torch.fx.Node],
    graphs: dict[str, ModelGraph],
) -> list[ProposedRule]:
    """One FP32 rule per module or op covering the nodes found, with the worst number of them."""
    by_target: dict[tuple[str, str], list[tuple[float, NodeRange]]] = {}
    for key, (headroom, r) in found.items():
        for target in _targets(nodes[key], graphs[r.graph].gm):
            by_target.setdefault(target, []).append((headroom, r))
    rules = []
    for (kind, target), entries in by_target.items():
        headroom, worst = min(entries, key=lambda entry: entry[0])
        state = "overflowed" if worst.forward.overflowed else "came close to the largest finite value"
        why = (
            f"{worst.node} ({worst.op}): values {state} (amax {worst.forward.amax:.3g}, headroom "
            f"{headroom:.1f} bits), below {FP32_HEADROOM_BITS:g} bit"
        )
        if len(entries) > 1:
            why += f"; also {', '.join(r.node for _, r in entries if r is not worst)}"
        nodes_named = tuple(dict.fromkeys(r.node for _, r in entries))
        rules.append(ProposedRule(kind, target, nodes_named, headroom, FP32_HEADROOM_BITS, why))
    return rules


def _targets(node: torch.fx.Node, gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(kind, name) of the narrowest policy entry that keeps ``node`` in FP32: its module, else its
    op; for amp_fx's cast of an FP32 value, those of the ops reading it."""
    if node_info(node).is_cast:
        return [target for reader in consumers_of(node) for target in _targets(reader, gm)]
    module, _ = calling_module(node, gm)
    if module:
        return [("module", module)]
    return [("op", node_info(node).op or str(node.target))]


def _bf16_instead(
    base: Policy,
    rules: list[ProposedRule],
    underflows: dict[tuple[str, str], tuple[float, NodeRange]],
) -> list[ProposedRule]:
    if base.dtype != torch.float16:
        return rules
    if len(rules) > MAX_FP32_RULES:
        why = (
            f"{len(rules)} parts would stay FP32, more than {MAX_FP32_RULES}: bf16 has float32's range "
            "(at 8 bits of mantissa instead of 11)"
        )
        nodes = tuple(node for rule in rules for node in rule.nodes)
        return [ProposedRule("dtype", "bfloat16", nodes, len(rules), MAX_FP32_RULES, why)]
    if underflows:
        share, worst = max(underflows.values(), key=lambda entry: entry[0])
        why = (
            f"{worst.node} ({worst.op}): {100 * share:.0f}% of its values underflowed fp16, at least "
            f"{100 * UNDERFLOW_SHARE:.0f}%: bf16 keeps them normal"
        )
        nodes = tuple(r.node for _, r in underflows.values())
        return [ProposedRule("dtype", "bfloat16", nodes, share, UNDERFLOW_SHARE, why)]
    return rules


def _has_overrides(policy: Policy) -> bool:
    return bool(
        policy.op_overrides
        or policy.module_type_overrides
        or policy.module_name_regex_overrides
        or policy.module_name_overrides
    )
