"""amp_fx.report on a watched model: its table and summary are those of the model unwatched, and it
gains the recorded ranges per node, the same numbers `RangeWatch.ranges` gives, within the width."""

from __future__ import annotations

import json

import torch
from torch import nn

import amp_fx
from amp_fx.inspect.report import REPORT_WIDTH


class Standardised(nn.Module):
    """An input standardised by its own statistics before the first matmul (the report follows the
    input through them to its cast), then a second matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = self.fc1((x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True))
        return self.fc2(torch.relu(h))


def _converted(front_end: str = "fx") -> nn.Module:
    torch.manual_seed(0)
    return amp_fx.convert(Standardised(), "O2", device_type="cpu", front_end=front_end)


def _step(model: nn.Module, rows: int = 5) -> None:
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows)) * 100
    (model(x) * 512).sum().backward()


def _table_rows(text: str) -> dict[str, list[str]]:
    """The ranges table's rows by node (the node column's first line), cells split at spaces."""
    lines = text.split("value ranges recorded")[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("node "))
    return {line.split()[0]: line.split() for line in lines[start + 1 : -1] if not line.startswith("[")}


def test_watching_changes_no_row_of_the_report_and_adds_the_ranges() -> None:
    model = _converted()
    before = amp_fx.report(model)
    for mode in ("low", "all"):
        watch = amp_fx.watch(model, nodes=mode)
        _step(model)
        after = amp_fx.report(model)
        assert after.to_dict()["nodes"] == before.to_dict()["nodes"]
        assert after.to_dict()["summary"] == before.to_dict()["summary"]
        assert after.table() == before.table() and after.summary() == before.summary()
        assert [r.to_dict() for r in after.ranges] == [r.to_dict() for r in watch.ranges()]
        assert after.to_dict()["ranges"] == [r.to_dict() for r in watch.ranges()]
        json.dumps(after.to_dict())
        watch.remove()
    assert amp_fx.report(model).ranges == [] and "value ranges" not in str(amp_fx.report(model))


def test_the_table_shows_each_nodes_numbers() -> None:
    model = _converted()
    watch = amp_fx.watch(model)
    _step(model)
    text = str(amp_fx.report(model))
    assert max(len(line) for line in text.splitlines()) <= REPORT_WIDTH
    rows = _table_rows(text)
    for node in watch.ranges():
        cells = rows[node.node]
        assert cells[3] == f"{node.forward.amax:.3g}" and cells[4] == f"{node.forward.headroom:.1f}"
        assert cells[5] == f"{100 * node.forward.underflow_share:.1f}%"
        if node.backward.recorded:
            assert cells[6] == f"{node.backward.amax:.3g}" and cells[7] == f"{node.backward.headroom:.1f}"
        assert (
            cells[-1]
            == f"{node.forward.nonfinite}/{node.backward.nonfinite if node.backward.recorded else '-'}"
        )
    least = min(watch.ranges(), key=lambda r: r.forward.headroom)
    assert f"lowest headroom: values {least.node} ({least.forward.headroom:.1f} bits)" in text


def test_several_graphs_are_labelled() -> None:
    model = _converted("export")
    watch = amp_fx.watch(model, every=1)
    _step(model, rows=5)
    _step(model, rows=7)  # a second graph, of dynamic sizes
    text = amp_fx.report(model).ranges_text()
    assert "[<model>]" in text and "[<model> #2]" in text
    assert {r.graph for r in watch.ranges()} == {"<model>", "<model> #2"}
    assert max(len(line) for line in text.splitlines()) <= REPORT_WIDTH


def test_an_overflow_shows_in_the_table() -> None:
    model = _converted()
    amp_fx.watch(model, every=1)
    with torch.no_grad():
        model.fc2.weight.fill_(60000.0)
    _step(model)
    text = amp_fx.report(model).ranges_text()
    assert "inf" in _table_rows(text)["fc2"][3]
    assert "values fc2 (overflowed)" in text
