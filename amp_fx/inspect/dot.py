"""Graphviz DOT for a converted graph: inserted casts and FP32 islands coloured.

Reads only what the passes recorded in ``node.meta["amp_fx"]`` (`amp_fx.core.node_info.NodeInfo`), so it
also draws a plain, unconverted fx graph (every node uncoloured)::

    >>> import torch, torch.fx
    >>> dot = to_dot(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))
    >>> dot.splitlines()[0]
    'digraph amp_fx {'

Render with ``dot -Tsvg out.dot -o out.svg``.
"""

from __future__ import annotations

import os

import torch.fx

from amp_fx.core.dtypes import short_dtype_name
from amp_fx.core.node_info import META_KEY

# Fill colour per rule name (the `Rule` enum's member names); casts override the rule's colour.
RULE_COLOURS = {
    "LOWER": "#c7e9c0",  # green: runs in fp16/bf16
    "FP32": "#9ecae1",  # blue: an FP32 island
    "PROMOTE": "#fdd0a2",  # light orange: widest input type
    "PASSTHROUGH": "#ffffff",
    "OPAQUE": "#d9d9d9",  # grey: not traced into
}
CAST_COLOUR = "#fb6a4a"  # red: a cast amp_fx inserted
IO_COLOUR = "#f0f0f0"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _rule_name(rule: object) -> str | None:
    if rule is None:
        return None
    return str(getattr(rule, "name", rule)).upper()


def _target_name(node: torch.fx.Node) -> str:
    if node.op in ("call_module", "get_attr", "placeholder", "output"):
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _node_style(node: torch.fx.Node) -> tuple[str, str, str]:
    """(label, fill colour, shape) of one node."""
    info = node.meta.get(META_KEY)
    if node.op in ("placeholder", "output"):
        label = f"{node.op}\n{node.name}"
        if info is not None and info.out_dtype is not None:
            label += f"\n{short_dtype_name(info.out_dtype)}"
        return label, IO_COLOUR, "oval"
    if info is None:
        return f"{node.name}\n{_target_name(node)}", "#ffffff", "box"
    rule = _rule_name(info.rule)
    lines = [node.name, info.op or _target_name(node)]
    if info.is_cast:
        lines.append(f"cast -> {short_dtype_name(info.out_dtype)}")
        if info.cast_reason:
            lines.append(info.cast_reason)
        return "\n".join(lines), CAST_COLOUR, "box"
    ins = ",".join(short_dtype_name(d) for d in info.in_dtypes)
    dtypes = f"({ins}) -> {short_dtype_name(info.out_dtype)}" if ins else short_dtype_name(info.out_dtype)
    lines.append(f"{rule or '-'} {dtypes}")
    return "\n".join(lines), RULE_COLOURS.get(rule or "", "#ffffff"), "box"


def to_dot(gm: torch.fx.GraphModule | torch.fx.Graph, name: str = "amp_fx") -> str:
    """Return the graph as Graphviz DOT text, one node per fx node, edges from inputs to users.

    Casts inserted by amp_fx are red, FP32 islands blue, low-precision ops green, opaque nodes
    grey; a legend cluster names the colours.
    """
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    lines = [
        f"digraph {name} {{",
        "  rankdir=TB;",
        '  node [style=filled, fontname="Helvetica", fontsize=10];',
    ]
    for node in graph.nodes:
        label, colour, shape = _node_style(node)
        lines.append(
            f"  {_quote(node.name)} [label={_quote(label)}, fillcolor={_quote(colour)}, shape={shape}];"
        )
    for node in graph.nodes:
        for source in node.all_input_nodes:
            lines.append(f"  {_quote(source.name)} -> {_quote(node.name)};")
    lines.append("  subgraph cluster_legend {")
    lines.append('    label="legend"; fontsize=10;')
    legend = [("cast (inserted)", CAST_COLOUR)] + [(rule, colour) for rule, colour in RULE_COLOURS.items()]
    for index, (text, colour) in enumerate(legend):
        lines.append(
            f"    legend_{index} [label={_quote(text)}, fillcolor={_quote(colour)}, shape=box, fontsize=9];"
        )
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_dot(gm: torch.fx.GraphModule | torch.fx.Graph, path: str | os.PathLike[str]) -> None:
    """Write `to_dot(gm)` to `path`."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(to_dot(gm))
