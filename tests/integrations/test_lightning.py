"""AmpPrecision under the real Lightning Trainer on CPU: tiny models, a few steps each.

References: the same run under ``precision="32-true"`` with torch's optimizer (O0 converts nothing,
so the fused optimizer must do torch's maths on the same param groups), the FP32 weights before
conversion (the masters), grads read back in float64 (the unscaled norm), an uninterrupted run
(resume), and automatic optimization (manual optimization)."""

from __future__ import annotations

import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import amp_fx
from amp_fx.core.node_info import POLICY_KEY
from amp_fx.integrations.lightning import AmpPrecision
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import assert_close_normwise, tolerances

BATCHES, BATCH_SIZE, FEATURES = 4, 8, 8
INIT_SCALE = 1024.0


@pytest.fixture(autouse=True)
def quiet_lightning():
    """Lightning's advice about workers and loggers is noise for these runs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        yield


def dataset() -> TensorDataset:
    """A learnable set: y is a fixed linear function of x."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH_SIZE, FEATURES, generator=generator)
    return TensorDataset(x, x @ torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1))


def batches() -> DataLoader:
    return DataLoader(dataset(), batch_size=BATCH_SIZE)


class ResumableLoader:
    """An iterable of batches with Lightning's loader state protocol (state_dict / load_state_dict),
    so that Lightning resumes mid-epoch at the next batch."""

    def __init__(self) -> None:
        self.batches = list(batches())
        self.start = self.yielded = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        self.yielded, self.start = self.start, 0
        for batch in self.batches[self.yielded :]:
            self.yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["yielded"]


def no_decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two param groups, as trainers make them: weights decay, biases and norms do not."""
    decay = [p for n, p in module.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in module.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=3e-2, betas=(0.8, 0.95), eps=1e-6),
    "adam": lambda groups: torch.optim.Adam(groups, lr=3e-2),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
}


class Regression(pl.LightningModule):
    """A small MLP with a LayerNorm (kept FP32 at O2) and a StepLR schedule stepped every step."""

    def __init__(self, optimizer: str = "adamw", manual: bool = False, clip: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 1))
        self.optimizer_name = optimizer
        self.automatic_optimization = not manual
        self.clip = clip
        self.losses: list[float] = []
        self.inf_at: set[int] = set()  # global steps whose loss is made inf (an overflow)
        self.none_at: set[int] = set()  # batch indices whose training_step returns None (no step)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx in self.none_at:
            return None
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        if self.global_step in self.inf_at:
            loss = loss * math.inf
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        optimizer.step()
        self.lr_schedulers().step()
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS[self.optimizer_name](no_decay_groups(self, weight_decay=0.1))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer(tmp_path: Path, plugin: AmpPrecision | None = None, **kwargs: Any) -> pl.Trainer:
    options = {
        "accelerator": "cpu",
        "max_epochs": 2,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
        **kwargs,
    }
    if plugin is not None:
        options["plugins"] = [plugin]
    return pl.Trainer(**options)


def fit(
    module: Regression,
    tmp_path: Path,
    plugin: AmpPrecision | None = None,
    ckpt_path: Path | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    run = trainer(tmp_path, plugin, **kwargs)
    run.fit(module, train_dataloaders=batches(), ckpt_path=ckpt_path)
    return run


def fp16_plugin() -> AmpPrecision:
    """fp16 at O2 with a scale at which this model's grads never overflow by themselves."""
    return AmpPrecision("O2", dtype=torch.float16, loss_scaler=amp_fx.LossScaler(init_scale=INIT_SCALE))


