"""amp_fx.watch: what it records is what the graph computes (each node's value and gradient,
counted again in Python), the watched model computes the same bits, the graph is as it was once the
watch is removed, and the step runs without reading the device."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.inspect.ranges import DEFAULT_EVERY, NodeRange, is_range_record
from tests.inspect.graph_values import python_statistics, values_in_graph_dtypes


class Mlp(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(4, width)
        self.down = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = h * torch.sigmoid(h)
        scores = h @ h.transpose(-1, -2)
        return self.down(h + scores.mean(-1, keepdim=True)).square()


class InPlace(nn.Module):
    """A ReLU in place on a watched value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))


class Dropping(nn.Module):
    """Reads self.training: a graph per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h * 2 if self.training else h - 1


def _inputs(seed: int = 0, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed)) * 3


def _converted(
    model: nn.Module, dtype: torch.dtype = torch.float16, level: str = "O2"
) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return amp_fx.convert(model, level, dtype=dtype, device_type="cpu", front_end="fx")


def _by_node(ranges: list[NodeRange]) -> dict[str, NodeRange]:
    return {r.node: r for r in ranges}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_recorded_statistics_are_the_values_and_gradients(dtype, level) -> None:
    gm = _converted(Mlp(), dtype, level)
    expected = values_in_graph_dtypes(copy.deepcopy(gm), _inputs(), loss_scale=1000.0)
    watch = amp_fx.watch(gm)
    (gm(_inputs()) * 1000.0).sum().backward()
    recorded = _by_node(watch.ranges())
    assert recorded, "nothing watched"
    low = {name for name, value in expected.values.items() if value.dtype == dtype}
    # Every value computed low is watched, but views and parameter casts.
    assert set(recorded) <= low and {"up", "mul", "matmul", "down"} <= set(recorded)
    for name, node in recorded.items():
        value = expected.values[name]
        assert node.dtype == dtype
        assert (node.forward.amax, node.forward.underflow, node.forward.nonfinite, node.forward.numel) == (
            python_statistics(value, dtype)
        ), name
        grad = expected.grads.get(name)
        if grad is None:
            assert not node.backward.recorded, name
        else:
            stats = node.backward
            assert (stats.amax, stats.underflow, stats.nonfinite, stats.numel) == python_statistics(
                grad, dtype
            )


def test_statistics_accumulate_over_steps_and_steps_are_kept_apart() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm, history=2, every=1)
    scales = [1.0, 5.0, 2.0]
    for scale in scales:
        gm(_inputs() * scale).sum().backward()
    assert watch.steps == [1, 2]  # the history keeps the last two
    runs = [values_in_graph_dtypes(copy.deepcopy(gm), _inputs() * scale) for scale in scales]
    totals = _by_node(watch.ranges())
    for step in watch.steps:
        for name, node in _by_node(watch.ranges(step)).items():
            assert node.forward.amax == python_statistics(runs[step].values[name], torch.float16)[0]
    for name, node in totals.items():
        assert node.forward.amax == max(python_statistics(run.values[name], torch.float16)[0] for run in runs)
        assert node.forward.numel == 3 * runs[0].values[name].numel()
    with pytest.raises(ValueError, match="step 0 is not among the recorded steps kept"):
        watch.ranges(0)


def test_every_n_steps_records_those_steps_only() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm, every=3)
    for _ in range(7):
        gm(_inputs()).sum().backward()
    assert watch.steps == [0, 3, 6]
    assert _by_node(watch.ranges())["up"].forward.numel == 3 * 5 * 8


def test_the_default_records_every_sixteenth_step_and_every_can_change() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm, history=8)
    for _ in range(DEFAULT_EVERY + 1):
        gm(_inputs()).sum().backward()
    assert DEFAULT_EVERY == 16 and watch.every == 16 and watch.steps == [0, 16]
    watch.every = 1  # from the next step on: every step
    for _ in range(2):
        gm(_inputs()).sum().backward()
    assert watch.steps == [0, 16, 17, 18]
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        watch.every = 0
    assert watch.every == 1


def test_order_is_forward_in_graph_order_then_backward() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm)
    gm(_inputs()).sum().backward()
    order = watch.order(watch.steps[-1])
    forward = [name for _, name, direction in order if direction == 0]
    backward = [name for _, name, direction in order if direction == 1]
    watched = [r.node for r in watch.ranges()]
    assert forward == watched  # graph order
    assert order[: len(forward)] == [("<model>", name, 0) for name in forward]
    assert backward[0] == watched[-1] and set(backward) <= set(watched)


@pytest.mark.parametrize("model", [Mlp, InPlace, Dropping])
def test_watched_model_computes_the_same_bits(model) -> None:
    gm = _converted(model())
    twin = copy.deepcopy(gm)
    amp_fx.watch(gm)
    for mode in ("train", "eval", "train"):
        for module in (gm, twin):
            getattr(module, mode)()
            module.zero_grad()
        outputs = [module(_inputs()) for module in (gm, twin)]
        assert torch.equal(outputs[0], outputs[1])
        for output in outputs:
            (output * 100).sum().backward()
        for (name, p), q in zip(gm.named_parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name


def test_removing_the_watch_leaves_the_code_as_it_was() -> None:
    gm = _converted(Dropping())
    code, other = gm.code, gm.meta["amp_fx_other_mode_graph"][1].python_code("self").src
    watch = amp_fx.watch(gm)
    assert gm.code != code and any(is_range_record(n) for n in gm.graph.nodes)
    gm(_inputs()).sum().backward()
    watch.remove()
    assert gm.code == code
    assert gm.meta["amp_fx_other_mode_graph"][1].python_code("self").src == other
    assert not any(is_range_record(n) for n in gm.graph.nodes)
    assert watch.ranges()  # still readable
    amp_fx.watch(gm).remove()  # a model can be watched again
    assert gm.code == code


def test_both_mode_graphs_record() -> None:
    gm = _converted(Dropping())
    watch = amp_fx.watch(gm, every=1)
    gm.train()(_inputs())
    gm.eval()(_inputs())
    fc = _by_node(watch.ranges())["fc"]
    assert fc.forward.numel == 2 * 5 * 4


def test_the_step_reads_nothing_on_the_host(monkeypatch) -> None:
    gm = _converted(Mlp())
    amp_fx.watch(gm)
    x = _inputs()

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host during the step")

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    (gm(x) * 8.0).sum().backward()
    monkeypatch.undo()


def test_watch_export_front_end_before_and_after_its_first_call() -> None:
    torch.manual_seed(0)
    model = amp_fx.convert(Mlp(), "O2", device_type="cpu", front_end="export")
    watch = amp_fx.watch(model)  # no graph yet: the capture is watched
    model(_inputs()).sum().backward()
    ranges = watch.ranges()
    assert ranges and {r.graph for r in ranges} == {"<model>"}
    expected = values_in_graph_dtypes(copy.deepcopy(amp_fx.report(model).graphs["<model>"]), _inputs())
    for node in ranges:
        assert node.forward.amax == python_statistics(expected.values[node.node], torch.float16)[0]
    model(_inputs(rows=7)).sum().backward()  # another size: a second (dynamic) graph, watched too
    assert len(amp_fx.report(model).graphs) == 2
    assert {r.graph for r in watch.ranges()} == {"<model>", "<model> #2"}
    codes = [gm.code for gm in amp_fx.report(model).graphs.values()]
    watch.remove()
    assert all(code != gm.code for code, gm in zip(codes, amp_fx.report(model).graphs.values(), strict=True))
    assert not any(is_range_record(n) for gm in amp_fx.report(model).graphs.values() for n in gm.graph.nodes)


def test_a_change_after_the_watch_is_watched_too() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm, every=1)
    gm(_inputs())
    gm.down = nn.Linear(8, 3).half()  # a leaf replaced: the follower rewrites the graph
    gm(_inputs()).sum().backward()
    assert _by_node(watch.ranges())["down"].backward.recorded
    assert any(is_range_record(n) for n in gm.graph.nodes)


def test_pause_reset_and_copies() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm, every=1)
    watch.pause()
    gm(_inputs())
    assert watch.steps == [] and not any(r.forward.recorded for r in watch.ranges())
    watch.resume()
    gm(_inputs())
    copied = copy.deepcopy(gm)
    copied(_inputs() * 100)  # records apart from the original
    assert _by_node(watch.ranges())["up"].forward.numel == 5 * 8
    copied_watch = amp_fx.watch(copied, every=1)  # watched on its own, its copied recording calls replaced
    copied(_inputs())
    assert _by_node(copied_watch.ranges())["up"].forward.numel == 5 * 8
    assert sum(is_range_record(n) for n in copied.graph.nodes) == sum(
        is_range_record(n) for n in gm.graph.nodes
    )
    loaded = pickle.loads(pickle.dumps(gm))
    assert torch.equal(loaded(_inputs()), gm(_inputs()))
    watch.reset()
    assert watch.steps == [] and not any(r.forward.recorded for r in watch.ranges())


def test_bad_arguments_are_refused() -> None:
    gm = _converted(Mlp())
    with pytest.raises(TypeError, match="expects a model returned by amp_fx.convert"):
        amp_fx.watch(Mlp())
    for keyword, value in (("every", 0), ("history", 0), ("every", 1.5)):
        with pytest.raises(ValueError, match=f"{keyword} must be an int >= 1"):
            amp_fx.watch(gm, **{keyword: value})
    with pytest.raises(ValueError, match="nodes must be one of"):
        amp_fx.watch(gm, nodes="fp16")
    amp_fx.watch(gm)
    with pytest.raises(ValueError, match="watched already"):
        amp_fx.watch(gm)
    assert amp_fx.watching(gm) is not None


def test_all_nodes_records_float32_values_too() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm, nodes="all")
    gm(_inputs()).sum().backward()
    dtypes = {r.node: r.dtype for r in watch.ranges()}
    assert torch.float32 in dtypes.values() and torch.float16 in dtypes.values()
    assert dtypes["square_to_float32"] == torch.float32  # the output's cast, watched now


def test_source_lines_name_the_users_code() -> None:
    gm = _converted(Mlp())
    watch = amp_fx.watch(gm)
    gm(_inputs())
    matmul = _by_node(watch.ranges())["matmul"]
    assert matmul.source is not None and "test_ranges.py" in matmul.source
    assert "h @ h.transpose(-1, -2)" in matmul.source and matmul.module == ""
    assert _by_node(watch.ranges())["up"].module == "up"


def test_functional_models_too() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return F.linear(x, self.w).exp()

    gm = _converted(Functional(), level="O3")
    watch = amp_fx.watch(gm)
    gm(_inputs()).sum().backward()
    assert {"linear", "exp"} <= {r.node for r in watch.ranges()}


def test_the_triton_kernel_records_what_the_reference_records(triton_calls, monkeypatch) -> None:
    from amp_fx.kernels import FORCE_TRITON_ENV

    results = []
    for force in ("1", "0"):
        monkeypatch.setenv(FORCE_TRITON_ENV, force)
        gm = _converted(Mlp())
        watch = amp_fx.watch(gm)
        (gm(_inputs()) * 1e4).sum().backward()
        results.append([r.to_dict() for r in watch.ranges()])
    assert triton_calls["record_range_"] > 0
    assert results[0] == results[1]


class Gated(nn.Module):
    """torch.export stops at the `if`: the model runs as an island, its part `fc` is captured."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


def test_a_model_whose_own_call_is_an_island_counts_steps_by_the_backward() -> None:
    torch.manual_seed(0)
    model = amp_fx.convert(Gated(), "O2", device_type="cpu", front_end="export")
    watch = amp_fx.watch(model, every=2)
    for _ in range(4):
        x = _inputs().abs()
        model(x).sum().backward()  # fc runs once a step
    assert watch.steps == [0, 2]
    fc = _by_node(watch.ranges())["linear"]
    assert fc.graph == "fc" and fc.module == "fc"
    assert fc.forward.numel == 2 * 5 * 4 and fc.backward.numel == 2 * 5 * 4
