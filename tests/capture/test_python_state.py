"""Python a graph cannot record is found at capture and reported once, naming the line and the fix,
on both front ends (issue 35): Python's ``random`` (module functions, a ``random.Random`` of the
user's, ``numpy.random``), ``time``, an attribute assigned in forward. Each capture leaves the
attribute as it found it. What does not freeze a decision (``torch.rand``, an attribute set to the
value it holds, library code such as ``logging`` reading the time) is not reported.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import amp_fx

FRONT_ENDS = ("fx", "export")
LOGGER = "amp_fx.capture.python_state"
_RNG = random.Random(0)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.step = 0
        self.scale = 1.0


class LayerDrop(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if random.random() < 0.5:  # FLAGGED
                x = layer(x)
        return x


class PickLayer(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[random.randint(0, 2)](x)  # FLAGGED


class ChooseLayer(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return random.choice(list(self.layers))(x)  # FLAGGED


class OwnGenerator(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * _RNG.uniform(0.5, 1.5)  # FLAGGED


class NumpyNoise(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x) * float(np.random.rand())  # FLAGGED


class Timed(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warm = time.perf_counter() % 2 > 1  # FLAGGED
        return self.layers[0](x) if warm else self.layers[1](x)


class Clock(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + time.monotonic_ns() % 7  # FLAGGED


class IntCounter(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step = self.step + 1  # FLAGGED
        return self.layers[0](x) * self.step


class ShapeKept(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batch = x.shape[0]  # FLAGGED
        return self.layers[0](x)


class ScaleDecay(_Model):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.layers[1].scale = getattr(self.layers[1], "scale", 1.0) * 0.5  # FLAGGED
        return self.layers[0](x)


FLAGGED = (
    LayerDrop,
    PickLayer,
    ChooseLayer,
    OwnGenerator,
    NumpyNoise,
    Timed,
    Clock,
    IntCounter,
    ShapeKept,
    ScaleDecay,
)
KIND = {
    "Timed": "time",
    "Clock": "time",
    "IntCounter": "attribute",
    "ShapeKept": "attribute",
    "ScaleDecay": "attribute",
}
FIX = {"random": "torch.rand", "time": "outside the model's forward", "attribute": "register_buffer"}


def _flagged_line(cls: type) -> int:
    import inspect

    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if "# FLAGGED" in line)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def _plain(model: nn.Module) -> dict[str, dict[str, object]]:
    return {
        path: {
            k: v
            for k, v in vars(m).items()
            if type(v) in (int, float, bool) and not k.startswith("_") and k != "training"
        }
        for path, m in model.named_modules()
    }


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("cls", FLAGGED, ids=lambda c: c.__name__)
def test_reported_once_with_line_and_fix(cls: type, front_end: str, caplog: pytest.LogCaptureFixture) -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = cls()
    before = _plain(model)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16, device_type="cpu", front_end=front_end)
    x = torch.randn(2, 4)
    converted(x)  # the export front end captures here, before its graph runs
    records = _warnings(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert f"{Path(__file__).name}:{_flagged_line(cls)}" in message
    assert FIX[KIND.get(cls.__name__, "random")] in message
    for _ in range(3):
        converted(x)
    converted.train(False)(x)  # another capture (export): nothing new to report
    assert len(_warnings(caplog)) == 1
    # The capture put back what it assigned: the model and the converted copy are as they were.
    assert _plain(model) == before
    if front_end == "export":
        assert _plain(converted) == before


def test_layer_drop_is_reported_before_it_trains_frozen(caplog: pytest.LogCaptureFixture) -> None:
    """The issue's case: eager draws a new set of layers per call, the graph keeps one; the
    warning is logged by convert (torch.fx), before a step runs on the frozen decision."""
    random.seed(0)
    torch.manual_seed(0)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    model = LayerDrop()
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16, device_type="cpu", front_end="fx")
    assert len(_warnings(caplog)) == 1
    x = torch.randn(2, 4)
    eager = {tuple(model(x).flatten().tolist()) for _ in range(12)}
    graph = {tuple(converted(x).flatten().tolist()) for _ in range(12)}
    assert len(eager) > 1 and len(graph) == 1


_log = logging.getLogger("tests.untraceable")


class TorchLayerDrop(_Model):
    def __init__(self) -> None:
        super().__init__()
        self.flag = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.flag = True  # the value it holds: nothing changes
        _log.info("forward on %s", x.shape)  # logging stamps the record with time.time()
        keep = (torch.rand(()) >= 0.5).to(x.dtype)  # a graph op: drawn anew on every call
        return x + keep * self.layers[0](x)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_what_does_not_freeze_is_not_reported(front_end: str, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    caplog.set_level(logging.INFO)
    converted = amp_fx.convert(
        TorchLayerDrop(), "O1", dtype=torch.bfloat16, device_type="cpu", front_end=front_end
    )
    x = torch.randn(2, 4)
    outputs = {tuple(converted(x).flatten().tolist()) for _ in range(12)}
    assert not _warnings(caplog)
    assert len(outputs) == 2  # both branches of the torch.rand decision ran


def test_random_outside_a_capture_is_not_touched() -> None:
    """The patches live only while a capture runs."""
    functions = (random.random, random.Random.uniform, time.time, np.random.rand, nn.Module.__setattr__)
    amp_fx.convert(LayerDrop(), "O1", dtype=torch.bfloat16, device_type="cpu", front_end="fx")
    assert (
        random.random,
        random.Random.uniform,
        time.time,
        np.random.rand,
        nn.Module.__setattr__,
    ) == functions


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_librarys_one_time_setup_is_kept_and_not_reported(
    level: str, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers installs its output-capturing hooks at a model's first call and marks the model
    (``_output_capturing_hooks_installed``). Putting that mark back after the capture would install
    the hooks again at the next call and every hidden state would be recorded twice."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16, output_hidden_states=True
    )
    eager = transformers.GPT2LMHeadModel(config).eval()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    converted = amp_fx.convert(eager, level, dtype=torch.bfloat16, device_type="cpu")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        expected = len(eager(input_ids=ids).hidden_states)
        counts = [len(converted(input_ids=ids).hidden_states) for _ in range(3)]
    assert counts == [expected] * 3
    assert _warnings(caplog) == []
