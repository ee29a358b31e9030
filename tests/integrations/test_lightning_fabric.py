"""AmpPrecision under Lightning Fabric on CPU: the same plugin class as for the Trainer.

Fabric gives a precision plugin no way to replace an optimizer, so the user builds amp_fx's after
``setup_module``; the plugin converts, scales, unscales, clips and steps. References: a run saved
and loaded with ``fabric.save`` / ``fabric.load`` against one that was not interrupted."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.fabric as lf
import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.integrations.lightning import AmpPrecision
from amp_fx.optim import FusedAdam, master_params

STEPS, INIT_SCALE = 6, 1024.0


@pytest.fixture(autouse=True)
def quiet_lightning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        yield


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=generator)
    return x, x @ torch.linspace(-1.0, 1.0, 8).unsqueeze(1)


def set_up(accelerator: str = "cpu") -> tuple[lf.Fabric, AmpPrecision, nn.Module, torch.optim.Optimizer]:
    scaler = amp_fx.LossScaler(init_scale=INIT_SCALE)
    # Fabric converts the module before it moves it: the policy's device is named.
    device_type = "cuda" if accelerator == "gpu" else "cpu"
    plugin = AmpPrecision("O2", dtype=torch.float16, device_type=device_type, loss_scaler=scaler)
    fabric = lf.Fabric(accelerator=accelerator, devices=1, plugins=[plugin])
    model = fabric.setup_module(Net())
    optimizer = fabric.setup_optimizers(FusedAdam(model.parameters(), lr=1e-2))
    return fabric, plugin, model, optimizer


def train(
    model, optimizer, fabric, plugin, steps: int, inf_at: int = -1, fabric_clip: bool = False
) -> list[float]:
    x, y = fabric.to_device(data())
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        fabric.backward(loss * float("inf") if step == inf_at else loss)
        if fabric_clip:  # Fabric's: the plugin unscales, torch clips (an inf norm raises, as in torch)
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        else:
            plugin.clip_gradients(optimizer, 1.0)
        optimizer.step()
    return losses


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_fabric_trains_a_converted_module_with_masters_and_skips_overflows(accelerator):
    fabric, plugin, model, optimizer = set_up(accelerator)
    losses = train(model, optimizer, fabric, plugin, STEPS, inf_at=1)
    assert losses[-1] < 0.7 * losses[0]
    assert model.module.head.weight.dtype == torch.float16  # the user's module, its children converted
    assert model.module.head.weight.device.type == fabric.device.type
    assert all(m.dtype == torch.float32 for m in master_params(optimizer.optimizer))
    assert plugin.skipped_steps.item() == 1
    assert plugin.loss_scaler.get_scale() == INIT_SCALE / 2
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}


def test_fabric_clip_gradients_unscales_then_clips_as_the_fast_path_does():
    runs = []
    for fabric_clip in (False, True):
        fabric, plugin, model, optimizer = set_up()
        losses = train(model, optimizer, fabric, plugin, STEPS, inf_at=1, fabric_clip=fabric_clip)
        runs.append((losses, [m.detach().clone() for m in master_params(optimizer.optimizer)]))
        assert plugin.skipped_steps.item() == 1 and plugin.loss_scaler.get_scale() == INIT_SCALE / 2
    (fast_losses, fast_masters), (losses, masters) = runs
    torch.testing.assert_close(losses, fast_losses, rtol=1e-4, atol=1e-6)
    for actual, expected in zip(masters, fast_masters, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6)


def test_fabric_clip_gradients_by_value_clips_the_true_grads():
    fabric, plugin, model, optimizer = set_up()
    x, y = fabric.to_device(data())
    fabric.backward(nn.functional.mse_loss(model(x), y))
    fabric.clip_gradients(model, optimizer, clip_val=1e-3)
    grads = [p.grad for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in grads)  # unscaled, in FP32
    assert max(g.abs().max().item() for g in grads) == pytest.approx(1e-3)


def test_fabric_save_and_load_resume_bit_for_bit(tmp_path: Path):
    fabric, plugin, model, optimizer = set_up()
    first = train(model, optimizer, fabric, plugin, 3, inf_at=1)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "amp": plugin})
    saved = torch.load(tmp_path / "ckpt", weights_only=True)
    assert {v.dtype for v in saved["model"].values()} == {torch.float32}
    assert saved["amp"]["loss_scaler"]["scale"] == INIT_SCALE / 2
    continued = train(model, optimizer, fabric, plugin, 3)

    fabric, plugin, resumed_model, resumed_optimizer = set_up()
    fabric.load(tmp_path / "ckpt", {"model": resumed_model, "optimizer": resumed_optimizer, "amp": plugin})
    assert plugin.skipped_steps.item() == 1
    assert train(resumed_model, resumed_optimizer, fabric, plugin, 3) == continued
    assert first[0] > continued[-1]
    for expected, actual in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(actual, expected)
    masters = zip(master_params(optimizer.optimizer), master_params(resumed_optimizer.optimizer), strict=True)
    assert all(torch.equal(a, b) for a, b in masters)


def test_fabric_refuses_an_optimizer_without_masters_naming_the_fix():
    plugin = AmpPrecision("O2", dtype=torch.bfloat16)
    fabric = lf.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = Net()
    stale = torch.optim.AdamW(net.parameters())  # built before setup: over the FP32 parameters
    model = fabric.setup_module(net)
    x, y = data()
    fabric.backward(nn.functional.mse_loss(model(x), y))
    with pytest.raises(ValueError, match="from before AmpPrecision converted it; build it after"):
        fabric.setup_optimizers(stale).step()
    torch_optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match=r"steps amp_fx's fused optimizers, got AdamW.*FusedAdam\(model"):
        torch_optimizer.step()
    with pytest.raises(TypeError, match=r"steps amp_fx's fused optimizers, got AdamW"):
        fabric.clip_gradients(model, torch_optimizer, max_norm=1.0)


def test_fabric_refuses_a_precision_string_with_the_plugin():
    with pytest.raises(ValueError, match="Received both `precision=bf16-mixed`"):
        lf.Fabric(
            accelerator="cpu", precision="bf16-mixed", plugins=[AmpPrecision("O2", dtype=torch.bfloat16)]
        )


def test_fabric_steps_with_a_closure():
    fabric, plugin, model, optimizer = set_up()
    x, y = data()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        return loss

    first = optimizer.step(closure).item()
    assert optimizer.step(closure).item() < first
