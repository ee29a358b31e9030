"""amp_fx.find_overflow names the node a float64 rerun of the same graph says overflowed first.

Each model overflows fp16 at one kind of op (a matmul, exp as in a softmax without its max
subtracted, pow, a sum reduction, the loss), in the forward or, with the loss scale, only in the
backward. The reference runs the converted graph's own ops with every value in float64 (casts left
out, `tests.inspect.graph_values`) and takes the first node computing in fp16 whose value (in graph
order) or gradient (in the order autograd completed them) passes fp16's largest finite value.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.op_facts import VIEW_OPS
from amp_fx.inspect.overflow import Overflow
from tests.inspect.graph_values import values_in_float64, values_in_graph_dtypes

LOW = torch.float16
LIMIT = torch.finfo(LOW).max


def _constant_linear(n_in: int, n_out: int, value: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.constant_(layer.weight, value)
    nn.init.zeros_(layer.bias)
    return layer


class TwoLinears(nn.Module):
    def __init__(self, first: float, second: float) -> None:
        super().__init__()
        self.fc1, self.fc2 = _constant_linear(8, 8, first), _constant_linear(8, 8, second)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class Exp(nn.Module):
    """A softmax written without subtracting the maximum (``then="softmax"``), or exp then a mean."""

    def __init__(self, weight: float, then: str) -> None:
        super().__init__()
        self.fc, self.then = _constant_linear(8, 8, weight), then

    def forward(self, x):
        e = torch.exp(self.fc(x))
        return e / e.sum(-1, keepdim=True) if self.then == "softmax" else e.mean(-1)


class Pow(nn.Module):
    def __init__(self, weight: float, exponent: int) -> None:
        super().__init__()
        self.fc, self.exponent = _constant_linear(8, 8, weight), exponent

    def forward(self, x):
        return self.fc(x).pow(self.exponent).mean(-1)


class Sum(nn.Module):
    def __init__(self, width: int, weight: float, factor: float) -> None:
        super().__init__()
        self.fc, self.factor = _constant_linear(8, width, weight), factor

    def forward(self, x):
        return self.fc(x).sum(-1) * self.factor


class Loss(nn.Module):
    """A model that returns its own loss."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.fc = _constant_linear(8, 16, weight)

    def forward(self, x, target):
        return F.mse_loss(self.fc(x), target, reduction="sum")


@dataclass
class Case:
    build: Callable[[], nn.Module]
    level: str
    x: float  # every input element
    loss_scale: float
    # What find_overflow must say, besides the node (which the float64 rerun decides).
    direction: str
    cause: str
    op: str  # the located node's op (forward) or its consumer's (backward)
    target: bool = False  # the model takes a target of zeros


CASES = {
    # 8 x 100 x 100 = 80000 in the first matmul.
    "matmul-forward": Case(lambda: TwoLinears(100.0, 1.0), "O2", 100.0, 1.0, "forward", "values", "linear"),
    # fc2's backward: 8 x 64 x 200 = 102400 flowing back into fc1.
    "matmul-backward": Case(
        lambda: TwoLinears(100.0, 200.0), "O2", 0.01, 64.0, "backward", "loss scale", "linear"
    ),
    # exp(12) = 162755: a softmax without its maximum subtracted.
    "exp-forward": Case(lambda: Exp(1.5, "softmax"), "O3", 1.0, 1.0, "forward", "values", "exp"),
    # exp's backward: 4 x exp(10) = 88106 flowing back into fc.
    "exp-backward": Case(lambda: Exp(1.25, "mean"), "O3", 1.0, 4 * 32.0, "backward", "loss scale", "exp"),
    # 50^3 = 125000.
    "pow-forward": Case(lambda: Pow(6.25, 3), "O3", 1.0, 1.0, "forward", "values", "pow"),
    # pow's backward: 200 x 2 x 200 = 80000 flowing back into fc.
    "pow-backward": Case(lambda: Pow(25.0, 2), "O3", 1.0, 4 * 1600.0, "backward", "loss scale", "pow"),
    # 1024 values of 100 summed.
    "sum-forward": Case(lambda: Sum(1024, 12.5, 1.0), "O3", 1.0, 1.0, "forward", "values", "sum"),
    # The gradient into the sum: 1024 x 300 = 307200.
    "sum-backward": Case(lambda: Sum(8, 1.25, 300.0), "O3", 1.0, 1024.0, "backward", "loss scale", "mul"),
    # 4 x 16 squares of 100: 640000 in the loss.
    "loss-forward": Case(lambda: Loss(12.5), "O3", 1.0, 1.0, "forward", "values", "mse_loss", target=True),
    # The FP32 loss's backward at a scale of 2^20: 2 x 100 x 2^20 flowing into fc.
    "loss-backward": Case(
        lambda: Loss(12.5), "O2", 1.0, 2.0**20, "backward", "loss scale", "to", target=True
    ),
}


def _inputs(case: Case) -> tuple[torch.Tensor, ...]:
    x = torch.full((4, 8), case.x)
    return (x, torch.zeros(4, 16)) if case.target else (x,)


