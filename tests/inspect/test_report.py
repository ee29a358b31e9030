"""Tests of amp_fx.report: the per-node table, counts, FP32/opaque listings, diff and to_dict.

The report must say exactly what the graph holds: every check compares it with the converted
GraphModule itself (its nodes' `node_info`, its parameters, its code) or with the O0 conversion
of the same model (the graph before any cast), never with hard-coded numbers.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
import torch.fx
from torch import nn

import amp_fx
from amp_fx.core.fusions import FUSIONS
from amp_fx.core.node_info import node_info
from amp_fx.inspect.report import REPORT_WIDTH


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        h = self.norm(h + self.fc(h))
        return self.head(h).softmax(-1)


class Gate(nn.Module):
    """A submodule fx cannot trace: its forward branches on a tensor's value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


class WithOpaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.gate(self.attention(h, h, h, need_weights=False)[0])


def _convert(model: nn.Module, level: str, dtype: torch.dtype = torch.float16) -> torch.fx.GraphModule:
    return amp_fx.convert(model, level, dtype=dtype, device_type="cpu")


def _calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))


TABLE_COLUMNS = ("node", "op", "rule", "in", "out", "reason")


def _table_cells(table: str) -> list[dict[str, list[str]]]:
    """The table's rows as column -> the cell's pieces, one per line it takes.

    Columns are cut where the header's names start; a row starts at a line whose "out" cell is
    filled (that cell never wraps).
    """
    header, *body = table.splitlines()
    starts = [header.index(name) for name in ("node", " op ", " rule ", " in ", " out ", " reason")]
    starts = [starts[0], *(start + 1 for start in starts[1:])]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    rows: list[dict[str, list[str]]] = []
    for line in body:
        cells = {name: line[a:b].strip() for name, (a, b) in zip(TABLE_COLUMNS, bounds, strict=True)}
        if cells["out"]:
            rows.append({name: [] for name in TABLE_COLUMNS})
        for name, cell in cells.items():
            if cell:
                rows[-1][name].append(cell)
    return rows


def _summary_entries(summary: str, heading: str) -> list[list[str]]:
    """The entries listed under `heading` ("stayed FP32:", "opaque:"), each as its lines' pieces."""
    lines = summary.splitlines()
    entries: list[list[str]] = []
    if heading not in lines:
        return entries
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("    "):
            entries[-1].append(line.strip())
        elif line.startswith("  "):
            entries.append([line.strip()])
        else:
            break
    return entries


def _is_wrapped(pieces: list[str], text: str) -> bool:
    """Whether `pieces` are `text` wrapped onto lines: broken at a space, or inside a long word."""
    return re.fullmatch(" ?".join(re.escape(piece) for piece in pieces), text) is not None


