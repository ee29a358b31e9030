"""`amp_fx.report(model)`: what convert decided for every node of a converted model's graphs (either
front end), and why, as a table and as data.

    >>> import torch, amp_fx
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Softmax(-1))
    >>> gm = amp_fx.convert(model, "O2", device_type="cpu")
    >>> rep = amp_fx.report(gm)
    >>> rep.casts_inserted, dict(rep.rule_counts)
    (1, {'lower': 1, 'passthrough': 1, 'fp32': 1})
    >>> print(rep)
    amp_fx report: O2, torch.float16, cpu
    node                op               rule         in                out   reason
    input_1             -                -            -                 fp32  input
    input_1_to_float16  to               cast         fp32              fp16  LOWER linear: input cast
                                                                              to float16
    _0                  linear           lower        fp16              fp16  O2: linear is on
                                                                              autocast's
                                                                              lower_precision_fp list
    _1_weight           -                -            -                 fp32
    _1_bias             -                -            -                 fp32
    layer_norm_fp32     layer_norm_fp32  passthrough  fp16, fp32, fp32  fp32  O2: fused norm, reads its
                                                                              inputs as they are and
                                                                              computes in FP32
    _2                  softmax          fp32         fp32              fp32  O2 FP32 island: softmax is
                                                                              unstable in low precision
                                                                              (exp overflows fp16; the
                                                                              normalizing sum loses
                                                                              bits)
    <BLANKLINE>
    3 ops, 1 casts inserted
    ops per rule: fp32 1 (softmax×1), lower 1 (linear×1), passthrough 1 (layer_norm_fp32×1)
    parameters and buffers: fp16 2 tensors (72 elements), fp32 2 tensors (16 elements)
    stayed FP32:
      _2 (softmax): O2 FP32 island: softmax is unstable in low precision (exp overflows fp16; the
        normalizing sum loses bits)
    >>> print(rep.diff())
    --- traced
    +++ converted
    ...
    -    _0 = getattr(self, "0")(input_1);  input_1 = None
    -    _1 = getattr(self, "1")(_0);  _0 = None
    -    _2 = getattr(self, "2")(_1);  _1 = None
    +    input_1_to_float16 = amp_fx_ops_casts_cast_if_floating(input_1, torch.float16);  input_1 = None
    +    _0 = getattr(self, "0")(input_1_to_float16);  input_1_to_float16 = None
    ...

The report reads only ``node.meta["amp_fx"]`` (`amp_fx.core.node_info.NodeInfo`, written by the passes),
the converted module's parameters, and ``gm.meta`` (the policy and the traced code before casts).
Its rows are `amp_fx.inspect.report_rows`'s, its layout as text `amp_fx.inspect.report_text`'s.
"""

from __future__ import annotations

import difflib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from amp_fx.capture.captured_model import capture_states
from amp_fx.core.dtypes import short_dtype_name
from amp_fx.core.node_info import META_KEY, ORIGINAL_CODE_KEY, POLICY_KEY, NodeInfo
from amp_fx.inspect.dot import write_dot
from amp_fx.inspect.graphs import labelled_graphs
from amp_fx.inspect.ranges import NodeRange, is_range_record
from amp_fx.inspect.report_ranges import format_ranges, recorded_ranges
from amp_fx.inspect.report_rows import InputCast, NodeRow, ParameterRow, _dtype_str
from amp_fx.inspect.report_text import REPORT_WIDTH, format_summary, format_table

__all__ = ["REPORT_WIDTH", "InputCast", "NodeRow", "Report", "report"]


