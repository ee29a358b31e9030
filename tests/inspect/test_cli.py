"""The amp-fx command line and its Graphviz output (amp_fx/inspect/cli.py, amp_fx/inspect/dot.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx

from amp_fx.inspect.cli import main, parse_shape
from amp_fx.inspect.dot import CAST_COLOUR, RULE_COLOURS, to_dot
from amp_fx.inspect.report import REPORT_WIDTH

MODEL_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Attention(nn.Module):
        def __init__(self, width: int = 16):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.out = nn.Linear(width, width)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.out(torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v)


    class TokenModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100)

        def forward(self, idx):
            return self.head(torch.relu(self.embedding(idx)))


    class Asserting(nn.Module):  # nanoGPT's size assert: torch.fx stops at it, torch.export takes it

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            assert x.shape[-2] <= 32, "sequence too long"
            return self.fc(x)


    class Branching(nn.Module):  # torch.fx and torch.export stop at the `if`: an island around fc

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x)
            return h @ h.transpose(-2, -1) if h.sum() > 0 else h.transpose(-2, -1) @ h


    class NeedsArguments(nn.Module):
        def __init__(self, width):
            super().__init__()
    """
)


RUN = dict(capture_output=True, text=True, timeout=300)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(MODEL_FILE)
    return str(path)


def _dot_graph(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(node name -> fill colour, edges) of DOT text written by to_dot (legend left out)."""
    nodes = dict(re.findall(r'^  "([^"]+)" \[label=.*fillcolor="(#[0-9a-f]+)"', text, flags=re.M))
    edges = re.findall(r'^  "([^"]+)" -> "([^"]+)";', text, flags=re.M)
    return nodes, edges


def _assert_fits(out: str, *echoed: str) -> None:
    """No line of the output is wider than the report's limit, except lines echoing the user's
    `echoed` paths back (their length is the user's)."""
    wide = [line for line in out.splitlines() if len(line) > REPORT_WIDTH]
    assert [line for line in wide if not any(path in line for path in echoed)] == []


def test_inspect_a_torchvision_model(tmp_path, capsys):
    dot = tmp_path / "resnet18.dot"
    args = ["--opt-level", "O2", "--dtype", "bf16", "--input-shape", "1,3,32,32", "--dot", str(dot)]
    assert main(["inspect", "torchvision:resnet18", *args]) == 0
    out = capsys.readouterr().out
    assert "amp_fx report: O2, torch.bfloat16" in out
    assert re.search(r"conv1\s+conv2d\s+lower\s+bf16", out)
    assert re.search(r"\d+ casts inserted", out)
    _assert_fits(out, str(dot))
    nodes, edges = _dot_graph(dot.read_text())
    assert nodes["x_to_bfloat16"] == CAST_COLOUR and nodes["conv1"] == RULE_COLOURS["LOWER"]
    assert ("x", "x_to_bfloat16") in edges and ("x_to_bfloat16", "conv1") in edges


def test_inspect_a_model_from_a_file_shows_fp32_islands(model_file, tmp_path, capsys):
    dot = tmp_path / "attention.dot"
    assert main(["inspect", f"{model_file}:Attention", "--input-shape", "2,5,16", "--dot", str(dot)]) == 0
    out = capsys.readouterr().out
    assert "stayed FP32" in out and "softmax" in out
    _assert_fits(out, str(dot))
    nodes, _ = _dot_graph(dot.read_text())
    assert nodes["softmax"] == RULE_COLOURS["FP32"]
    assert CAST_COLOUR in nodes.values()


def test_inspect_o1_without_an_input_shape(model_file, capsys):
    assert main(["inspect", f"{model_file}:Attention", "--opt-level", "O1", "--device-type", "cpu"]) == 0
    assert "amp_fx report: O1" in capsys.readouterr().out


def test_inspect_a_model_with_an_embedding_first_takes_token_ids(model_file, capsys):
    assert main(["inspect", f"{model_file}:TokenModel", "--opt-level", "O2"]) == 0
    out = capsys.readouterr().out
    assert "input: int64 token ids of shape 1,8" in out
    assert re.search(r"^idx +- +- +- +i64 +input", out, flags=re.M)
    assert "idx_to_float16" not in out  # no phantom cast of the integer input
    _assert_fits(out)
    assert main(["inspect", f"{model_file}:TokenModel", "--input-shape", "2,4", "--input-dtype", "long"]) == 0
    out = capsys.readouterr().out
    assert "token ids" not in out and "idx_to_float16" not in out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("torchvision:resnet1", "torchvision has no model 'resnet1'; did you mean resnet18"),
        ("missing_dir/missing.py:Net", "no file 'missing_dir/missing.py'"),
        ("{file}:Atention", "'Atention' is not defined in .*; nn.Module classes there: Attention"),
        ("{file}:NeedsArguments", "could not build .*NeedsArguments with no arguments"),
        ("{file}:torch", "'torch' is not a torch.nn.Module class"),
        ("resnet18", "must be torchvision:NAME, transformers:ClassName, path/to/file.py:ClassName"),
        ("transformers:GPT2LMHeadModl", "no model class 'GPT2LMHeadModl'; did you mean GPT2LMHeadModel"),
        ("{file}:Asserting", "captures at the first call: give --input-shape"),
        ("no_such_package_xyz:Net", "cannot import 'no_such_package_xyz'"),
    ],
)
def test_a_model_that_cannot_be_found_or_built_is_one_clear_line(spec, message, model_file, capsys):
    assert main(["inspect", spec.format(file=model_file)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("amp-fx: error: ")
    assert re.search(message, err)


def test_bad_arguments_exit_with_status_2(capsys):
    for shape in ("1,x", "1,,3", "0,3", ""):
        with pytest.raises(SystemExit) as exit_info:
            main(["inspect", "torchvision:resnet18", "--input-shape", shape])
        assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        main(["inspect", "torchvision:resnet18", "--opt-level", "o2"])
    assert "invalid choice" in capsys.readouterr().err


def test_parse_shape():
    assert parse_shape("1,3,224,224") == parse_shape("1x3x224x224") == (1, 3, 224, 224)


def test_python_dash_m(model_file):
    command = [sys.executable, "-m", "amp_fx", "inspect"]
    result = subprocess.run([*command, f"{model_file}:Attention", "--input-shape", "1,4,16"], **RUN)
    assert result.returncode == 0, result.stderr
    assert "amp_fx report: O2" in result.stdout


def test_dot_of_a_plain_fx_graph():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    text = to_dot(gm)
    nodes, edges = _dot_graph(text)
    assert text.startswith("digraph amp_fx {") and text.rstrip().endswith("}")
    assert set(nodes) == {n.name for n in gm.graph.nodes}
    assert len(edges) == sum(len(n.all_input_nodes) for n in gm.graph.nodes)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "T5ForConditionalGeneration", "CLIPModel"])
