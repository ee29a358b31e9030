"""A whole O2 training step: no host sync, CUDA-graph capture and replay, overflow skipped on device.

The GPU tests check the properties the design promises for a step built from amp_fx's parts
(LossScaler + fused optimizer + converted model); the CPU tests check `CudaGraphStep`'s eager
path against the hand-written loop and its argument errors.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.optim import master_params
from amp_fx.testing import assert_close_normwise, tolerances
from amp_fx.training.cuda_graph_step import CudaGraphStep

IN_FEATURES, CLASSES, BATCH = 16, 4, 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 32),
        nn.LayerNorm(32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, CLASSES),
    )


def make_batches(n: int, device: str | torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, IN_FEATURES, generator=generator).to(device),
            torch.randint(0, CLASSES, (BATCH,), generator=generator).to(device),
        )
        for _ in range(n)
    ]


class Trainer:
    """A converted model with its fused optimizer and loss scaler."""

    def __init__(
        self, device: str | torch.device, dtype: torch.dtype = torch.float16, lr: float = 1e-2
    ) -> None:
        self.model = amp_fx.convert(make_model().to(device), "O2", dtype=dtype)
        self.optimizer = amp_fx.optim.FusedAdam(self.model.parameters(), lr=lr, weight_decay=0.01)
        self.scaler = amp_fx.LossScaler(init_scale=2.0**10, growth_interval=3)

    def loss_fn(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(inputs), targets)

    def manual_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, max_grad_norm: float | None = None
    ) -> None:
        """The training step as a user writes it, without CudaGraphStep."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(self.loss_fn(inputs, targets)).backward()
        if max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            amp_fx.clip_grad_norm_(self.optimizer, max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Everything a step may write: weights, masters, moments, step counts, scaler state."""
        state = {f"param.{n}": p.detach().clone() for n, p in self.model.named_parameters()}
        for i, master in enumerate(master_params(self.optimizer)):
            state[f"master.{i}"] = master.detach().clone()
        for i, param in enumerate(self.model.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                # Before a parameter's first step its moments do not exist yet: zeros, as created.
                moment = self.optimizer.state[param].get(key)
                state[f"{key}.{i}"] = (
                    torch.zeros_like(param, dtype=torch.float32) if moment is None else moment.clone()
                )
        for i, group in enumerate(self.optimizer.param_groups):
            state[f"step.{i}"] = group["step"].clone()
        state["scale"] = torch.tensor(self.scaler.get_scale())
        return state


def assert_same_state(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], exact: bool
) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        if exact:
            assert torch.equal(actual[name], expected[name]), name
        else:
            rtol, atol = tolerances(torch.float32)
            assert_close_normwise(
                actual[name].float(), expected[name].float(), rtol=rtol, atol=atol, name=name
            )


# ---------------------------------------------------------------------------------------------
# CPU: the eager path and argument checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_eager_step_equals_the_hand_written_loop(max_grad_norm: float | None) -> None:
    reference, stepped = Trainer("cpu"), Trainer("cpu")
    step = CudaGraphStep(
        stepped.loss_fn, stepped.optimizer, stepped.scaler, max_grad_norm=max_grad_norm, enabled=False
    )
    for inputs, targets in make_batches(5, "cpu"):
        reference.manual_step(inputs, targets, max_grad_norm)
        loss = step(inputs, targets)
        assert loss.shape == () and not loss.requires_grad
    assert step.steps_taken == 5 and not step.captured
    assert_same_state(stepped.snapshot(), reference.snapshot(), exact=True)
    # The steps really trained: the weights moved.
    assert not torch.equal(stepped.snapshot()["master.0"], Trainer("cpu").snapshot()["master.0"])


def test_eager_step_skips_an_overflowing_batch() -> None:
    trainer = Trainer("cpu")
    step = CudaGraphStep(trainer.loss_fn, trainer.optimizer, trainer.scaler, enabled=False)
    (inputs, targets), (later_inputs, later_targets) = make_batches(2, "cpu")
    step(inputs, targets)
    before = trainer.snapshot()
    bad = later_inputs.clone()
    bad[0, 0] = float("inf")
    step(bad, later_targets)
    after = trainer.snapshot()
    assert after.pop("scale") == before.pop("scale") / 2
    assert_same_state(after, before, exact=True)


def test_eager_step_without_a_scaler_trains_bf16() -> None:
    trainer = Trainer("cpu", dtype=torch.bfloat16)
    step = CudaGraphStep(trainer.loss_fn, trainer.optimizer, enabled=False)
    batches = make_batches(8, "cpu")
    losses = [step(*batches[0]).item() for _ in range(8)]
    assert losses[-1] < losses[0]


def test_graphs_on_cpu_parameters_are_refused_with_the_fix() -> None:
    trainer = Trainer("cpu")
    with pytest.raises(ValueError, match="enabled=False"):
        CudaGraphStep(trainer.loss_fn, trainer.optimizer, trainer.scaler)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup_steps": 0}, ValueError, "warmup_steps"),
        ({"warmup_steps": 1.5}, ValueError, "warmup_steps"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"enabled": 1}, TypeError, "enabled"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, error: type[Exception], match: str) -> None:
    trainer = Trainer("cpu")
    with pytest.raises(error, match=match):
        CudaGraphStep(trainer.loss_fn, trainer.optimizer, trainer.scaler, **{"enabled": False, **kwargs})


def test_bad_objects_are_refused() -> None:
    trainer = Trainer("cpu")
    with pytest.raises(TypeError, match="loss_fn"):
        CudaGraphStep(trainer.model.state_dict(), trainer.optimizer, enabled=False)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        CudaGraphStep(trainer.loss_fn, list(trainer.model.parameters()), enabled=False)
    with pytest.raises(TypeError, match="LossScaler"):
        CudaGraphStep(trainer.loss_fn, trainer.optimizer, 1024.0, enabled=False)


def test_bad_batches_and_losses_are_refused() -> None:
    trainer = Trainer("cpu")
    step = CudaGraphStep(trainer.loss_fn, trainer.optimizer, trainer.scaler, enabled=False)
    inputs, targets = make_batches(1, "cpu")[0]
    with pytest.raises(TypeError, match="argument 1"):
        step(inputs, targets.tolist())
    per_sample = CudaGraphStep(
        lambda x, y: F.cross_entropy(trainer.model(x), y, reduction="none"), trainer.optimizer, enabled=False
    )
    with pytest.raises(ValueError, match="one-element loss"):
        per_sample(inputs, targets)


# ---------------------------------------------------------------------------------------------
# GPU: no host sync, capture and replay
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_o2_step_runs_without_host_sync(max_grad_norm: float | None) -> None:
    trainer = Trainer("cuda")
    batches = make_batches(6, "cuda")
    for inputs, targets in batches[:3]:  # warm-up: Triton compiles, scaler state, pointer tables
        trainer.manual_step(inputs, targets, max_grad_norm)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for inputs, targets in batches[3:]:
            trainer.manual_step(inputs, targets, max_grad_norm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert trainer.optimizer.param_groups[0]["step"].item() == 6


@pytest.mark.gpu
@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_captured_step_gives_the_weights_of_eager_steps(max_grad_norm: float | None) -> None:
    eager, graphed = Trainer("cuda"), Trainer("cuda")
    eager_step = CudaGraphStep(
        eager.loss_fn, eager.optimizer, eager.scaler, max_grad_norm=max_grad_norm, enabled=False
    )
    graph_step = CudaGraphStep(
        graphed.loss_fn, graphed.optimizer, graphed.scaler, max_grad_norm=max_grad_norm
    )
    # 3 warm-up steps, the capture step, 4 replays; growth_interval=3 makes the scale grow twice.
    for inputs, targets in make_batches(8, "cuda"):
        expected_loss = eager_step(inputs, targets)
        loss = graph_step(inputs, targets)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert graph_step.captured
    assert graphed.scaler.get_scale() == eager.scaler.get_scale() == 2.0**12
    assert_same_state(graphed.snapshot(), eager.snapshot(), exact=False)


@pytest.mark.gpu
def test_overflow_during_replay_skips_the_step_on_device() -> None:
    trainer = Trainer("cuda")
    step = CudaGraphStep(trainer.loss_fn, trainer.optimizer, trainer.scaler, warmup_steps=2)
    batches = make_batches(5, "cuda")
    for inputs, targets in batches[:3]:
        step(inputs, targets)
    assert step.captured
    before = trainer.snapshot()
    inputs, targets = batches[3]
    bad = inputs.clone()
    bad[1, 2] = float("nan")
    loss = step(bad, targets)
    assert loss.isnan().item()
    after = trainer.snapshot()
    assert after.pop("scale") == before.pop("scale") / 2
    assert_same_state(after, before, exact=True)
    # The next clean batch, replayed from the same graph, steps again.
    step(*batches[4])
    assert trainer.optimizer.param_groups[0]["step"].item() == before["step.0"].item() + 1


@pytest.mark.gpu
def test_reset_graph_recaptures_with_a_new_learning_rate() -> None:
    eager, graphed = Trainer("cuda"), Trainer("cuda")
    eager_step = CudaGraphStep(eager.loss_fn, eager.optimizer, eager.scaler, enabled=False)
    graph_step = CudaGraphStep(graphed.loss_fn, graphed.optimizer, graphed.scaler, warmup_steps=1)
    batches = make_batches(6, "cuda")
    for inputs, targets in batches[:3]:
        eager_step(inputs, targets)
        graph_step(inputs, targets)
    for trainer in (eager, graphed):
        for group in trainer.optimizer.param_groups:
            group["lr"] = 1e-3
    graph_step.reset_graph()
    assert not graph_step.captured
    for inputs, targets in batches[3:]:
        eager_step(inputs, targets)
        graph_step(inputs, targets)
    assert graph_step.captured
    assert_same_state(graphed.snapshot(), eager.snapshot(), exact=False)


@pytest.mark.gpu
def test_replay_refuses_a_batch_of_another_shape() -> None:
    trainer = Trainer("cuda")
    step = CudaGraphStep(trainer.loss_fn, trainer.optimizer, trainer.scaler, warmup_steps=1)
    for inputs, targets in make_batches(2, "cuda"):
        step(inputs, targets)
    inputs, targets = make_batches(1, "cuda")[0]
    with pytest.raises(ValueError, match="fixed shapes"):
        step(inputs[:-1], targets[:-1])


@pytest.mark.gpu
def test_graph_step_rejects_parameters_on_two_devices() -> None:
    first = nn.Linear(2, 2).cuda()
    second = nn.Linear(2, 2)
    optimizer = amp_fx.optim.FusedSGD(
        [{"params": first.parameters()}, {"params": second.parameters()}], lr=0.1
    )
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphStep(lambda x: first(x).sum(), optimizer)


def test_snapshot_covers_every_written_tensor() -> None:
    # Guards the other tests: a snapshot that missed the moments would make "bit-identical" vacuous.
    trainer = Trainer("cpu")
    before = copy.deepcopy(trainer.snapshot())
    trainer.manual_step(*make_batches(1, "cpu")[0])
    after = trainer.snapshot()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert {"param.0.weight", "master.0", "exp_avg.0", "exp_avg_sq.0", "step.0"} <= changed


# ---------------------------------------------------------------------------------------------
# examples/cuda_graph_step.py
# ---------------------------------------------------------------------------------------------

EXAMPLE_ARGS = ["--steps", "6", "--warmup-steps", "2", "--n-layer", "1", "--batch-size", "2"]
EXAMPLE_ARGS += ["--block-size", "16", "--corpus-bytes", "20000", "--log-every", "5"]


def load_cuda_graph_example() -> ModuleType:
    """examples/cuda_graph_step.py as a module; it imports examples/gpt.py from beside it."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))
    spec = importlib.util.spec_from_file_location(
        "amp_fx_example_cuda_graph_step", examples / "cuda_graph_step.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU prints")
def test_cuda_graph_example_runs_eagerly_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    results = load_cuda_graph_example().main(["--cuda-graph", *EXAMPLE_ARGS])
    assert "CUDA graphs need a CUDA GPU" in capsys.readouterr().out
    assert list(results) == ["eager"]
    assert all(torch.isfinite(m).all() for m in results["eager"]["masters"])


@pytest.mark.gpu
def test_cuda_graph_example_trains_like_eager() -> None:
    results = load_cuda_graph_example().main(["--compare", *EXAMPLE_ARGS])
    assert list(results) == ["eager", "cuda_graph"]
    rtol, atol = tolerances(torch.float32)
    pairs = zip(results["cuda_graph"]["masters"], results["eager"]["masters"], strict=True)
    for i, (graphed, eager) in enumerate(pairs):
        assert_close_normwise(graphed, eager, rtol=rtol, atol=atol, name=f"master {i}")
