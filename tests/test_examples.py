"""Each example runs a couple of steps on CPU (examples/*.py, through their main(argv)), and README.md's
Python snippets run as written."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys

import pytest
import torch

import amp_fx.amp._state as amp_state
from amp_fx.inspect.report import REPORT_WIDTH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def load_example(name: str):
    """Import examples/<name>.py as a module (the examples are programs, not a package)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # demo.py imports gpt.py next to it
    spec = importlib.util.spec_from_file_location(
        f"amp_fx_example_{name}", os.path.join(EXAMPLES, f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def fresh_amp_state():
    amp_state._current = None
    yield
    amp_state._current = None


def test_apex_quickstart(tmp_path, capsys):
    checkpoint = tmp_path / "model.pth"
    accuracy = load_example("apex_quickstart").main(["--epochs", "1", "--checkpoint", str(checkpoint)])
    assert 0.0 <= accuracy <= 100.0
    state = torch.load(checkpoint, weights_only=True)
    assert {v.dtype for v in state.values()} == {torch.float32}  # the O2 model saved FP32 weights
    assert "reloaded FP32 model" in capsys.readouterr().out


def test_cifar10_resnet18_on_the_synthetic_stand_in(tmp_path, capsys):
    args = ["--data-dir", str(tmp_path), "--opt-level", "O2", "--dtype", "bf16", "--batch-size", "4"]
    results = load_example("cifar10_resnet18").main([*args, "--max-steps", "2", "--synthetic-size", "16"])
    out = capsys.readouterr().out
    assert "CIFAR-10 not found at" in out and "synthetic stand-in" in out
    assert "Epoch: 1" in out and "Test accuracy" in out
    assert math.isfinite(results["train_loss"]) and 0 <= results["test_accuracy"] <= 100
    # ln(10) = 2.3 is chance; stale BatchNorm statistics and lr 0.1 gave test losses in the thousands.
    assert results["test_loss"] < 5


def test_gpt_with_fp16_loss_scaling(capsys):
    model = ["--n-layer", "1", "--batch-size", "4", "--block-size", "32", "--corpus-bytes", "20000"]
    run = ["--opt-level", "O2", "--dtype", "fp16", "--steps", "3", "--sample", "8", "--log-every", "1"]
    history = load_example("gpt").main([*model, *run])
    assert len(history["loss"]) == len(history["scale"]) == 3
    assert all(math.isfinite(v) for v in history["loss"])
    assert history["scale"][0] in (65536.0, 32768.0)  # fp16 O2: dynamic loss scaling is on
    out = capsys.readouterr().out
    assert "loss-scale history" in out and "standard library" in out
    sample = out.split("sample: ", 1)[1].splitlines()[0]
    assert sample.strip("' ") != "def", "the sample is blank"  # greedy decoding gave only spaces


def test_gpt_plot_needs_matplotlib_only_when_asked(tmp_path):
    gpt = load_example("gpt")
    model = ["--n-layer", "1", "--batch-size", "2", "--block-size", "16", "--corpus-bytes", "5000"]
    args = [
        *model,
        "--opt-level",
        "O1",
        "--steps",
        "1",
        "--sample",
        "0",
        "--plot",
        str(tmp_path / "history.png"),
    ]
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.raises(SystemExit, match="pip install matplotlib"):
            gpt.main(args)
    else:
        gpt.main(args)
        assert (tmp_path / "history.png").stat().st_size > 0


def test_demo(capsys):
    demo = load_example("demo")
    losses = demo.main(["--steps", "2", "--batch-size", "4"])
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    out = capsys.readouterr().out
    assert "amp_fx report: O2" in out and "stayed FP32" in out
    assert "--full-report" in out and "\nnode " not in out  # the summary, not the per-node table
    demo.main(["--steps", "1", "--batch-size", "2", "--full-report"])
    full = capsys.readouterr().out
    assert "\nnode " in full
    for text in (out, full):
        assert [line for line in text.splitlines() if len(line) > REPORT_WIDTH] == []


def test_ddp_without_torchrun_says_how_to_run_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["ddp_torchrun.py"])
    with pytest.raises(SystemExit, match="torchrun --nproc_per_node=2 examples/ddp_torchrun.py"):
        load_example("ddp_torchrun").main()


def test_readme_python_snippets_run_in_order(capsys):
    """README.md says its snippets run in order as one script on a CPU: they do. Its trainer
    sections need the trainer libraries `make test` installs."""
    for library in ("lightning", "accelerate"):
        pytest.importorskip(library)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        snippets = re.findall(r"```python\n(.*?)```", readme.read(), flags=re.S)
    assert len(snippets) >= 5
    namespace: dict = {"__name__": "readme"}
    for snippet in snippets:
        exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102
    assert "amp_fx_ops_casts_cast_if_floating(input_1, torch.bfloat16)" in capsys.readouterr().out
