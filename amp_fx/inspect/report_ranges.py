"""The value ranges `amp_fx.watch` recorded, as `amp_fx.report` shows them: a table of each watched
node's largest magnitude, headroom and underflow share, for its values and for its gradients, and
a line naming the nodes closest to overflow. `amp_fx.inspect.report.Report` holds the ranges
(`recorded_ranges`) and calls `format_ranges` for ``str(report)``.

    >>> import torch, amp_fx
    >>> linear = torch.nn.Linear(4, 2)
    >>> _ = torch.nn.init.constant_(linear.weight, 0.5), torch.nn.init.zeros_(linear.bias)
    >>> gm = amp_fx.convert(linear, "O2", device_type="cpu")
    >>> watch = amp_fx.watch(gm)
    >>> gm(torch.full((3, 4), 1000.0)).sum().backward()
    >>> print(amp_fx.report(gm).ranges_text())
    value ranges recorded (totals over the steps watched; bits: log2(the dtype's largest value / amax),
    the doublings left before overflow; under: share of the values that underflowed, non-zero and below
    the dtype's smallest normal):
    node                op      dtype  amax   bits  under  grad amax  bits  under  inf/NaN
    input_1_to_float16  to      fp16   1e+03  6.0   0.0%   -          -     -      0/-
    linear              linear  fp16   2e+03  5.0   0.0%   1          16.0  0.0%   0/0
    lowest headroom: values linear (5.0 bits), gradients linear (16.0 bits)
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from torch import nn

from amp_fx.core.dtypes import short_dtype_name
from amp_fx.inspect.ranges import NodeRange, RangeStats, watching
from amp_fx.inspect.report_text import REPORT_WIDTH

__all__ = ["format_ranges", "recorded_ranges"]

_HEADER = ("node", "op", "dtype", "amax", "bits", "under", "grad amax", "bits", "under", "inf/NaN")
_GAP = "  "
# The node and op columns wrap no narrower than these.
_MIN_NODE_WIDTH, _MIN_OP_WIDTH = 12, 6
_INTRODUCTION = (
    "value ranges recorded (totals over the steps watched; bits: log2(the dtype's largest value / amax), "
    "the doublings left before overflow; under: share of the values that underflowed, non-zero and "
    "below the dtype's smallest normal):"
)


def recorded_ranges(model: nn.Module) -> list[NodeRange]:
    """What `amp_fx.watch` recorded for ``model``'s nodes (totals); empty for a model not watched."""
    watch = watching(model)
    return watch.ranges() if watch is not None else []


def format_ranges(ranges: Sequence[NodeRange]) -> str:
    """The table of ``ranges`` (each graph's rows under its ``[label]`` where there are several),
    then the nodes with the least headroom; no line wider than REPORT_WIDTH."""
    shown = [r for r in ranges if r.forward.recorded or r.backward.recorded]
    cells = [_cells(r) for r in shown]
    widths = _widths([_HEADER, *cells])
    lines = textwrap.wrap(_INTRODUCTION, REPORT_WIDTH)
    labels = {r.graph for r in shown}
    for index, row in enumerate([_HEADER, *cells]):
        if index and len(labels) > 1 and (index == 1 or shown[index - 2].graph != shown[index - 1].graph):
            lines.append(f"[{shown[index - 1].graph}]")
        wrapped = [
            textwrap.wrap(cell, width, break_on_hyphens=False) or [""]
            for cell, width in zip(row, widths, strict=True)
        ]
        for k in range(max(len(parts) for parts in wrapped)):
            parts = [column[k] if k < len(column) else "" for column in wrapped]
            lines.append(
                _GAP.join(part.ljust(width) for part, width in zip(parts, widths, strict=True)).rstrip()
            )
    lines.append(_lowest(shown))
    return "\n".join(lines)


def _cells(r: NodeRange) -> tuple[str, ...]:
    f, b = r.forward, r.backward
    nonfinite = f"{f.nonfinite if f.recorded else '-'}/{b.nonfinite if b.recorded else '-'}"
    return (r.node, r.op or "-", short_dtype_name(r.dtype), *_stats(f), *_stats(b), nonfinite)


def _stats(stats: RangeStats) -> tuple[str, str, str]:
    if not stats.recorded:
        return "-", "-", "-"
    return f"{stats.amax:.3g}", f"{stats.headroom:.1f}", f"{100 * stats.underflow_share:.1f}%"


def _widths(rows: list[tuple[str, ...]]) -> list[int]:
    """Column widths fitting REPORT_WIDTH: the wider of the node and op columns narrows (its cells
    then wrap) while the table is too wide; the numbers never wrap."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    least = {0: _MIN_NODE_WIDTH, 1: _MIN_OP_WIDTH}
    while sum(widths) + len(_GAP) * (len(widths) - 1) > REPORT_WIDTH:
        column = max(least, key=lambda i: widths[i] - least[i])
        if widths[column] <= least[column]:
            break
        widths[column] -= 1
    return widths


def _lowest(ranges: Sequence[NodeRange]) -> str:
    """The node with the least headroom, for values and for gradients."""
    parts = []
    for what, pick in (("values", lambda r: r.forward), ("gradients", lambda r: r.backward)):
        recorded = [(pick(r).headroom, r.node) for r in ranges if pick(r).recorded]
        if recorded:
            headroom, node = min(recorded, key=lambda item: (item[0], item[1]))
            bits = "overflowed" if headroom <= 0 else f"{headroom:.1f} bits"
            parts.append(f"{what} {node} ({bits})")
    return "lowest headroom: " + (", ".join(parts) if parts else "nothing recorded yet")
