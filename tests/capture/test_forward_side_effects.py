"""A forward's side effects on its buffers happen on every call of the converted model, never at
`convert`, with the grad mode the code asked for, on both front ends (issue 35).

Each model updates buffers its own way (a counter, an EMA chained under ``torch.no_grad()``, a
``copy_``, an indexed store, an assignment, ``lerp_`` under a ``@torch.no_grad()`` helper, a
``set_grad_enabled(False)`` region, a BatchNorm in train mode). The converted model trains a few
steps on the inputs the eager model (the reference, a copy) trains on, and their buffers agree;
`convert` itself leaves the model's state as it found it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_fx

FRONT_ENDS = ("fx", "export")
STEPS = 3


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


class Counter(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.lin(x) * self.count


class ChainedEma(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.running_mean


class CopyAndIndex(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(4))
        self.register_buffer("history", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.history[1:] = self.history[:-1].clone()
        self.history[0] = h.detach().float().sum()
        self.last.copy_(h.detach().max(0).values)
        return h + self.history.sum()


class Assigned(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.total = self.total + h.detach().float().pow(2).mean()  # rebinds the attribute
        self.calls += 2
        return h * self.calls


class DecoratedLerp(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.ones(4))

    @torch.no_grad()
    def _update(self, value: torch.Tensor) -> None:
        self.ema.lerp_(value.to(self.ema.dtype), 0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self._update(h.mean(0))
        with torch.set_grad_enabled(False):
            self.ema.clamp_(min=-3.0, max=3.0)
        return h * self.ema


class NormInTraining(_Base):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[0])
        return self.norm(self.lin(x))


MODELS = (Counter, ChainedEma, CopyAndIndex, Assigned, DecoratedLerp, NormInTraining)


def _inputs(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(6, 4, generator=generator) for _ in range(steps)]


def _train(model: nn.Module, inputs: list[torch.Tensor]) -> None:
    for x in inputs:
        model(x).float().pow(2).mean().backward()  # a second backward fails on a buffer's graph


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_buffers_update_on_every_call_as_eagerly(cls: type, front_end: str) -> None:
    """O0 (the identity): the converted model's buffers equal eager's bit for bit after each call."""
    torch.manual_seed(0)
    model = cls()
    converted = amp_fx.convert(model, "O0", front_end=front_end)
    for step, x in enumerate(_inputs(STEPS)):
        _train(model, [x])
        _train(converted, [x])
        for name, expected in model.named_buffers():
            got = converted.get_buffer(name)
            assert torch.equal(got, expected), (name, step)
            assert got.grad_fn is None and not got.requires_grad, name


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(
    "level, dtype",
    [("O1", torch.bfloat16), ("O2", torch.float16), ("O2", torch.bfloat16), ("O3", torch.bfloat16)],
)
@pytest.mark.parametrize("cls", [Counter, ChainedEma, Assigned, DecoratedLerp], ids=lambda c: c.__name__)
def test_updates_through_casts_land_in_the_buffers(
    cls: type, level: str, dtype: torch.dtype, front_end: str
) -> None:
    """Where the passes cast a buffer (O1's low ops, O2/O3's low storage), its updates still land
    in the module's own buffer on every call, within the low dtype's rounding of eager's."""
    torch.manual_seed(0)
    model = cls()
    converted = amp_fx.convert(model, level, dtype=dtype, device_type="cpu", front_end=front_end)
    inputs = _inputs(STEPS)
    _train(model, inputs)
    _train(converted, inputs)
    for name, expected in model.named_buffers():
        got = converted.get_buffer(name)
        assert got.grad_fn is None, name
        if expected.is_floating_point():
            torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.05, msg=name)
        else:
            assert torch.equal(got, expected), name


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_grad_mode_regions_leave_the_callers_mode(front_end: str) -> None:
    """A ``no_grad`` region inside forward neither drops out of the graph nor leaks: under the
    caller's ``torch.no_grad()`` the mode stays off, and with grad on, the output has a grad_fn
    while the buffer updated under no_grad has none."""
    torch.manual_seed(0)
    converted = amp_fx.convert(
        ChainedEma(), "O1", dtype=torch.bfloat16, device_type="cpu", front_end=front_end
    )
    x = torch.randn(6, 4)
    with torch.no_grad():
        out = converted(x)
        assert not torch.is_grad_enabled()
    assert out.grad_fn is None
    out = converted(x)
    assert torch.is_grad_enabled() and out.grad_fn is not None
    assert converted.get_buffer("running_mean").grad_fn is None


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_convert_leaves_state_as_it_found_it(cls: type, level: str, front_end: str) -> None:
    """Right after `convert` the model and the converted copy hold the state the model held before
    (a training BatchNorm's statistics, counters, EMAs); nothing ran at convert time."""
    torch.manual_seed(0)
    model = cls().train()
    _train(model, _inputs(1))  # state that is not the initial one
    before = _state(model)
    converted = amp_fx.convert(model, level, dtype=torch.bfloat16, device_type="cpu", front_end=front_end)
    after = _state(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    state = converted.state_dict()
    assert state.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(state[name], value.to(state[name].dtype)), name
    for path, module in model.named_modules():
        try:
            copied = converted.get_submodule(path)
        except AttributeError:  # traced through by torch.fx: no module of its own
            continue
        assert _plain_attributes(copied).items() >= _plain_attributes(module).items() or path == "", path


def _plain_attributes(module: nn.Module) -> dict[str, object]:
    return {
        k: v
        for k, v in vars(module).items()
        if type(v) in (int, float, bool, str) and k != "_is_hf_initialized"
    }


def test_update_fx_cannot_record_is_refused_naming_it() -> None:
    """A tensor held in a plain attribute (not a buffer) and updated in place: torch.fx would
    update it once, at trace time; convert refuses, naming it and the fix, and the "auto" front
    end captures with torch.export instead."""

    class PlainTensor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen = torch.zeros(())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            return self.lin(x)

    with pytest.raises(TypeError, match=r"tensor attribute 'seen'.*register_buffer\('seen'"):
        amp_fx.convert(PlainTensor(), "O1", front_end="fx")
    model = PlainTensor()
    converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16, device_type="cpu")
    assert model.seen.item() == 0 and not isinstance(converted, torch.fx.GraphModule)