def masters_in_place(run: pl.Trainer) -> list[torch.Tensor]:
    """The optimizer's masters (a parameter without one is its own), in the module's parameter order."""
    optimizer = run.optimizers[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_param = {id(p): m for p, m in zip(params, master_params(optimizer), strict=True)}
    return [by_param[id(p)] for p in run.lightning_module.parameters()]


def masters(run: pl.Trainer) -> list[torch.Tensor]:
    """Copies of the optimizer's FP32 masters, in the order of the module's parameters."""
    return [m.detach().clone() for m in masters_in_place(run)]


# ----------------------------------------------------------------------------------------------
def test_bf16_o2_loss_goes_down_with_fp32_masters_and_the_module_kept(tmp_path):
    module = Regression()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    run = fit(module, tmp_path, AmpPrecision("O2", dtype=torch.bfloat16), max_epochs=4)
    assert run.lightning_module is module  # the user's LightningModule, its child converted
    assert module.losses[-1] < 0.5 * module.losses[0]
    dtypes = {n: p.dtype for n, p in module.named_parameters()}
    assert dtypes["net.0.weight"] == dtypes["net.3.weight"] == torch.bfloat16
    assert dtypes["net.1.weight"] == torch.float32  # LayerNorm stays FP32 at O2
    optimizer = run.optimizers[0]
    assert type(optimizer) is FusedAdam
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    for param, master in zip(module.parameters(), masters(run), strict=True):
        assert master.dtype == torch.float32
        assert torch.equal(param.detach(), master.to(param.dtype))  # the weight is the rounded master
    assert set(before) == set(dtypes)
    assert not run.callback_metrics.keys() & {"amp_fx/loss_scale", "amp_fx/skipped_steps"}  # bf16: unscaled


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O3", torch.bfloat16)])
def test_o1_and_o3_train_with_their_own_weights_masters_and_scaling(tmp_path, level, dtype):
    module = Regression()
    plugin = AmpPrecision(level, dtype=dtype)
    run = fit(module, tmp_path, plugin, max_epochs=4)
    assert module.losses[-1] < 0.5 * module.losses[0]
    weight_dtype = torch.float32 if level == "O1" else dtype  # O1 keeps FP32 weights, O3 stores them low
    assert {p.dtype for p in module.parameters()} == {weight_dtype}
    # Apex's table: neither level keeps FP32 masters; O1 scales fp16 losses, O3 does not.
    assert all(m is p for m, p in zip(masters_in_place(run), module.parameters(), strict=True))
    assert plugin.loss_scaler.is_enabled() == (level == "O1")


def test_masters_start_from_the_fp32_weights_not_their_rounded_copies(tmp_path):
    module = Regression(optimizer="sgd")
    before = [p.detach().clone() for p in module.parameters()]
    run = fit(module, tmp_path, AmpPrecision("O2", dtype=torch.bfloat16), max_steps=0)
    assert all(torch.equal(m, b) for m, b in zip(masters(run), before, strict=True))
    assert any(not torch.equal(b, b.bfloat16().float()) for b in before)  # rounding would show


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_fused_equivalent_does_torchs_maths_on_the_same_groups_and_schedule(tmp_path, optimizer):
    reference = Regression(optimizer)
    fit(reference, tmp_path / "torch", max_epochs=1)
    converted = Regression(optimizer)
    run = fit(converted, tmp_path / "amp", AmpPrecision("O0"), max_epochs=1)
    assert type(run.optimizers[0]) is (FusedSGD if optimizer == "sgd" else FusedAdam)
    scheduler = run.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is run.optimizers[0] and scheduler.last_epoch == BATCHES
    assert [g["lr"] for g in run.optimizers[0].param_groups] == [scheduler.get_last_lr()[0]] * 2
    rtol, atol = tolerances(torch.float32)
    for expected, actual in zip(reference.parameters(), converted.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def test_fp16_hooks_see_the_true_grads_and_clipping_the_unscaled_norm(tmp_path):
    seen: dict[str, float] = {}

    class ReadGrads(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            # As under "16-mixed": the hook's grads are unscaled (FP32, not the loss's times the scale).
            assert all(p.grad.dtype == torch.float32 for p in module.parameters())
            grads = torch.cat([p.grad.double().flatten() for p in module.parameters()])
            seen["scale"] = plugin.loss_scaler.get_scale()
            seen["true_norm"] = grads.norm().item()
            seen["masters"] = [m.detach().clone() for m in master_params(optimizer)]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen["logged_norm"] = trainer.callback_metrics["amp_fx/grad_norm"].item()
            after = master_params(trainer.optimizers[0])
            seen["step"] = math.sqrt(
                sum(
                    (a - b).double().square().sum().item()
                    for a, b in zip(after, seen["masters"], strict=True)
                )
            )

    plugin = fp16_plugin()
    module = Regression(optimizer="sgd")
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=1.0)
    clip = 1e-3
    fit(module, tmp_path, plugin, max_steps=1, gradient_clip_val=clip, callbacks=[ReadGrads()])
    assert seen["scale"] == INIT_SCALE  # the loss was scaled, and its grads unscaled before the hook
    torch.testing.assert_close(seen["logged_norm"], seen["true_norm"], rtol=1e-3, atol=0.0)
    assert seen["true_norm"] > 10 * clip
    # SGD with lr 1 moves the masters by the clipped unscaled gradient: a norm of `clip`.
    torch.testing.assert_close(seen["step"], clip, rtol=1e-2, atol=0.0)


def test_overflowing_steps_are_skipped_counted_and_the_schedule_goes_on(tmp_path):
    module = Regression(optimizer="sgd")
    module.inf_at = {1, 2}
    plugin = fp16_plugin()
    seen = []

    class ReadMasters(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen.append(masters(trainer))

    run = fit(module, tmp_path, plugin, max_steps=4, callbacks=[ReadMasters()])
    assert [torch.equal(a[0], b[0]) for a, b in zip(seen[:-1], seen[1:], strict=True)] == [True, True, False]
    assert run.callback_metrics["amp_fx/skipped_steps"].item() == 2
    assert plugin.loss_scaler.get_scale() == INIT_SCALE / 4  # backed off twice
    assert run.lr_scheduler_configs[0].scheduler.last_epoch == 4  # stepped every step, as "16-mixed"


def test_gradient_accumulation_matches_the_larger_batch(tmp_path):
    accumulated = Regression()
    run = trainer(tmp_path / "accumulated", fp16_plugin(), max_steps=2, accumulate_grad_batches=2)
    run.fit(accumulated, train_dataloaders=batches())
    whole = Regression()
    run_whole = trainer(tmp_path / "whole", fp16_plugin(), max_steps=2)
    run_whole.fit(whole, train_dataloaders=DataLoader(dataset(), batch_size=2 * BATCH_SIZE))
    rtol, atol = tolerances(torch.float16)
    for actual, expected in zip(masters(run), masters(run_whole), strict=True):
        assert_close_normwise(actual, expected, rtol=rtol, atol=atol)


def test_a_training_step_returning_none_steps_nothing(tmp_path):
    module = Regression()
    module.none_at = {1}
    run = fit(module, tmp_path, fp16_plugin(), max_epochs=1, gradient_clip_val=1.0)
    assert len(module.losses) == BATCHES - 1
    # Lightning counts the call; the optimizer, which steps only after a backward, took one step fewer.
    assert run.global_step == BATCHES
    assert [g["step"].item() for g in run.optimizers[0].param_groups] == [BATCHES - 1] * 2


def test_manual_optimization_matches_automatic(tmp_path):
    automatic = Regression(clip=0.5)
    fit(automatic, tmp_path / "auto", fp16_plugin(), gradient_clip_val=0.5)
    manual = Regression(manual=True, clip=0.5)
    fit(manual, tmp_path / "manual", fp16_plugin())
    assert manual.losses == automatic.losses
    for expected, actual in zip(automatic.state_dict().values(), manual.state_dict().values(), strict=True):
        assert torch.equal(actual, expected)


class TwoOptimizers(Regression):
    """Manual optimization with two optimizers stepped on one backward (as GANs' code does)."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        return [torch.optim.AdamW(params[:2], lr=3e-2), torch.optim.AdamW(params[2:], lr=3e-2)]


def test_two_optimizers_on_one_backward_unscale_by_the_same_scale(tmp_path):
    def growing_every_step() -> AmpPrecision:  # a scale that changes at every update, never overflowing
        scaler = amp_fx.LossScaler(init_scale=4.0, growth_interval=1)
        return AmpPrecision("O2", dtype=torch.float16, loss_scaler=scaler)

    one = Regression()
    one.configure_optimizers = lambda: torch.optim.AdamW(one.parameters(), lr=3e-2)
    fit(one, tmp_path / "one", growing_every_step())
    two = TwoOptimizers()
    run = fit(two, tmp_path / "two", growing_every_step())
    assert len(run.optimizers) == 2 and two.losses == one.losses
    assert run.precision_plugin.loss_scaler.get_scale() == 4.0 * 2 ** (2 * BATCHES)  # grew at every step
    for expected, actual in zip(one.state_dict().values(), two.state_dict().values(), strict=True):
        assert torch.equal(actual, expected)


def resumable_state(run: pl.Trainer) -> list[torch.Tensor]:
    """Everything a resumed run must continue from: weights, masters, moments, step counts, the scale."""
    module, optimizer = run.lightning_module, run.optimizers[0]
    tensors = [p.detach() for p in module.parameters()] + masters(run)
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [g["step"] for g in optimizer.param_groups]
    return tensors + [torch.tensor(run.precision_plugin.loss_scaler.get_scale())]


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "resume_step, loader", [(4, "plain"), (5, "resumable")], ids=["epoch_end", "mid_epoch"]
)
def test_ckpt_path_resumes_bit_for_bit(tmp_path, resume_step, loader, accelerator):
    make_loader = batches if loader == "plain" else ResumableLoader
    every_step = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"
    )
    uninterrupted = Regression()
    uninterrupted.inf_at = {2}  # a skipped step and a backed-off scale before the checkpoint
    run = trainer(
        tmp_path, fp16_plugin(), accelerator=accelerator, callbacks=[every_step], enable_checkpointing=True
    )
    run.fit(uninterrupted, train_dataloaders=make_loader())
    # The policy is the Trainer's device's (the module was still on the CPU when it was converted).
    assert uninterrupted.net.meta[POLICY_KEY].device_type == run.strategy.root_device.type

    resumed = Regression()
    resumed.inf_at = {2}
    rerun = trainer(tmp_path, fp16_plugin(), accelerator=accelerator)
    rerun.fit(
        resumed, train_dataloaders=make_loader(), ckpt_path=tmp_path / "ckpt" / f"step={resume_step}.ckpt"
    )
    assert resumed.losses == uninterrupted.losses[resume_step:]
    for expected, actual in zip(resumable_state(run), resumable_state(rerun), strict=True):
        assert torch.equal(actual, expected)
    assert (
        rerun.lr_scheduler_configs[0].scheduler.state_dict()
        == run.lr_scheduler_configs[0].scheduler.state_dict()
    )
    assert rerun.precision_plugin.skipped_steps.item() == 1


def test_the_checkpoint_is_fp32_whole_and_loads_with_weights_only(tmp_path):
    module = Regression()
    run = fit(module, tmp_path, fp16_plugin(), max_epochs=1)
    path = tmp_path / "end.ckpt"
    run.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    weights = checkpoint["state_dict"]
    assert {v.dtype for v in weights.values()} == {torch.float32}
    for param_name, master in zip(dict(module.named_parameters()), masters(run), strict=True):
        assert torch.equal(weights[param_name], master)  # the masters, not the rounded weights
    states = checkpoint["optimizer_states"][0]["state"].values()
    assert len(states) == len(list(module.parameters()))
    assert all({"exp_avg", "exp_avg_sq"} <= state.keys() for state in states)
    assert sum("master_param" in state for state in states) == sum(
        p.dtype == torch.float16 for p in module.parameters()
    )
    assert checkpoint["AmpPrecision"]["loss_scaler"]["scale"] == run.precision_plugin.loss_scaler.get_scale()
    plain = Regression()
    plain.load_state_dict(weights)  # the FP32 LightningModule, without AmpPrecision
    assert all(p.dtype == torch.float32 for p in plain.parameters())


def test_a_second_fit_continues_from_the_masters_of_the_first(tmp_path):
    module = Regression()
    first = fit(module, tmp_path, fp16_plugin(), max_epochs=1)
    second = fit(module, tmp_path, fp16_plugin(), max_steps=0)
    assert all(torch.equal(a, b) for a, b in zip(masters(first), masters(second), strict=True))
    assert any(
        not torch.equal(m, p.float()) for m, p in zip(masters(second), module.parameters(), strict=True)
    )


def test_the_plugin_pickles_for_ddp_spawn(tmp_path):
    plugin = fp16_plugin()
    fit(Regression(), tmp_path, plugin, max_steps=1)
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.loss_scaler.get_scale() == plugin.loss_scaler.get_scale()
    assert (copy.opt_level, copy.dtype) == ("O2", torch.float16)


def test_a_policy_decides_level_and_dtype(tmp_path):
    policy = amp_fx.preset("O2", dtype=torch.bfloat16).set_module_name("3", amp_fx.Rule.FP32)
    plugin = AmpPrecision(policy=policy)
    assert (plugin.opt_level, plugin.dtype, plugin.loss_scaler.is_enabled()) == ("O2", torch.bfloat16, False)
    module = Regression()
    fit(module, tmp_path, plugin, max_steps=1)
    assert module.net.get_parameter("0.weight").dtype == torch.bfloat16
    assert module.net.get_parameter("3.weight").dtype == torch.float32  # the policy's override
