"""The report laid out as text: the per-node table and the summary, no line wider than
`REPORT_WIDTH`. `amp_fx.inspect.report.Report` holds the content and calls these for ``str(report)``,
handing over what they lay out (the rows of `amp_fx.inspect.report_rows`, the counts).

A cell too long for its column continues on the lines below it, broken at spaces:

    >>> _wrap("O2: norms run in FP32 with FP32 params", 16)
    ['O2: norms run in', 'FP32 with FP32', 'params']
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import torch

from amp_fx.core.dtypes import short_dtype_name
from amp_fx.inspect.report_rows import InputCast, NodeRow

__all__ = ["REPORT_WIDTH", "format_summary", "format_table"]

# No line of str(report) is wider than this: it reads in a terminal or a log without wrapping.
REPORT_WIDTH = 100
# The reason column keeps at least this width (about three words); past that the widest of the
# node, op and in columns wraps to make room.
_MIN_REASON_WIDTH = 24
# Those columns wrap no narrower than this.
_MIN_WRAPPED_COLUMN_WIDTH = 8
_COLUMN_GAP = "  "


# The table's "rule" column for amp_fx's own casts, which are PASSTHROUGH nodes to the passes.
_CAST = "cast"


def format_table(rows: list[NodeRow]) -> str:
    """The per-node table of ``rows``: node, op, rule, input dtypes, output dtype, reason.

    A cell too long for its column (mostly the reason) continues on the next lines, aligned
    under its column; a node's first line is the one whose "out" cell is filled.
    """
    header = ("node", "op", "rule", "in", "out", "reason")
    cells = [
        (
            r.name,
            r.op or "-",
            _CAST if r.is_cast else (r.rule or "-"),
            ", ".join(short_dtype_name(d) for d in r.in_dtypes) or "-",
            short_dtype_name(r.out_dtype),
            r.why,
        )
        for r in rows
        if r.kind != "output"
    ]
    shown = [r for r in rows if r.kind != "output"]
    widths = _column_widths([header, *cells])
    lines = []
    for index, row in enumerate([header, *cells]):
        # Each graph's rows under its label, where the report has several graphs.
        label = shown[index - 1].graph if index else ""
        if label and (index == 1 or shown[index - 2].graph != label):
            lines.append(f"[{label}]")
        wrapped = [_wrap(cell, width) for cell, width in zip(row, widths, strict=True)]
        for k in range(max(len(parts) for parts in wrapped)):
            parts = [column[k] if k < len(column) else "" for column in wrapped]
            padded = _COLUMN_GAP.join(p.ljust(w) for p, w in zip(parts[:-1], widths, strict=False))
            lines.append(f"{padded}{_COLUMN_GAP}{parts[-1]}".rstrip())
    return "\n".join(lines)


def format_summary(
    *,
    ops: int,
    casts_inserted: int,
    ops_by_rule: Mapping[str, Mapping[str, int]],
    params_by_dtype: Mapping[torch.dtype, tuple[int, int]],
    input_casts: Sequence[InputCast],
    fp32_ops: Sequence[NodeRow],
    opaque: Sequence[NodeRow],
    islands: Mapping[str, str],
    fp8_products: Sequence[NodeRow] = (),
) -> str:
    """Counts, the ops kept in FP32 and why, and the opaque nodes (lines wrapped at REPORT_WIDTH);
    the arguments are `amp_fx.inspect.report.Report`'s properties of those names (`ops` a count).

    >>> print(format_summary(ops=1, casts_inserted=0, ops_by_rule={"lower": {"linear": 1}},
    ...                      params_by_dtype={}, input_casts=[], fp32_ops=[], opaque=[], islands={}))
    1 ops, 0 casts inserted
    ops per rule: lower 1 (linear×1)
    parameters and buffers: none
    """
    lines = [f"{ops} ops, {casts_inserted} casts inserted"]
    # Broken only between ops: "passthrough 48 (add×5," starts a rule, ")" ends it.
    per_rule = []
    for rule, counts in sorted(ops_by_rule.items()):
        entries = [f"{op}×{n}" for op, n in sorted(counts.items())]
        entries[0] = f"{rule} {sum(counts.values())} ({entries[0]}"
        entries[-1] += ")"
        per_rule += entries
    lines += _fill_items("ops per rule: ", per_rule or ["none"])
    params = [
        f"{short_dtype_name(d)} {n} tensors ({numel:,} elements)"
        for d, (n, numel) in sorted(params_by_dtype.items(), key=lambda item: str(item[0]))
    ]
    lines += _fill_items("parameters and buffers: ", params or ["none"])
    inputs = [cast for cast in input_casts if cast.read_as_is_by or not cast.casts]
    if inputs:
        # Inputs not simply cast where they enter: where the cast went, and why.
        lines.append("inputs:")
        for cast in inputs:
            where = f"[{cast.graph}] " if cast.graph else ""
            lines += _wrap(f"{where}{cast.name}: {cast.reason}", REPORT_WIDTH, "  ", "    ")
    if fp32_ops:
        lines.append("stayed FP32:")
        for r in fp32_ops:
            lines += _wrap(f"{_where(r)}{r.name} ({r.op}): {r.reason}", REPORT_WIDTH, "  ", "    ")
    if fp8_products:
        lines.append("linear layers' products (output, input and weight gradients) in FP8:")
        for r in fp8_products:
            lines += _wrap(f"{_where(r)}{r.name}: {r.fp8}", REPORT_WIDTH, "  ", "    ")
    if opaque:
        lines.append("opaque:")
        for r in opaque:
            text = f"{_where(r)}{r.name} ({r.target}): {r.opaque_reason or r.reason}"
            lines += _wrap(text, REPORT_WIDTH, "  ", "    ")
    if islands:
        lines.append("autocast islands (modules torch.export could not capture):")
        for name, reason in islands.items():
            lines += _wrap(f"{name or '<model>'}: {reason}", REPORT_WIDTH, "  ", "    ")
    return "\n".join(lines)


def _column_widths(rows: list[tuple[str, ...]]) -> list[int]:
    """Widths of the table's columns, fitting REPORT_WIDTH: the widest of node, op and in narrows
    (its cells then wrap) while the reason column would get less than _MIN_REASON_WIDTH."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    fixed = widths[:-1]
    shrinkable = (0, 1, 3)  # node, op, in; rule and out are short words that never wrap
    gaps = len(_COLUMN_GAP) * len(fixed)
    while sum(fixed) + gaps + _MIN_REASON_WIDTH > REPORT_WIDTH:
        widest = max(shrinkable, key=lambda i: fixed[i])
        if fixed[widest] <= _MIN_WRAPPED_COLUMN_WIDTH:
            break
        fixed[widest] -= 1
    return [*fixed, max(REPORT_WIDTH - sum(fixed) - gaps, _MIN_REASON_WIDTH)]


