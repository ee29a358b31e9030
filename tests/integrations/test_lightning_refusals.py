"""AmpPrecision refuses bad input before anything changes, each error naming the fix: a precision
string beside it, contradicting arguments, an optimizer without masters, a checkpoint it cannot
continue, weights tied across submodules, value clipping. The module is left as it was."""

from __future__ import annotations

import copy
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.integrations.lightning import AmpPrecision
from tests.integrations.test_lightning import Regression, batches, fit, fp16_plugin, trainer


@pytest.fixture(autouse=True)
def quiet_lightning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        yield


def test_a_precision_string_with_the_plugin_is_refused():
    with pytest.raises(ValueError, match="Received both `precision=bf16-mixed`"):
        pl.Trainer(precision="bf16-mixed", plugins=[AmpPrecision("O2", dtype=torch.bfloat16)])


def test_contradicting_dtypes_and_levels_are_refused():
    policy = amp_fx.preset("O2", dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match="dtype=torch.float16 but the policy's is torch.bfloat16.*pass only policy="
    ):
        AmpPrecision(dtype=torch.float16, policy=policy)
    with pytest.raises(ValueError, match="opt_level='O1' but the policy is O2"):
        AmpPrecision("O1", policy=policy)
    with pytest.raises(ValueError, match="dtype must be torch.float16 or torch.bfloat16"):
        AmpPrecision("O2", dtype=torch.float32)
    with pytest.raises(TypeError, match="needs an opt_level"):
        AmpPrecision()


@pytest.mark.parametrize(
    "make_optimizer, error, message",
    [
        (
            lambda p: torch.optim.RMSprop(p),
            TypeError,
            "cannot give FP32 master weights to; return torch.optim.AdamW",
        ),
        (lambda p: torch.optim.Adam(p, amsgrad=True), ValueError, "amsgrad=True.*use amsgrad=False"),
        (
            lambda p: torch.optim.SGD(p, lr=0.1, maximize=True),
            ValueError,
            "maximize=True.*use maximize=False",
        ),
    ],
    ids=["rmsprop", "amsgrad", "maximize"],
)
def test_an_optimizer_without_masters_is_refused_and_the_module_restored(
    tmp_path, make_optimizer, error, message
):
    module = Regression()
    original_net = module.net
    state = copy.deepcopy(module.state_dict())
    module.configure_optimizers = lambda: make_optimizer(module.parameters())
    with pytest.raises(error, match=message):
        fit(module, tmp_path, AmpPrecision("O2", dtype=torch.bfloat16))
    assert module.net is original_net
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


def test_an_optimizer_built_before_conversion_is_refused(tmp_path):
    module = Regression()
    stale = torch.optim.AdamW(module.parameters())
    module.configure_optimizers = lambda: stale
    with pytest.raises(ValueError, match="from before AmpPrecision converted it.*in configure_optimizers"):
        fit(module, tmp_path, AmpPrecision("O2", dtype=torch.bfloat16))


def test_resuming_a_checkpoint_saved_without_the_plugin_is_refused(tmp_path):
    run = fit(Regression(), tmp_path, max_steps=1)
    run.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="saved without AmpPrecision.*load_from_checkpoint"):
        fit(Regression(), tmp_path, fp16_plugin(), ckpt_path=tmp_path / "plain.ckpt")
    validation = trainer(tmp_path, fp16_plugin())
    validation.validate(Regression(), batches(), ckpt_path=tmp_path / "plain.ckpt")  # no optimizer state read
    assert math.isfinite(validation.callback_metrics["val_loss"].item())


def test_weights_tied_across_submodules_are_refused_before_conversion(tmp_path):
    module = Regression()
    module.head = nn.Linear(32, 1)
    module.head.weight = module.net[3].weight  # one parameter in two children
    with pytest.raises(ValueError, match="'net' and 'head' share a parameter.*hold both in one submodule"):
        fit(module, tmp_path, fp16_plugin())
    assert module.net[3].weight is module.head.weight and module.head.weight.dtype == torch.float32


def test_value_clipping_is_refused_before_conversion(tmp_path):
    module = Regression()
    original_net = module.net
    with pytest.raises(ValueError, match="clips by norm only.*gradient_clip_algorithm='norm'"):
        fit(module, tmp_path, AmpPrecision("O2"), gradient_clip_val=1.0, gradient_clip_algorithm="value")
    assert module.net is original_net
