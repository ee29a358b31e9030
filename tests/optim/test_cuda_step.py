"""On CUDA a whole training step (scale, backward, unscale_, clip, step, update) never syncs with the
host and can be captured in a CUDA graph whose replays match eager steps, overflow skip included."""

from __future__ import annotations

import copy

import pytest
import torch

from amp_fx import LossScaler, clip_grad_norm_
from amp_fx.optim import FusedAdam, FusedSGD, master_params

pytestmark = pytest.mark.gpu

OPTIMIZERS = {
    "adam": lambda params: FusedAdam(params, lr=1e-3, weight_decay=0.01),
    "sgd": lambda params: FusedSGD(params, lr=1e-2, momentum=0.9),
}


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).cuda()
    # Low-precision weights, and one FP32 param (the last bias): a mix of params with and without masters.
    for module in (model[0], model[2]):
        module.weight.data = module.weight.data.to(dtype)
    model[0].bias.data = model[0].bias.data.to(dtype)
    return model


def _forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    hidden = model[1](model[0](x.to(model[0].weight.dtype)))
    weight, bias = model[2].weight, model[2].bias
    return hidden.float() @ weight.float().t() + bias


def _batches(count: int, overflow_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    batches = []
    for index in range(count):
        x = torch.randn(64, 16, device="cuda", generator=generator, dtype=torch.float16)
        if index == overflow_at:
            x[0, 0] = 6e4  # fp16 grads of the first layer overflow at this loss scale
        batches.append((x, torch.randn(64, 8, device="cuda", generator=generator)))
    return batches


def _train_step(model, optimizer, scaler, x, y) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=False)
    loss = (_forward(model, x) - y).square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip_grad_norm_(optimizer, max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_training_step_runs_under_sync_debug_mode_error(name, dtype) -> None:
    model = _model(dtype)
    optimizer = OPTIMIZERS[name](model.parameters())
    scaler = LossScaler(init_scale=2.0**14, hysteresis=2)
    batches = _batches(5, overflow_at=3)
    _train_step(model, optimizer, scaler, *batches[0])  # warm-up: scale created, kernels compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[1:]:
            _train_step(model, optimizer, scaler, x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(torch.cat([m.flatten() for m in master_params(optimizer)])).all()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_cuda_graph_replays_match_eager_steps(name) -> None:
    eager_model = _model(torch.float16)
    graph_model = copy.deepcopy(eager_model)
    eager_opt, graph_opt = (
        OPTIMIZERS[name](eager_model.parameters()),
        OPTIMIZERS[name](graph_model.parameters()),
    )
    eager_scaler, graph_scaler = LossScaler(init_scale=2.0**14), LossScaler(init_scale=2.0**14)
    warmup, batches = _batches(3), _batches(6, overflow_at=2)

    # Warm-up on a side stream (as torch.cuda.graphs recommends): creates the grads, the scale and
    # the kernels' pointer tables, so that capture allocates and copies nothing new.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in warmup:
            _train_step(graph_model, graph_opt, graph_scaler, x, y)
    torch.cuda.current_stream().wait_stream(side)
    for x, y in warmup:
        _train_step(eager_model, eager_opt, eager_scaler, x, y)

    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _train_step(graph_model, graph_opt, graph_scaler, static_x, static_y)

    for x, y in batches:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager_loss = _train_step(eager_model, eager_opt, eager_scaler, x, y)
        # The same kernels on the same data; a tolerance only in case cuBLAS picks another algorithm.
        torch.testing.assert_close(static_loss, eager_loss, equal_nan=True)
    torch.cuda.synchronize()

    assert graph_scaler.get_scale() == eager_scaler.get_scale() == 2.0**13  # one overflow, backed off
    for ours, theirs in zip(graph_model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)
    for ours, theirs in zip(master_params(graph_opt), master_params(eager_opt), strict=True):
        torch.testing.assert_close(ours, theirs)
    for ours, theirs in zip(graph_opt.param_groups, eager_opt.param_groups, strict=True):
        assert torch.equal(ours["step"], theirs["step"])
    assert graph_opt.param_groups[0]["step"].item() == len(warmup) + len(batches) - 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_runs_on_the_parameters_gpu_not_the_current_one(name) -> None:
    # Model parallel in one process: the params on cuda:1 while cuda:0 is current. The kernels must
    # run on cuda:1's stream (after its backward and pointer-table copies), as they do when cuda:1
    # is current.
    device = torch.device("cuda", 1)
    reference_model = _model(torch.float16).to(device)
    model = copy.deepcopy(reference_model)
    batches = [(x.to(device), y.to(device)) for x, y in _batches(4, overflow_at=2)]
    runs = []
    for trained, current in ((reference_model, device), (model, torch.device("cuda", 0))):
        optimizer, scaler = OPTIMIZERS[name](trained.parameters()), LossScaler(init_scale=2.0**14)
        with torch.cuda.device(current):
            for x, y in batches:
                _train_step(trained, optimizer, scaler, x, y)
        runs.append(([m.clone() for m in master_params(optimizer)], scaler.get_scale()))
    (expected, expected_scale), (masters, scale) = runs
    assert scale == expected_scale < 2.0**14  # the overflow was seen and skipped in both
    assert all(torch.equal(m, e) for m, e in zip(masters, expected, strict=True))
