"""What user code in Lightning's hooks sees of the grads under AmpPrecision, against Lightning's own
``"16-mixed"`` / ``"bf16-mixed"`` (torch.autocast + GradScaler, which unscales before
``on_before_optimizer_step``): the true grads, to tolerance, and the update the hooks leave is the one
applied. Where no user code sees the grads, the fast path stays (the kernel unscales)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import amp_fx
from amp_fx.integrations.lightning import AmpPrecision
from amp_fx.optim import FusedSGD, master_params
from amp_fx.testing import assert_close_normwise, grad_tolerances

REFERENCE = {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}
CLIP = 0.05  # below the grads' norm and largest value: every clip binds


@pytest.fixture(autouse=True)
def quiet_lightning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        yield


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class Net(pl.LightningModule):
    """A small MLP stepped by SGD; subclasses read or change the grads in a hook."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def record(self) -> None:
        self.seen.append({n: p.grad.detach().double().clone() for n, p in self.named_parameters()})


class ClipsWithTorch(Net):
    """torch.amp's recipe in Lightning's hook: read, log the norms, clip with torch."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.record()
        self.log_dict(grad_norm(self, norm_type=2))
        torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)


class ClipsByValue(Net):
    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **_: Any) -> None:
        self.record()
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="value")


class Halves(Callback):
    """A callback (not the module) that reads the grads and changes them."""

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        module.record()
        for p in module.parameters():
            p.grad.mul_(0.5)


def scaled(level: str, dtype: torch.dtype) -> AmpPrecision:
    """A loss scaler for bf16 too: the hooks must see the grads unscaled whatever the dtype."""
    return AmpPrecision(level, dtype=dtype, loss_scaler=amp_fx.LossScaler(init_scale=2.0**12))


def fit(module: Net, precision: Any, callbacks: list[Any] = (), **kwargs: Any) -> pl.Trainer:
    plugin = {"plugins": [precision]} if isinstance(precision, AmpPrecision) else {"precision": precision}
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=list(callbacks),
        **plugin,
        **kwargs,
    )
    trainer.fit(module, train_dataloaders=loader())
    return trainer


def weights(trainer: pl.Trainer) -> list[torch.Tensor]:
    """The FP32 weights the optimizer steps: its masters, or the parameters themselves."""
    optimizer = trainer.optimizers[0]
    if isinstance(optimizer, FusedSGD):
        return [m.detach().double() for m in master_params(optimizer)]
    return [p.detach().double() for p in trainer.lightning_module.parameters()]


LEVELS = [("O1", torch.float16), ("O1", torch.bfloat16), ("O2", torch.float16)]


@pytest.mark.parametrize("level, dtype", LEVELS)
@pytest.mark.parametrize(
    "module_type, callback", [(ClipsWithTorch, None), (ClipsByValue, None), (Net, Halves)]
)
def test_hooks_see_and_change_the_true_grads_as_under_lightnings_mixed_precision(
    level, dtype, module_type, callback
):
    rtol, atol = grad_tolerances(dtype)
    runs = {}
    for name, precision in [("amp_fx", scaled(level, dtype)), ("lightning", REFERENCE[dtype])]:
        module = module_type()
        runs[name] = (module, fit(module, precision, [callback()] if callback else []))
    (ours, our_run), (theirs, their_run) = runs["amp_fx"], runs["lightning"]
    assert len(ours.seen) == len(theirs.seen) == 2
    for step, (actual, expected) in enumerate(zip(ours.seen, theirs.seen, strict=True)):
        for name in expected:
            assert_close_normwise(actual[name], expected[name], rtol=rtol, atol=atol, name=f"{name}@{step}")
    if module_type is ClipsWithTorch:
        # Lightning's grad_norm utility logged the true norms.
        logged, expected = (run.callback_metrics["grad_2.0_norm_total"] for run in (our_run, their_run))
        torch.testing.assert_close(logged.double(), expected.double(), rtol=rtol, atol=0.0)
    for actual, expected in zip(weights(our_run), weights(their_run), strict=True):
        assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name="weights after two steps")


def test_without_hooks_that_read_grads_the_kernel_unscales(monkeypatch):
    """The fast path: no FP32 copy of the grads, clipping folded into the kernel; the same update."""
    applied = []
    original = FusedSGD.apply_grad_multiplier_
    monkeypatch.setattr(FusedSGD, "apply_grad_multiplier_", lambda self: applied.append(1) or original(self))

    class Clipped(Net):
        pass

    runs = []
    for module_type in (Clipped, ClipsWithTorch):
        clip = CLIP if module_type is Clipped else None
        trainer = fit(module_type(), scaled("O2", torch.float16), gradient_clip_val=clip)
        runs.append(weights(trainer))
        if module_type is Clipped:
            assert applied == []
    assert len(applied) == 2  # the overriding module took unscale_, once per step
    rtol, atol = grad_tolerances(torch.float16)
    for actual, expected in zip(*runs, strict=True):
        assert_close_normwise(actual, expected, rtol=rtol, atol=atol, name="weights")