@dataclass
class Report:
    """The decisions recorded on a converted model's graphs; `report(model)` builds it.

    ``str(report)`` is an aligned table (a line per node, long cells continued on the lines below;
    for several graphs, each under a ``[label]`` line) followed by a summary, no line wider than
    REPORT_WIDTH; `diff` is the code before and after the casts; `write_dot` draws the graphs;
    `to_dict` is the same content as plain data for tools.
    """

    rows: list[NodeRow]
    parameters: list[ParameterRow]
    code: str
    original_code: str | None = None
    policy: Any = None
    _header: str = field(default="", repr=False)
    # Label -> graph reported ("" for the one graph of a torch.fx front-end model).
    graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict, repr=False)
    # Module (qualified name, "" for the model) -> why it runs in an autocast island.
    islands: dict[str, str] = field(default_factory=dict)
    # What `amp_fx.watch` recorded per node (totals), where the model is watched.
    ranges: list[NodeRange] = field(default_factory=list, repr=False)

    # --- counts -------------------------------------------------------------------------------
    @property
    def casts(self) -> list[NodeRow]:
        """The casts amp_fx inserted (at op inputs, the model entry and its outputs)."""
        return [r for r in self.rows if r.is_cast]

    @property
    def casts_inserted(self) -> int:
        return len(self.casts)

    @property
    def ops(self) -> list[NodeRow]:
        """The model's own operations: call nodes that are not amp_fx's casts."""
        return [r for r in self.rows if r.kind.startswith("call_") and not r.is_cast]

    @property
    def rule_counts(self) -> Counter[str]:
        """Number of ops (casts excluded) per rule value, e.g. ``{"lower": 4, "fp32": 1}``."""
        return Counter(r.rule or "unclassified" for r in self.ops)

    @property
    def ops_by_rule(self) -> dict[str, Counter[str]]:
        """For each rule, how many times each canonical op got it: ``{"lower": {"linear": 2}}``."""
        table: dict[str, Counter[str]] = {}
        for r in self.ops:
            table.setdefault(r.rule or "unclassified", Counter())[r.op or r.target] += 1
        return table

    @property
    def params_by_dtype(self) -> dict[torch.dtype, tuple[int, int]]:
        """Storage dtype -> (tensors, elements), over parameters and floating buffers."""
        table: dict[torch.dtype, list[int]] = {}
        for p in self.parameters:
            counts = table.setdefault(p.dtype, [0, 0])
            counts[0] += 1
            counts[1] += p.numel
        return {dtype: (n, numel) for dtype, (n, numel) in table.items()}

    @property
    def input_casts(self) -> list[InputCast]:
        """Per floating model input: where amp_fx cast it (at the entry, or where the first op
        that runs low reads it or a value computed from it) and why; inputs it never casts too.

            >>> import torch, amp_fx
            >>> class Standardise(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.fc = torch.nn.Linear(4, 2)
            ...     def forward(self, x):
            ...         return self.fc(x - x.mean(-1, keepdim=True))
            >>> rep = amp_fx.report(amp_fx.convert(Standardise(), "O2", device_type="cpu"))
            >>> cast = rep.input_casts[0]
            >>> cast.name, cast.read_as_is_by, cast.casts, cast.consumers
            ('x', ('mean', 'sub'), ('sub_to_float16',), ('fc',))
            >>> print(cast.reason.split("; ")[1])
            cast to fp16 where fc (linear) reads it
        """
        return [cast for label, gm in self.graphs.items() for cast in _input_casts(gm, label)]

    @property
    def fp32_ops(self) -> list[NodeRow]:
        """Ops the policy keeps in FP32 (rule FP32), with the reason each one stayed there."""
        return [r for r in self.ops if r.rule == "fp32"]

    @property
    def fp8_products(self) -> list[NodeRow]:
        """The linear layers of a policy with ``fp8``: each one's ``fp8`` says FP8 and the recipe,
        or why not (`amp_fx.passes.use_fp8_linears`)."""
        return [r for r in self.rows if r.fp8]

    @property
    def opaque(self) -> list[NodeRow]:
        """Nodes amp_fx could not trace into, and why (leaf_modules, fx.wrap, untraceable line)."""
        return [r for r in self.rows if r.opaque_reason or r.rule == "opaque"]

    # --- views --------------------------------------------------------------------------------
    def diff(self, context: int = 3) -> str:
        """Unified diff from the traced code before conversion to the converted ``gm.code``; for
        a report of several graphs, one diff per graph, its files named by the graph's label
        (``--- traced fc1``).

        Returns an empty string when the code did not change (O0), and raises ValueError when
        the GraphModule was not produced by `amp_fx.convert` (no original code recorded).
        """
        if self.original_code is None:
            raise ValueError(
                "this GraphModule has no gm.meta['amp_fx_original_code']; the diff needs a module "
                "returned by amp_fx.convert"
            )
        if len(self.graphs) <= 1:
            return _unified_diff(self.original_code, self.code, "", context)
        diffs = [
            _unified_diff(gm.meta[ORIGINAL_CODE_KEY], gm.code, label, context)
            for label, gm in self.graphs.items()
        ]
        return "".join(diffs)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, list, dict; dtypes as "float16"), e.g. for ``json.dumps``."""
        return {
            "policy": _policy_summary(self.policy),
            "nodes": [r.to_dict() for r in self.rows],
            "summary": {
                "casts_inserted": self.casts_inserted,
                "ops_per_rule": dict(self.rule_counts),
                "ops_by_rule": {rule: dict(ops) for rule, ops in self.ops_by_rule.items()},
                "params_by_dtype": {
                    _dtype_str(d): {"tensors": n, "elements": numel}
                    for d, (n, numel) in self.params_by_dtype.items()
                },
                "fp32_ops": [{"name": r.name, "op": r.op, "reason": r.reason} for r in self.fp32_ops],
                "opaque": [
                    {"name": r.name, "target": r.target, "reason": r.opaque_reason, "graph": r.graph}
                    for r in self.opaque
                ],
                "inputs": [cast.to_dict() for cast in self.input_casts],
                "fp8_products": [{"name": r.name, "graph": r.graph, "fp8": r.fp8} for r in self.fp8_products],
                "graphs": list(self.graphs),
                "islands": dict(self.islands),
            },
            "ranges": [r.to_dict() for r in self.ranges],
        }

    def write_dot(self, path: str | os.PathLike[str]) -> list[str]:
        """Write each graph as Graphviz DOT (`amp_fx.inspect.dot.to_dot`): to ``path`` for one graph, else
        to ``path`` with the graph's index before the extension (``out.0.dot``, ``out.1.dot``, in
        the order of `graphs`). Returns the paths written."""
        root, extension = os.path.splitext(os.fspath(path))
        paths = []
        for index, gm in enumerate(self.graphs.values()):
            target = os.fspath(path) if len(self.graphs) == 1 else f"{root}.{index}{extension}"
            write_dot(gm, target)
            paths.append(target)
        return paths

    def table(self) -> str:
        """The per-node table: node, op, rule, input dtypes, output dtype, reason
        (`amp_fx.inspect.report_text.format_table`)."""
        return format_table(self.rows)

    def summary(self) -> str:
        """Counts, the ops kept in FP32 and why, and the opaque nodes (lines wrapped at REPORT_WIDTH)."""
        return format_summary(
            ops=len(self.ops),
            casts_inserted=self.casts_inserted,
            ops_by_rule=self.ops_by_rule,
            params_by_dtype=self.params_by_dtype,
            input_casts=self.input_casts,
            fp32_ops=self.fp32_ops,
            opaque=self.opaque,
            fp8_products=self.fp8_products,
            islands=self.islands,
        )

    def ranges_text(self) -> str:
        """The recorded value ranges per node (`amp_fx.inspect.report_ranges.format_ranges`)."""
        return format_ranges(self.ranges)

    def __str__(self) -> str:
        ranges = f"\n\n{self.ranges_text()}" if self.ranges else ""
        return f"{self._header}\n{self.table()}\n\n{self.summary()}{ranges}"


def _unified_diff(before: str, after: str, label: str, context: int) -> str:
    suffix = f" {label}" if label else ""
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"traced{suffix}",
            tofile=f"converted{suffix}",
            n=context,
        )
    )


def _policy_summary(policy: Any) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {
        "opt_level": policy.opt_level,
        "dtype": _dtype_str(policy.dtype),
        "device_type": policy.device_type,
        "keep_batchnorm_fp32": policy.keep_batchnorm_fp32,
        "cast_model_outputs": _dtype_str(policy.cast_model_outputs),
        # The fused-kernel switches (`amp_fx.core.fusions`), in the policy's field order.
        **{flag: getattr(policy, flag) for flag in policy.fusion_flags()},
        "keep_logits": policy.keep_logits,
        "low_precision_residual": policy.low_precision_residual,
    }


def _target_name(node: torch.fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    module = getattr(node.target, "__module__", None) or ""
    name = (
        getattr(node.target, "__qualname__", None)
        or getattr(node.target, "__name__", None)
        or str(node.target)
    )
    return f"{module}.{name}" if module and not module.startswith("_") else name


def _row(node: torch.fx.Node, graph: str = "") -> NodeRow:
    info: NodeInfo = node.meta.get(META_KEY) or NodeInfo()
    rule = info.rule.value if info.rule is not None else None
    return NodeRow(
        name=node.name,
        kind=node.op,
        target=_target_name(node),
        op=info.op,
        rule=rule,
        reason=info.reason,
        in_dtypes=tuple(info.in_dtypes),
        out_dtype=info.out_dtype,
        is_cast=info.is_cast,
        cast_reason=info.cast_reason,
        opaque_reason=info.opaque_reason,
        notes=tuple(info.notes),
        fp8=info.fp8,
        graph=graph,
    )


def report(model: torch.nn.Module) -> Report:
    """Build the `Report` of a model returned by `amp_fx.convert`, either front end.

        >>> import amp_fx
        >>> gm = amp_fx.convert(torch.nn.Linear(4, 2), "O2", device_type="cpu")
        >>> rep = report(gm)
        >>> [r.name for r in rep.casts]
        ['input_1_to_float16', 'linear_to_float32']
        >>> rep.params_by_dtype[torch.float16]
        (2, 10)

    A model of the torch.export front end is reported over every graph it has captured so far
    (its descendants' included), each labelled by its module's name (``<model>`` for the model,
    ``#2`` for its second graph); its islands are listed:

        >>> class Gated(torch.nn.Module):  # torch.export stops at the `if`: an island
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return self.fc(x) if x.sum() > 0 else -x
        >>> converted = amp_fx.convert(Gated(), "O2", dtype=torch.bfloat16, front_end="export")
        >>> _ = converted(torch.ones(2, 4))  # captures
        >>> rep = report(converted)
        >>> list(rep.graphs), list(rep.islands), rep.casts_inserted
        (['fc'], [''], 2)

    Raises TypeError for a model not converted, ValueError for one of the torch.export front end
    that has not been called yet.
    """
    sections = labelled_graphs(model)
    if not sections:
        raise ValueError(
            f"this {type(model).__name__} has captured no graph yet: the torch.export front end captures "
            "at the first call; call the model once on an example input (converted(**batch)), then "
            "report it"
        )
    if list(sections.values()) == [model]:
        result = _graph_report(model)
    else:
        result = _combined_report(sections, _parameter_rows(model))
    result.islands = {name: why for name, state in capture_states(model) for why in state.islands.values()}
    result.ranges = recorded_ranges(model)
    return result


def _input_casts(gm: torch.fx.GraphModule, label: str) -> list[InputCast]:
    """`Report.input_casts` for one graph: from each floating (or unknown) input, follow the values
    computed from it without a cast to the first casts of them."""
    policy = gm.meta.get(POLICY_KEY)
    found = []
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        dtype = _info(placeholder).out_dtype
        if dtype is not None and not dtype.is_floating_point:
            continue
        casts: dict[torch.fx.Node, None] = {}
        readers: dict[torch.fx.Node, None] = {}
        frontier, seen = _users(placeholder), set()
        while frontier:
            node = frontier.pop()
            if node in seen or node.op == "output":
                continue
            seen.add(node)
            info = _info(node)
            if info.is_cast:
                casts[node] = None
                continue
            readers[node] = None
            # A value still carrying the input's precision: float32 (or unknown) and floating.
            if info.out_dtype is None or info.out_dtype == torch.float32:
                frontier.extend(_users(node))
        if dtype is None and not casts:
            continue  # an optional or non-tensor argument nothing casts
        order = {node: index for index, node in enumerate(gm.graph.nodes)}
        read = tuple(sorted(readers, key=order.__getitem__))
        ordered = sorted(casts, key=order.__getitem__)
        consumers = tuple(dict.fromkeys(user.name for cast in ordered for user in _users(cast)))
        found.append(
            InputCast(
                graph=label,
                name=placeholder.name,
                casts=tuple(cast.name for cast in ordered),
                consumers=consumers,
                read_as_is_by=tuple(node.name for node in read),
                reason=_input_cast_reason(placeholder, ordered, read, policy),
            )
        )
    return found


def _input_cast_reason(
    placeholder: torch.fx.Node, casts: list[torch.fx.Node], read: tuple[torch.fx.Node, ...], policy: Any
) -> str:
    ops = ", ".join(dict.fromkeys(_info(n).op or n.name for n in read))
    low = [c for c in casts if _info(c).out_dtype is not None and _info(c).out_dtype != torch.float32]
    if not low:
        if not read:
            return "not cast: returned or unused"
        return f"not cast: read as it is by {ops}, no op that runs in the low dtype reads it"
    dtype = short_dtype_name(_info(low[0]).out_dtype)
    readers = ", ".join(
        dict.fromkeys(
            f"{user.name} ({_info(user).op or user.target})" for cast in low for user in _users(cast)
        )
    )
    if all(cast.args and cast.args[0] is placeholder for cast in low) and not read:
        if policy is not None and policy.cast_inputs_at_entry and policy.entry_cast_dtype is not None:
            return f"cast to {dtype} at the graph's entry (cast_inputs_at_entry, as Apex)"
        return f"cast to {dtype} where its first lowered consumer, {readers}, reads it"
    return (
        f"read as it is by {ops} (ops that run in FP32 or pass their dtype through); "
        f"cast to {dtype} where {readers} reads it"
    )


def _users(node: torch.fx.Node) -> list[torch.fx.Node]:
    # The nodes reading ``node``'s value, through the recording calls of `amp_fx.watch`.
    return [reader for user in node.users for reader in (user.users if is_range_record(user) else [user])]


def _info(node: torch.fx.Node) -> NodeInfo:
    return node.meta.get(META_KEY) or NodeInfo()


def _graph_report(gm: torch.fx.GraphModule, label: str = "") -> Report:
    policy = gm.meta.get(POLICY_KEY)
    return Report(
        rows=[_row(node, label) for node in gm.graph.nodes if not is_range_record(node)],
        parameters=_parameter_rows(gm),
        code=gm.code,
        original_code=gm.meta.get(ORIGINAL_CODE_KEY),
        policy=policy,
        _header=_header(policy),
        graphs={label: gm},
    )


def _combined_report(sections: dict[str, torch.fx.GraphModule], parameters: list[ParameterRow]) -> Report:
    parts = {label: _graph_report(gm, label) for label, gm in sections.items()}
    originals = [part.original_code for part in parts.values()]
    policy = next(iter(parts.values())).policy
    return Report(
        rows=[row for part in parts.values() for row in part.rows],
        parameters=parameters,
        code=_joined({label: part.code for label, part in parts.items()}),
        original_code=None if None in originals else _joined(dict(zip(parts, originals, strict=True))),
        policy=policy,
        _header=f"{_header(policy)} ({len(parts)} graph{'s' if len(parts) > 1 else ''})",
        graphs=dict(sections),
    )


def _joined(codes: dict[str, str]) -> str:
    # Each graph's code under a comment naming it, so the diff says which graph a change is in.
    return "".join(f"# graph {label}\n{code.strip(chr(10))}\n\n" for label, code in codes.items())


def _parameter_rows(model: torch.nn.Module) -> list[ParameterRow]:
    rows = [ParameterRow(name, p.dtype, p.numel(), False) for name, p in model.named_parameters()]
    rows += [
        ParameterRow(name, b.dtype, b.numel(), True)
        for name, b in model.named_buffers()
        if b.is_floating_point()
    ]
    return rows


def _header(policy: Any) -> str:
    if policy is None:
        return "amp_fx report"
    residual = ", low-precision residual stream (opt-in)" if policy.low_precision_residual else ""
    return f"amp_fx report: {policy.opt_level}, {policy.dtype}, {policy.device_type}{residual}"
