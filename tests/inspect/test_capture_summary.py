"""amp_fx.capture_summary on both front ends: where one call's ATen ops and matrix-product FLOPs run.

References are computed apart from the summary: FLOPs from the layers' sizes (2*M*N*K per
product), ops by a plain dispatch-mode counter run over the whole call and over each rewritten
graph (or island) alone, on the inputs it received in the call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fx
from amp_fx.inspect.capture_summary import OUTSIDE, capture_summary, captured_graphs
from amp_fx.inspect.report_text import REPORT_WIDTH
from amp_fx.ops.autocast_island import AutocastIsland

BF16 = torch.bfloat16
BATCH = 5


class Routed(nn.Module):
    """torch.export stops at the ``if`` on a value: an island whose own code does one matrix
    product (and a dropout) between two Linear children, which are captured on their own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.mix = nn.Parameter(torch.randn(16, 16) / 4)
        self.other_mix = nn.Parameter(torch.randn(16, 16) / 4)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = h @ (self.mix if h.sum() > 0 else self.other_mix)  # the same ops either way
        return self.fc2(F.dropout(torch.relu(h), 0.1, self.training))


class Gate(nn.Module):
    """torch.fx cannot trace it (a branch on a value); its own code does one matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        self.other_weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight if x.sum() > 0 else self.other_weight)  # the same ops either way


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reads self.training: the fx front end keeps a graph per mode.
        return torch.tanh(self.gate(F.dropout(self.fc(x), 0.1, self.training)))


def _linear_flops(batch: int, layer: nn.Linear) -> int:
    return 2 * batch * layer.in_features * layer.out_features


def _matmul_flops(batch: int, weight: torch.Tensor) -> int:
    return 2 * batch * weight.shape[0] * weight.shape[1]


def _numel(*modules: nn.Module | torch.Tensor) -> int:
    return sum(
        m.numel() if isinstance(m, torch.Tensor) else sum(p.numel() for p in m.parameters()) for m in modules
    )


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(call) -> int:
    counter = _OpCounter()
    with torch.no_grad(), counter:
        call()
    return counter.ops


def _recorded_calls(modules: list[nn.Module], call) -> list[tuple[nn.Module, tuple, dict]]:
    """(module, args, kwargs) of each call of one of ``modules`` during ``call()``."""
    calls = []
    handles = [
        m.register_forward_pre_hook(lambda m, a, k: calls.append((m, a, k)), with_kwargs=True)
        for m in modules
    ]
    try:
        with torch.no_grad():
            call()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _graph_ops(model: nn.Module, x: torch.Tensor) -> int:
    """Ops of running each captured graph alone on the inputs it got in ``model(x)``."""
    calls = _recorded_calls(captured_graphs(model), lambda: model(x))
    assert calls
    with torch.autocast("cpu", enabled=False):  # graphs run outside autocast, as CapturedModel runs them
        return sum(_ops(lambda g=g, a=a, k=k: g(*a, **k)) for g, a, k in calls)


def test_an_island_around_captured_linears_counts_only_their_work_as_in_graphs() -> None:
    torch.manual_seed(0)
    model = Routed()
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    x = torch.randn(BATCH, 8)
    summary = capture_summary(converted, x)

    in_graphs = _linear_flops(BATCH, model.fc1) + _linear_flops(BATCH, model.fc2)
    island = _matmul_flops(BATCH, model.mix)
    assert (summary.call.flops, summary.in_graphs.flops) == (in_graphs + island, in_graphs)
    assert summary.flop_share == in_graphs / (in_graphs + island)
    total_ops = _ops(lambda: converted(x))
    graph_ops = _graph_ops(converted, x)
    assert (summary.call.ops, summary.in_graphs.ops) == (total_ops, graph_ops)
    assert summary.op_share == graph_ops / total_ops < 1.0
    # The rest ran in the model's own code, the island.
    assert set(summary.outside_graphs) == {""} and set(summary.islands) == {""}
    assert summary.outside_graphs[""].flops == island
    assert summary.outside_graphs[""].ops == total_ops - graph_ops
    assert summary.parameter_coverage == _numel(model.fc1, model.fc2) / _numel(model)
    assert summary.graphs == 2 and summary.front_end == "export"


def test_the_shares_come_first_in_the_text() -> None:
    converted = amp_fx.convert(Routed(), "O2", dtype=BF16)
    summary = capture_summary(converted, torch.randn(BATCH, 8))
    lines = str(summary).splitlines()
    assert lines[0].startswith(f"one call: {summary.op_share:.0%} of its {summary.call.ops:,} ATen ops and ")
    assert f"{summary.flop_share:.0%} of its {summary.call.flops:,} matrix-product FLOPs" in lines[0]
    assert f"outside, in <model>: {summary.outside_graphs[''].ops:,} ops" in str(summary)
    assert "island <model>: " in str(summary) and "torch.export front end: 2 graph(s)" in str(summary)
    assert max(len(line) for line in lines) <= REPORT_WIDTH


def test_a_call_that_captures_is_counted_as_the_calls_after_it() -> None:
    # The first call captures (eager checks, fake-tensor tracing): none of that is the call's work.
    converted = amp_fx.convert(Routed(), "O2", dtype=BF16)
    x = torch.randn(BATCH, 8)
    first = capture_summary(converted, x)
    again = capture_summary(converted, x)
    assert (first.call, first.in_graphs, first.outside_graphs) == (
        again.call,
        again.in_graphs,
        again.outside_graphs,
    )
    assert first.graphs == again.graphs == 2


def test_a_fully_captured_model_runs_everything_in_graphs() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    converted = amp_fx.convert(model, "O2", dtype=BF16, front_end="export")
    summary = capture_summary(converted, torch.randn(BATCH, 8))
    assert summary.op_share == summary.flop_share == summary.parameter_coverage == 1.0
    assert summary.call.flops == _linear_flops(BATCH, model[0]) + _linear_flops(BATCH, model[2])
    assert summary.outside_graphs == {} and summary.islands == {}


def test_counting_leaves_the_model_its_mode_its_state_and_the_random_stream() -> None:
    torch.manual_seed(0)
    converted = amp_fx.convert(Routed(), "O2", dtype=BF16).train()
    converted.fc2.eval()  # a submodule in another mode keeps it
    x = torch.randn(BATCH, 8)
    converted(x)
    state = {name: tensor.clone() for name, tensor in converted.state_dict().items()}
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    capture_summary(converted, x)
    assert torch.equal(torch.rand(3), expected)  # the dropout's draws were given back
    assert converted.training and converted.fc1.training and not converted.fc2.training
    assert all(torch.equal(state[name], tensor) for name, tensor in converted.state_dict().items())
    assert all(p.grad is None for p in converted.parameters())


def test_without_arguments_only_what_is_known() -> None:
    converted = amp_fx.convert(Routed(), "O2", dtype=BF16)
    summary = capture_summary(converted)
    assert (summary.graphs, summary.call, summary.op_share, summary.flop_share) == (0, None, None, None)
    assert str(summary).startswith("ops and FLOPs in rewritten graphs: not counted; give a call's arguments")


def test_a_traced_model_runs_everything_in_its_graph() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    gm = amp_fx.convert(model, "O2", dtype=BF16)
    assert isinstance(gm, torch.fx.GraphModule)
    x = torch.randn(BATCH, 8)
    summary = capture_summary(gm, x)
    assert summary.front_end == "fx" and summary.graphs == 1 and summary.capture_seconds == []
    assert summary.op_share == summary.flop_share == summary.parameter_coverage == 1.0
    assert summary.call.ops == _ops(lambda: gm(x))
    assert summary.islands == {} and summary.outside_graphs == {}
    assert (
        str(summary).splitlines()[1].startswith("torch.fx front end: 1 graph(s) traced at convert time; 100%")
    )


@pytest.mark.parametrize("mode", ["traced", "other"])
def test_a_traced_model_with_an_opaque_module_counts_its_island_outside(mode: str) -> None:
    torch.manual_seed(0)
    model = Gated().eval()
    gm = amp_fx.convert(model, "O2", dtype=BF16)
    if mode == "other":
        gm.train()  # runs the train-mode graph, which gm.graph is not
    x = torch.randn(BATCH, 8)
    summary = capture_summary(gm, x)

    graph, island = _linear_flops(BATCH, model.fc), _matmul_flops(BATCH, model.gate.weight)
    assert (summary.call.flops, summary.in_graphs.flops) == (graph + island, graph)
    assert summary.flop_share == graph / (graph + island)
    # The island: the gate, run by an AutocastIsland (or, captured with torch.export, its own).
    runners = [*(m for m in gm.modules() if isinstance(m, AutocastIsland)), gm.gate]
    runner, args, kwargs = _recorded_calls(runners, lambda: gm(x))[0]
    gm(x)  # the hook put on the gate and taken off is a change: followed here, not in the counts below
    island_ops, total_ops = _ops(lambda: runner(*args, **kwargs)), _ops(lambda: gm(x))
    assert (summary.call.ops, summary.in_graphs.ops) == (total_ops, total_ops - island_ops)
    assert summary.outside_graphs["gate"].flops == island and summary.outside_graphs["gate"].ops == island_ops
    assert set(summary.islands) == {"gate"} and "x.sum() > 0 else" in summary.islands["gate"]
    assert summary.parameter_coverage == _numel(model.fc) / _numel(model)
    assert summary.graphs == 2  # one per mode


def test_a_plain_module_is_refused_with_the_fix() -> None:
    with pytest.raises(
        TypeError, match=r"got Linear; convert it first: amp_fx.capture_summary\(amp_fx.convert"
    ):
        capture_summary(nn.Linear(2, 2), torch.randn(1, 2))
    with pytest.raises(TypeError, match="convert it first"):
        captured_graphs(nn.Linear(2, 2))


def test_a_gpt2_default_call_counts_its_islands_work_outside() -> None:
    # With use_cache=True a DynamicCache crosses module boundaries: while that makes islands, their
    # own code (attention, masks, residual stream) is counted outside, which parameters hide.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    converted = amp_fx.convert(transformers.GPT2LMHeadModel(config), "O2", dtype=BF16)
    ids = torch.randint(0, 128, (2, 8))
    summary = capture_summary(converted, input_ids=ids, labels=ids)
    assert summary.call.ops == _ops(lambda: converted(input_ids=ids, labels=ids))
    outside = sum(work.ops for work in summary.outside_graphs.values())
    assert summary.in_graphs.ops + outside == summary.call.ops
    assert (summary.op_share < 1.0) == bool(summary.islands)
    assert set(summary.outside_graphs) <= {*summary.islands, OUTSIDE}


class _GroupedQueryAttention(nn.Module):
    def forward(self, query, key, value):
        return F.scaled_dot_product_attention(query, key, value, enable_gqa=True)


def test_grouped_query_attention_counts_as_its_repeated_heads():
    """Key and value with fewer heads than the query: Q @ K^T and P @ V for every query head."""
    batch, heads, kv_heads, length, dim = 2, 4, 2, 8, 16
    query = torch.randn(batch, heads, length, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    converted = amp_fx.convert(_GroupedQueryAttention(), "O1", dtype=torch.bfloat16, front_end="export")
    summary = capture_summary(converted, query, key, value)
    assert summary.call.flops == 2 * 2 * batch * heads * length * length * dim