def _wrap(text: str, width: int, first_indent: str = "", indent: str = "") -> list[str]:
    """`text` in lines of at most `width` columns, broken at spaces; a word longer than a line
    starts a line of its own and is cut into pieces of the full width."""
    lines = textwrap.wrap(
        text,
        width,
        initial_indent=first_indent,
        subsequent_indent=indent,
        break_long_words=False,
        break_on_hyphens=False,
    )
    fitted = []
    for line in lines:
        while len(line) > width:
            fitted.append(line[:width])
            line = indent + line[width:]
        fitted.append(line)
    return fitted or [first_indent.rstrip()]


def _fill_items(prefix: str, items: list[str]) -> list[str]:
    """``prefix`` then the items separated by ", ", breaking lines only between items; continuation
    lines are indented by two spaces. An item too long for a line of its own is wrapped inside."""
    indent = "  "
    pieces = []
    for i, item in enumerate(items):
        pieces += _wrap(item if i == len(items) - 1 else f"{item},", REPORT_WIDTH - len(indent))
    lines: list[str] = []
    line, fresh = prefix, True
    for piece in pieces:
        if len(line) + (0 if fresh else 1) + len(piece) > REPORT_WIDTH:
            lines.append(line.rstrip())
            line, fresh = indent, True
        line = f"{line}{piece}" if fresh else f"{line} {piece}"
        fresh = False
    lines.append(line)
    return lines


def _where(row: NodeRow) -> str:
    return f"[{row.graph}] " if row.graph else ""