def test_inspect_a_transformers_model_reports_its_captured_graph(name, tmp_path, capsys):
    # Built from a small config (decoder, encoder-decoder, text and vision), called once on inputs
    # made from its forward and config: the torch.export front end's graph is reported.
    pytest.importorskip("transformers")
    dot = tmp_path / "graph.dot"
    assert main(["inspect", f"transformers:{name}", "--opt-level", "O2", "--diff", "--dot", str(dot)]) == 0
    out = capsys.readouterr().out
    assert "torch.export front end: 1 graph(s) captured" in out and "100% of the parameters" in out
    assert "amp_fx report: O2" in out and "_to_float16" in out
    nodes, edges = _dot_graph(dot.read_text())
    assert nodes and edges


def test_inspect_a_model_torch_fx_cannot_trace_calls_it_on_the_input_shape(model_file, capsys):
    assert main(["inspect", f"{model_file}:Asserting", "--opt-level", "O1", "--input-shape", "2,8,16"]) == 0
    out = capsys.readouterr().out
    assert "torch.export front end: 1 graph(s) captured" in out and "amp_fx report: O1" in out


def test_inspect_prints_where_the_example_call_ran_first(model_file, tmp_path, capsys):
    # The torch.export front end, fc captured inside an island: fc's product (2*16*16*16 FLOPs) ran
    # in a graph, the island's own product (as many) outside it.
    dot = tmp_path / "branching.dot"
    assert main(["inspect", f"{model_file}:Branching", "--input-shape", "16,16", "--dot", str(dot)]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert re.match(
        r"one call: \d+% of its \d+ ATen ops and 50% of its 16,384 matrix-product FLOPs ran in", first
    )
    assert "  outside, in <model>: " in out and "  island <model>: " in out
    assert "amp_fx report: O2, torch.float16, cpu (1 graph)\n" in out and "autocast islands" in out
    assert out.index("one call:") < out.index("amp_fx report")
    _assert_fits(out, str(dot))
    nodes, _ = _dot_graph(dot.read_text())  # the one captured graph: fc's
    assert nodes and CAST_COLOUR in nodes.values()


def test_inspect_a_traced_model_counts_its_call_when_given_an_input(model_file, capsys):
    assert main(["inspect", f"{model_file}:Attention", "--input-shape", "2,5,16"]) == 0
    out = capsys.readouterr().out
    assert re.match(r"one call: 100% of its \d+ ATen ops and 100% of its [\d,]+ matrix-product FLOPs", out)
    assert "torch.fx front end: 1 graph(s) traced at convert time; 100% of the parameters" in out
    assert main(["inspect", f"{model_file}:Attention", "--device-type", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("ops and FLOPs in rewritten graphs: not counted")


@pytest.mark.parametrize("extra", [[], ["--diff"]])
def test_a_reader_that_closes_early_ends_it_quietly(model_file, extra):
    """``python -m amp_fx inspect ... | head``: the reader is gone before the report is written
    (closed at once, so every write meets a closed pipe); the command stops without a message or
    a traceback and exits with 1, as the Python docs recommend for a broken pipe."""
    command = [
        sys.executable,
        "-m",
        "amp_fx",
        "inspect",
        f"{model_file}:Attention",
        "--input-shape",
        "1,4,16",
    ]
    process = subprocess.Popen([*command, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    _, stderr = process.communicate(timeout=RUN["timeout"])
    assert stderr.decode() == "" and process.returncode == 1