def _converted(case: Case, front_end: str) -> nn.Module:
    torch.manual_seed(0)
    return amp_fx.convert(case.build(), case.level, dtype=LOW, device_type="cpu", front_end=front_end)


def _graph(model: nn.Module) -> torch.fx.GraphModule:
    """The model's one graph (either front end)."""
    (graph,) = amp_fx.report(model).graphs.values()
    return graph


def float64_first_overflow(gm: torch.fx.GraphModule, inputs, loss_scale: float) -> tuple[str, str]:
    """(node, direction) of the first node computing in fp16 whose value (graph order) or gradient
    (autograd's order) passes fp16's largest finite value when the graph runs in float64."""
    in_low = values_in_graph_dtypes(copy.deepcopy(gm), *inputs, loss_scale=loss_scale)
    computed_low = {
        n.name
        for n in gm.graph.nodes
        if n.name in in_low.values
        and in_low.values[n.name].dtype == LOW
        and node_info(n).op not in VIEW_OPS
        and not (node_info(n).is_cast and n.args[0].op == "get_attr")
    }
    reference = values_in_float64(copy.deepcopy(gm), *inputs, loss_scale=loss_scale)
    for name, value in reference.values.items():
        if name in computed_low and value.abs().max() > LIMIT:
            return name, "forward"
    for name in reference.grad_order:
        if name in computed_low and reference.grads[name].abs().max() > LIMIT:
            return name, "backward"
    raise AssertionError("the float64 rerun overflows nowhere: the case is built wrong")


def _train_step(model: nn.Module, inputs, loss_scale: float) -> None:
    (model(*inputs) * loss_scale).sum().backward()


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_located_node_is_the_float64_reruns_first_overflow(name, front_end) -> None:
    case = CASES[name]
    model = _converted(case, front_end)
    inputs = _inputs(case)
    unwatched = copy.deepcopy(_graph(model)) if front_end == "fx" else None
    amp_fx.watch(model)
    _train_step(model, inputs, case.loss_scale)
    found = amp_fx.find_overflow(model)
    assert isinstance(found, Overflow)
    gm = unwatched if unwatched is not None else _graph(model)
    expected = float64_first_overflow(gm, inputs, case.loss_scale)
    assert (found.node.node, found.direction) == expected
    assert found.cause == case.cause and found.step == 0
    assert found.stats.overflowed
    if case.direction == "forward":
        assert found.direction == "forward" and found.node.op == case.op
        assert found.inputs and all(not entry.stats or not entry.stats.overflowed for entry in found.inputs)
    else:
        assert found.direction == "backward"
        assert any(f"({case.op})" in consumer for consumer in found.consumers), found.consumers
    text = str(found)
    assert found.node.node in text and case.cause in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_source_lines_and_inputs_name_the_users_code() -> None:
    case = CASES["exp-forward"]
    model = _converted(case, "fx")
    amp_fx.watch(model)
    _train_step(model, _inputs(case), 1.0)
    found = amp_fx.find_overflow(model)
    assert found.node.node == "exp" and "torch.exp(self.fc(x))" in found.node.source
    assert "test_overflow.py" in found.node.source
    assert [(entry.name, entry.kind) for entry in found.inputs] == [("fc", "value")]
    assert found.inputs[0].stats.amax == 12.0
    assert found.later and found.later[0][1].startswith("sum")


def test_the_newest_overflowing_step_is_reported_and_clean_steps_give_none() -> None:
    model = _converted(CASES["matmul-forward"], "fx")
    watch = amp_fx.watch(model, every=1)
    model(torch.full((4, 8), 0.01)).sum().backward()
    assert amp_fx.find_overflow(model) is None
    model(torch.full((4, 8), 100.0)).sum().backward()  # step 1 overflows
    model(torch.full((4, 8), 0.01)).sum().backward()  # step 2 is clean again
    found = amp_fx.find_overflow(model)
    assert found.step == 1 and watch.steps == [0, 1, 2]
    assert amp_fx.find_overflow(model, step=2) is None


def test_an_unwatched_model_is_refused() -> None:
    model = _converted(CASES["matmul-forward"], "fx")
    with pytest.raises(ValueError, match=r"call amp_fx.watch\(model\) before training"):
        amp_fx.find_overflow(model)


def test_gradient_accumulation_finds_the_micro_step_that_overflowed() -> None:
    model = _converted(CASES["matmul-forward"], "fx")
    amp_fx.watch(model, every=1)
    for x in (0.01, 100.0, 0.01, 0.01):  # the second of four micro-steps overflows
        model(torch.full((4, 8), x)).sum().backward()
    assert amp_fx.find_overflow(model).step == 1


def test_a_step_the_loss_scaler_skipped_is_explained_by_the_loss_scale() -> None:
    torch.manual_seed(0)
    model = amp_fx.convert(TwoLinears(0.5, 0.5), "O2", dtype=LOW, device_type="cpu")
    optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    scaler = amp_fx.LossScaler(init_scale=2.0**24)  # far too large: the first step skips
    amp_fx.watch(model)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(4, 8)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))  # skipped
    found = amp_fx.find_overflow(model)
    assert found.cause == "loss scale" and found.direction == "backward"
    assert scaler.get_scale() == 2.0**23