def _widest_line(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_rows_are_the_graph_nodes_and_their_info(level: str) -> None:
    gm = _convert(Block(), level)
    rep = amp_fx.report(gm)
    nodes = list(gm.graph.nodes)
    assert [r.name for r in rep.rows] == [n.name for n in nodes]
    for row, node in zip(rep.rows, nodes, strict=True):
        info = node_info(node)
        assert row.kind == node.op
        assert (row.op, row.reason, row.is_cast, row.cast_reason) == (
            info.op,
            info.reason,
            info.is_cast,
            info.cast_reason,
        )
        assert row.rule == (info.rule.value if info.rule is not None else None)
        assert row.in_dtypes == tuple(info.in_dtypes) and row.out_dtype == info.out_dtype
        assert row.opaque_reason == info.opaque_reason


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_counts_match_the_graph(level: str, dtype: torch.dtype) -> None:
    model = Block()
    gm = _convert(model, level, dtype)
    rep = amp_fx.report(gm)
    # Converting only adds casts, fusions aside (O2 fuses BatchNorm + ReLU: fewer calls; its fused
    # LayerNorm reads its parameters with get_attr nodes): the call nodes beyond the untouched (O0)
    # graph's are the casts.
    policy = amp_fx.preset(level, dtype, "cpu", fused_losses=False, fused_batch_norm=False, fused_norms=False)
    unfused = amp_fx.convert(model, level, policy=policy)
    assert amp_fx.report(unfused).casts_inserted == _calls(unfused) - _calls(_convert(model, "O0")) > 0
    assert rep.casts_inserted == sum(1 for n in gm.graph.nodes if node_info(n).is_cast)
    assert sum(rep.rule_counts.values()) == len(rep.ops) == _calls(gm) - rep.casts_inserted
    for rule, ops in rep.ops_by_rule.items():
        assert sum(ops.values()) == rep.rule_counts[rule]
    assert rep.rule_counts["lower"] >= 3  # conv, two linears
    by_dtype = {}
    for tensor in [*gm.parameters(), *(b for b in gm.buffers() if b.is_floating_point())]:
        tensors, elements = by_dtype.get(tensor.dtype, (0, 0))
        by_dtype[tensor.dtype] = (tensors + 1, elements + tensor.numel())
    assert rep.params_by_dtype == by_dtype


def test_o2_lists_fp32_islands_and_low_precision_parameters() -> None:
    gm = _convert(Block(), "O2")
    rep = amp_fx.report(gm)
    fp32 = {r.name for r in rep.fp32_ops}
    assert fp32 == {n.name for n in gm.graph.nodes if node_info(n).rule is amp_fx.Rule.FP32}
    assert all(r.reason for r in rep.fp32_ops)
    # Apex O2: conv/linear weights in fp16, BatchNorm kept fp32.
    assert gm.get_parameter("conv.weight").dtype == torch.float16
    assert gm.get_parameter("bn.weight").dtype == torch.float32
    assert torch.float16 in rep.params_by_dtype and torch.float32 in rep.params_by_dtype
    assert rep.fp32_ops and "stayed FP32:" in str(rep)
    entries = _summary_entries(rep.summary(), "stayed FP32:")
    assert len(entries) == len(rep.fp32_ops)
    for pieces, r in zip(entries, rep.fp32_ops, strict=True):
        assert _is_wrapped(pieces, f"{r.name} ({r.op}): {r.reason}"), pieces


def test_o0_has_no_casts_and_an_empty_diff() -> None:
    gm = _convert(Block(), "O0")
    rep = amp_fx.report(gm)
    assert rep.casts_inserted == 0 and rep.casts == []
    assert rep.diff() == ""
    assert "0 casts inserted" in str(rep)


def test_opaque_nodes_are_named_with_their_reason() -> None:
    gm = _convert(WithOpaque(), "O1")
    rep = amp_fx.report(gm)
    by_name = {r.name: r for r in rep.opaque}
    assert set(by_name) == {"attention", "gate"}
    assert "MultiheadAttention" in by_name["attention"].opaque_reason
    # The line that stopped the tracer is named.
    assert by_name["gate"].opaque_reason.startswith("untraceable:")
    assert "if x.sum() > 0:" in by_name["gate"].opaque_reason
    assert "opaque:" in str(rep)
    entries = _summary_entries(rep.summary(), "opaque:")
    assert len(entries) == len(rep.opaque)
    for pieces, r in zip(entries, rep.opaque, strict=True):
        assert _is_wrapped(pieces, f"{r.name} ({r.target}): {r.opaque_reason}"), pieces
    data = rep.to_dict()["summary"]["opaque"]
    assert {d["name"] for d in data} == {"attention", "gate"}


def test_table_is_aligned_and_complete() -> None:
    gm = _convert(Block(), "O1", torch.bfloat16)
    rep = amp_fx.report(gm)
    table = rep.table().splitlines()
    header = table[0]
    assert header.split() == list(TABLE_COLUMNS)
    columns = [header.index(name) for name in (" op ", " rule ", " in ", " out ", " reason")]
    for line in table[1:]:
        # Every column starts where its header does: the cell before it ends with padding.
        for col in columns:
            assert len(line) <= col or line[col] == " ", line
    assert len(table) > len(gm.graph.nodes)  # some reasons continue on a second line
    shown = [r for r in rep.rows if r.kind != "output"]
    cells = _table_cells(rep.table())
    assert len(cells) == len(shown)
    for row, cell in zip(shown, cells, strict=True):
        assert cell["node"] == [row.name] and cell["op"] == [row.op or "-"]
        assert cell["rule"] == ["cast" if row.is_cast else (row.rule or "-")]
        assert _is_wrapped(cell["reason"], row.why), cell  # the whole reason, however many lines
    summary = rep.summary()
    assert f"{len(rep.ops)} ops, {rep.casts_inserted} casts inserted" in summary
    assert "ops per rule: " in summary and "parameters and buffers: " in summary
    assert "bf16" in str(rep) and "amp_fx report: O1, torch.bfloat16, cpu" in str(rep)


def _resnet18() -> nn.Module:
    return pytest.importorskip("torchvision").models.resnet18()


def _small_transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    return nn.Sequential(nn.Linear(16, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))


@pytest.mark.parametrize(
    "build, example",
    [
        (_resnet18, torch.randn(2, 3, 32, 32)),
        (_small_transformer, torch.randn(2, 5, 16)),
    ],
    ids=["resnet18", "transformer"],
)
def test_no_line_is_wider_than_the_limit(build, example) -> None:
    """Realistic models have long reasons and long "ops per rule" lists: they wrap, and still say
    every node, every reason and every op count."""
    gm = amp_fx.convert(build().eval(), "O2", device_type="cpu", example_inputs=(example,))
    rep = amp_fx.report(gm)
    text = str(rep)
    assert _widest_line(text) <= REPORT_WIDTH
    shown = [r for r in rep.rows if r.kind != "output"]
    cells = _table_cells(rep.table())
    assert len(cells) == len(shown)
    for row, cell in zip(shown, cells, strict=True):
        # A long name may wrap too (a fused norm's op name and four input dtypes widen their columns).
        assert "".join(cell["node"]) == row.name and _is_wrapped(cell["reason"], row.why), cell
    per_rule = " ".join(line.strip() for line in rep.summary().splitlines()[1:] if "×" in line)
    for rule, ops in rep.ops_by_rule.items():
        for op, n in ops.items():
            assert re.search(rf"[ (]{re.escape(op)}×{n}[,)]", per_rule), (rule, op)
        assert f"{rule} {sum(ops.values())} (" in per_rule
    entries = _summary_entries(rep.summary(), "stayed FP32:")
    assert len(entries) == len(rep.fp32_ops)
    for pieces, r in zip(entries, rep.fp32_ops, strict=True):
        assert _is_wrapped(pieces, f"{r.name} ({r.op}): {r.reason}"), pieces


def test_long_names_and_lists_wrap_within_the_limit() -> None:
    """Node names too long to leave the reason its minimum width wrap inside their column."""
    names = [f"very_long_submodule_name_{i}_" * 3 for i in range(4)]
    model = nn.Sequential()
    for name in names:
        model.add_module(name, nn.Linear(4, 4))
    rep = amp_fx.report(_convert(model, "O2"))
    assert _widest_line(str(rep)) <= REPORT_WIDTH
    shown = [r for r in rep.rows if r.kind != "output"]
    cells = _table_cells(rep.table())
    assert len(cells) == len(shown)
    assert any(len(cell["node"]) > 1 for cell in cells)  # the names did wrap
    for row, cell in zip(shown, cells, strict=True):
        assert _is_wrapped(cell["node"], row.name) and _is_wrapped(cell["reason"], row.why), cell


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_diff_shows_every_inserted_cast(level: str) -> None:
    gm = _convert(Block(), level)
    rep = amp_fx.report(gm)
    diff = rep.diff()
    assert diff.startswith("--- traced\n+++ converted\n")
    added = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    for cast in rep.casts:
        assert any(line.lstrip("+ ").startswith(f"{cast.name} = ") for line in added), cast.name
    # The "before" side is the traced model as convert recorded it.
    assert gm.meta["amp_fx_original_code"] == rep.original_code


def test_to_dict_is_plain_data() -> None:
    gm = _convert(Block(), "O2", torch.bfloat16)
    rep = amp_fx.report(gm)
    data = json.loads(json.dumps(rep.to_dict()))
    assert data["policy"]["opt_level"] == "O2" and data["policy"]["dtype"] == "bfloat16"
    # Every fused-kernel switch of the table, as the policy set it (all on at O2 on CPU but the
    # CUDA-only ones).
    switches = {fusion.flag: not fusion.cuda_only for fusion in FUSIONS}
    assert {flag: data["policy"][flag] for flag in switches} == switches
    assert len(data["nodes"]) == len(rep.rows)
    assert data["summary"]["casts_inserted"] == rep.casts_inserted
    assert data["summary"]["ops_per_rule"] == dict(rep.rule_counts)
    elements = sum(v["elements"] for v in data["summary"]["params_by_dtype"].values())
    assert elements == sum(p.numel for p in rep.parameters)
    cast_rows = [n for n in data["nodes"] if n["is_cast"]]
    assert all(n["out_dtype"] in ("bfloat16", "float32") for n in cast_rows)


def test_plain_graph_module_without_amp_fx_meta() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    rep = amp_fx.report(gm)
    assert rep.casts_inserted == 0 and rep.policy is None
    assert str(rep).startswith("amp_fx report\n")
    with pytest.raises(ValueError, match="amp_fx_original_code"):
        rep.diff()


def test_report_rejects_a_plain_module() -> None:
    with pytest.raises(TypeError, match="amp_fx.convert"):
        amp_fx.report(nn.Linear(2, 2))


def test_public_names() -> None:
    rep = amp_fx.report(_convert(nn.Linear(2, 2), "O2"))
    assert isinstance(rep, amp_fx.Report)
    assert type(rep).__module__ == "amp_fx.inspect.report"


class Routed(nn.Module):
    """torch.export stops at the ``if`` on a value: the model's own code is an island and its two
    Linear children are captured on their own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h if h.sum() > 0 else -h)


def _captured(level: str = "O2") -> nn.Module:
    converted = amp_fx.convert(Routed(), level, dtype=torch.bfloat16, front_end="export")
    converted(torch.randn(3, 8))
    return converted


def test_a_torch_export_model_is_reported_over_every_captured_graph(tmp_path) -> None:
    converted = _captured()
    rep = amp_fx.report(converted)
    graphs = {"fc1": converted.fc1, "fc2": converted.fc2}
    captured = dict(rep.graphs)
    assert list(captured) == list(graphs)
    for label, module in graphs.items():
        (gm,) = module.__dict__["_amp_fx_capture"].graphs
        assert captured[label] is gm
    # Each graph's rows, labelled, in order; the counts are the graphs' own reports' summed.
    singles = {label: amp_fx.report(gm) for label, gm in captured.items()}
    assert [(r.graph, r.name) for r in rep.rows] == [
        (label, r.name) for label, single in singles.items() for r in single.rows
    ]
    assert rep.casts_inserted == sum(single.casts_inserted for single in singles.values()) > 0
    assert rep.rule_counts == sum((single.rule_counts for single in singles.values()), Counter())
    assert {p.name for p in rep.parameters} == {name for name, _ in converted.named_parameters()}
    assert set(rep.islands) == {""} and "h.sum() > 0" in rep.islands[""]
    text = str(rep)
    assert text.startswith("amp_fx report: O2, torch.bfloat16, cpu (2 graphs)\n")
    assert text.index("[fc1]") < text.index("[fc2]") and "autocast islands" in text
    assert _widest_line(text) <= REPORT_WIDTH
    data = json.loads(json.dumps(rep.to_dict()))
    assert [n["graph"] for n in data["nodes"]] == [r.graph for r in rep.rows]
    assert data["summary"]["graphs"] == ["fc1", "fc2"] and list(data["summary"]["islands"]) == [""]
    # The diff names each graph and shows each cast inserted in it.
    diff = rep.diff()
    assert (
        diff.startswith("--- traced fc1\n+++ converted fc1\n")
        and "--- traced fc2\n+++ converted fc2\n" in diff
    )
    added = [line.lstrip("+ ") for line in diff.splitlines() if line.startswith("+ ")]
    assert sum(1 for line in added if re.match(r"\w+_to_\w+ = ", line)) == rep.casts_inserted
    paths = rep.write_dot(tmp_path / "graph.dot")
    assert paths == [str(tmp_path / "graph.0.dot"), str(tmp_path / "graph.1.dot")]
    for path, gm in zip(paths, captured.values(), strict=True):
        drawn = set(re.findall(r'^  "([^"]+)" \[label=', open(path).read(), flags=re.M))
        assert drawn == {n.name for n in gm.graph.nodes}


def test_a_torch_export_model_not_called_yet_says_to_call_it() -> None:
    converted = amp_fx.convert(Routed(), "O2", dtype=torch.bfloat16, front_end="export")
    with pytest.raises(ValueError, match=r"captured no graph yet.*call the model once on an example input"):
        amp_fx.report(converted)


def test_a_torch_fx_model_draws_its_one_graph(tmp_path) -> None:
    gm = _convert(Block(), "O2")
    rep = amp_fx.report(gm)
    assert rep.graphs == {"": gm} and rep.islands == {}
    assert all(r.graph == "" for r in rep.rows) and "[" not in rep.table().splitlines()[1]
    assert rep.write_dot(tmp_path / "block.dot") == [str(tmp_path / "block.dot")]
    drawn = set(re.findall(r'^  "([^"]+)" \[label=', (tmp_path / "block.dot").read_text(), flags=re.M))
    assert drawn == {n.name for n in gm.graph.nodes}


class GatedBlock(nn.Module):
    """A LayerNorm on a lowered value and a gated MLP: O2 fuses both on either front end."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.gate = nn.Linear(8, 16)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x))
        return self.down(nn.functional.silu(self.gate(h)) * self.up(h)).softmax(-1)


def _activation_cast_reasons(rep: amp_fx.Report) -> Counter[str]:
    """The reasons of the report's casts of computed values (not of parameters, whose storage the
    two front ends may decide apart)."""
    nodes = {(label, n.name): n for label, gm in rep.graphs.items() for n in gm.graph.nodes}
    return Counter(r.why for r in rep.casts if nodes[(r.graph, r.name)].all_input_nodes[0].op != "get_attr")


def test_an_exported_programs_module_is_reported_over_the_graph_it_runs() -> None:
    """convert(ExportedProgram.module(), front_end="export") is a GraphModule, but what runs is the
    graph it captures: the report shows that one, with the fusions and casts the fx front end
    makes of the same model."""
    torch.manual_seed(0)
    model, x = GatedBlock(), torch.randn(3, 8)
    exported = torch.export.export(model, (x,)).module()
    converted = amp_fx.convert(exported, "O2", dtype=torch.float16, device_type="cpu", front_end="export")
    with pytest.raises(ValueError, match="captured no graph yet"):
        amp_fx.report(converted)
    converted(x)
    rep = amp_fx.report(converted)
    (graph,) = amp_fx.captured_graphs(converted)
    assert graph is not converted and list(rep.graphs.values()) == [graph]
    assert [r.name for r in rep.rows] == [n.name for n in graph.graph.nodes]
    fx = amp_fx.report(_convert(GatedBlock(), "O2"))
    assert rep.ops_by_rule == fx.ops_by_rule
    assert {"layer_norm_fp32", "fp32_gated_activation"} <= set(rep.ops_by_rule["passthrough"])
    assert _activation_cast_reasons(rep) == _activation_cast_reasons(fx) != Counter()
