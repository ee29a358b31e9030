"""An optimizer trains the model convert returned, or is told: Apex's order (optimizer built before
convert) is refused at its first step with the fix; a torch optimizer stepping fp16/bf16 weights of
a converted model warns once; amp.initialize (which rebinds and gives masters) and amp_fx's fused
optimizers are left alone. Also: the optimizer wrappers users hold are accepted everywhere."""

from __future__ import annotations

import warnings

import pytest
import torch

import amp_fx
from amp_fx import LossScaler, amp
from amp_fx.optim import FusedAdam, FusedSGD, master_params


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(4, 8)).float().square().mean().backward()


@pytest.mark.parametrize(
    "make", [torch.optim.SGD, torch.optim.Adam, FusedSGD], ids=["sgd", "adam", "fused_sgd"]
)
@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_an_optimizer_built_before_convert_is_refused_at_its_first_step(front_end, make) -> None:
    model = _model()
    optimizer = make(model.parameters(), lr=0.1)
    converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16, front_end=front_end)
    _backward(converted)
    before = [p.detach().clone() for p in converted.parameters()]
    with pytest.raises(RuntimeError, match=r"Build the optimizer after convert.*amp.initialize"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="Build the optimizer after convert"):
        optimizer.step()  # refused again, not only once
    assert all(torch.equal(a, b) for a, b in zip(before, converted.parameters(), strict=True))


def test_the_original_model_may_still_be_trained_after_convert() -> None:
    # Converting a copy (for a report, for inference) and training the original is not refused.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_fx.convert(model, "O2", dtype=torch.bfloat16)
    _backward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()


def test_apex_order_works_through_amp_initialize() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    converted, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    before = [p.detach().clone() for p in converted.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # amp gives the torch optimizer FP32 masters: no warning
        for _ in range(2):
            optimizer.zero_grad()
            loss = converted(torch.randn(4, 8)).float().square().mean()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, converted.parameters(), strict=True))


@pytest.mark.parametrize("make", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_torch_optimizer_over_low_precision_weights_warns_once(dtype, make) -> None:
    converted = amp_fx.convert(_model(), "O2", dtype=dtype)
    optimizer = make(converted.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            _backward(converted)
            optimizer.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert str(dtype).removeprefix("torch.") in messages[0]
    assert "FusedAdam" in messages[0] and "amp.initialize" in messages[0]


@pytest.mark.parametrize(
    "make, level",
    [(FusedAdam, "O2"), (FusedSGD, "O2"), (torch.optim.AdamW, "O1")],
    ids=["fused_adam", "fused_sgd", "adamw_fp32_weights"],
)
def test_no_warning_where_the_weights_get_fp32_updates(make, level) -> None:
    converted = amp_fx.convert(_model(), level, dtype=torch.bfloat16)
    optimizer = make(converted.parameters(), lr=1e-3)
    _backward(converted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()


class _UserWrapper:
    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer


def _accelerate_wrapper(optimizer):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    wrapped = Accelerator(cpu=True).prepare_optimizer(optimizer)
    AcceleratorState._reset_state(True)  # accelerate's state is process-wide; leave none behind
    return wrapped


def _lightning_wrapper(optimizer):
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return LightningOptimizer(optimizer)


@pytest.mark.parametrize(
    "wrap",
    [_UserWrapper, _accelerate_wrapper, _lightning_wrapper, lambda o: _UserWrapper(_UserWrapper(o))],
    ids=["user", "accelerate", "lightning", "nested"],
)
def test_wrappers_are_accepted_wherever_an_optimizer_is(wrap) -> None:
    converted = amp_fx.convert(_model(), "O2", dtype=torch.float16)
    optimizer = FusedAdam(converted.parameters(), lr=1e-3)
    wrapped = wrap(optimizer)
    assert [m.data_ptr() for m in master_params(wrapped)] == [m.data_ptr() for m in master_params(optimizer)]
    scaler = LossScaler(init_scale=1024.0)
    scaler.scale(converted(torch.randn(4, 8)).float().square().mean()).backward()
    scaler.unscale_(wrapped)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)  # the wrapper and the optimizer inside it are one optimizer
    amp_fx.clip_grad_norm_(wrapped, 1.0)
    scaler.step(wrapped)
    scaler.update()
    assert optimizer.param_groups[0]["step"].item() == 1
