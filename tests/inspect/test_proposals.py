"""amp_fx.propose_policy: on models built to overflow fp16 at one op (a feed-forward output growing
past 65504 as in T5, unscaled attention scores) it proposes the rule that keeps that op in FP32,
and the model converted with it trains with no forward overflow and no skipped step after the loss
scaler's first steps, where plain fp16 O2 skips every step; on the suite's standard models it
proposes nothing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.inspect.proposals import FP32_HEADROOM_BITS, MAX_FP32_RULES, UNDERFLOW_SHARE
from tests.models.hf import MODELS
from tests.models.small import NanoGPT

WIDTH, FF, CLASSES = 16, 64, 4
STEPS = 30
# Steps the loss scaler may skip while it finds its scale (from GradScaler's 2^16).
CALIBRATION = 10


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.wi = nn.Linear(WIDTH, FF, bias=False)
        self.wo = nn.Linear(FF, WIDTH, bias=False)

    def forward(self, x):
        return x + self.wo(torch.relu(self.wi(self.norm(x))))


class T5Like(nn.Module):
    """Two pre-norm feed-forward blocks; the first's output projection is grown until its values
    pass 65504, as T5's feed-forward outputs do (why Hugging Face keeps T5's ``wo`` in FP32)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.ff1, self.ff2 = FeedForward(), FeedForward()
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)
        with torch.no_grad():
            self.ff1.wo.weight.mul_(300000.0)

    def forward(self, x, target):
        return F.cross_entropy(self.head(self.norm(self.ff2(self.ff1(self.embed(x))))), target)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # not divided by sqrt(WIDTH)
        return self.o(torch.softmax(scores, -1) @ self.v(x))


class UnscaledAttention(nn.Module):
    """Attention scores without the 1/sqrt(d) scale, of queries and keys large enough that they
    pass 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.attn = Attention()
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, CLASSES)
        with torch.no_grad():
            self.attn.q.weight.mul_(400.0)
            self.attn.k.weight.mul_(400.0)

    def forward(self, x, target):
        h = self.embed(x)
        return F.cross_entropy(self.head(self.norm(h + self.attn(h))).mean(1), target)


def _batch(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    shape = (4, 6, 8) if isinstance(model, UnscaledAttention) else (16, 8)
    return torch.randn(*shape, generator=generator), torch.randint(
        0, CLASSES, (4 if len(shape) == 3 else 16,)
    )


def _build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def _train(converted: nn.Module, steps: int, raw: nn.Module) -> tuple[list[float], list[float]]:
    """Losses and the scale after each step of fp16 training with FusedAdam and a LossScaler."""
    optimizer = amp_fx.optim.FusedAdam(converted.parameters(), lr=1e-3, master_weights=True)
    scaler = amp_fx.LossScaler()
    losses, scales = [], []
    for step in range(steps):
        loss = converted(*_batch(raw, step))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
    return losses, scales


def _skipped(scales: list[float]) -> list[int]:
    """The steps the scaler skipped: with hysteresis 1, each one halves the scale."""
    previous = [2.0**16, *scales[:-1]]
    return [step for step, (before, after) in enumerate(zip(previous, scales, strict=True)) if after < before]


@pytest.mark.parametrize(("cls", "front_end", "expected"), [
    (T5Like, "fx", [("module", "ff1.wo")]),
    (UnscaledAttention, "fx", [("module", "attn")]),
    (UnscaledAttention, "export", [("module", "attn")]),
])  # fmt: skip
def test_the_proposed_policy_trains_where_plain_fp16_skips(cls, front_end, expected) -> None:
    policy = amp_fx.preset("O2", torch.float16, "cpu")
    plain = amp_fx.convert(_build(cls), policy=policy, front_end=front_end)
    watch = amp_fx.watch(plain)
    losses, scales = _train(plain, 4, cls())
    assert not any(math.isfinite(loss) for loss in losses) and _skipped(scales) == [0, 1, 2, 3]
    proposal = amp_fx.propose_policy(plain)
    assert [(rule.kind, rule.target) for rule in proposal.rules] == expected
    rule = proposal.rules[0]
    assert rule.threshold == FP32_HEADROOM_BITS and rule.number < FP32_HEADROOM_BITS
    assert "overflowed" in rule.why and str(FP32_HEADROOM_BITS)[0] in rule.why
    watch.remove()

    fixed = amp_fx.convert(_build(cls), policy=proposal.policy(), front_end=front_end)
    watch = amp_fx.watch(fixed)
    losses, scales = _train(fixed, STEPS, cls())
    assert all(math.isfinite(loss) for loss in losses)
    assert all(step < CALIBRATION for step in _skipped(scales)), _skipped(scales)
    assert not any(r.forward.overflowed for r in watch.ranges())
    assert not amp_fx.propose_policy(fixed)  # nothing more to keep in range


def test_the_proposal_is_code_that_builds_its_policy() -> None:
    plain = amp_fx.convert(_build(T5Like), "O2", device_type="cpu")
    amp_fx.watch(plain)
    plain(*_batch(T5Like(), 0))
    proposal = amp_fx.propose_policy(plain)
    namespace = {"amp_fx": amp_fx, "torch": torch, "model": _build(T5Like)}
    exec(str(proposal), namespace)  # what the user would paste
    assert namespace["policy"] == proposal.policy()
    assert all(len(line) <= 100 for line in str(proposal).splitlines())
    assert proposal.base == plain.meta["amp_fx_policy"]  # the base is left as it was
    assert not proposal.base.module_name_overrides


class Branches(nn.Module):
    """Five branches, each a Linear whose values pass 65504 on its own."""

    def __init__(self, branches: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(8, 8) for _ in range(branches))
        with torch.no_grad():
            for branch in self.branches:
                branch.weight.fill_(10000.0)

    def forward(self, x):
        return sum(branch(x).float() for branch in self.branches)


@pytest.mark.parametrize("branches", [MAX_FP32_RULES, MAX_FP32_RULES + 1])
def test_more_fp32_rules_than_the_threshold_become_bf16(branches) -> None:
    model = amp_fx.convert(Branches(branches), "O2", device_type="cpu")
    amp_fx.watch(model)
    model(torch.ones(2, 8))
    rules = amp_fx.propose_policy(model).rules
    if branches <= MAX_FP32_RULES:
        assert [rule.kind for rule in rules] == ["module"] * branches
    else:
        assert [(rule.kind, rule.target, rule.number) for rule in rules] == [("dtype", "bfloat16", branches)]
        assert amp_fx.propose_policy(model).policy().dtype == torch.bfloat16


@pytest.mark.parametrize(("dtype", "scale", "proposed"), [
    (torch.float16, 1e-7, True),  # most values below fp16's smallest normal, 6.1e-05
    (torch.float16, 1e-3, False),
    (torch.bfloat16, 1e-7, False),  # bf16's smallest normal is fp32's
])  # fmt: skip
def test_values_underflowing_fp16_ask_for_bf16(dtype, scale, proposed) -> None:
    torch.manual_seed(0)
    model = amp_fx.convert(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), "O2", dtype=dtype, device_type="cpu")
    watch = amp_fx.watch(model)
    model(torch.randn(16, 8) * scale)
    rules = amp_fx.propose_policy(model).rules
    share = max(r.forward.underflow_share for r in watch.ranges())
    assert (share >= UNDERFLOW_SHARE) == proposed
    assert [(rule.kind, rule.number) for rule in rules] == ([("dtype", share)] if proposed else [])


def _standard_models() -> list:
    return [pytest.param(name, id=name) for name in ("gpt2", "llama", "bert", "nanogpt")]


@pytest.mark.parametrize("name", _standard_models())
def test_the_standard_models_get_no_proposal(name) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "nanogpt":
        model = amp_fx.convert(NanoGPT(), "O2", device_type="cpu")
        idx = torch.randint(0, 64, (2, 16))

        def loss():
            return model(idx, idx)[1]

    else:
        raw, inputs = MODELS[name]()
        model = amp_fx.convert(raw, "O2", device_type="cpu")
        batch = inputs(2, 8)

        def loss():
            return model(**batch).loss

    watch = amp_fx.watch(model)
    for _ in range(2):
        (loss() * 2.0**10).backward()
    assert watch.ranges() and amp_fx.find_overflow(model) is None
    proposal = amp_fx.propose_policy(model)
    assert not proposal.rules, str(proposal)
    assert "nothing to change" in str(proposal)


def test_an_unwatched_model_is_refused() -> None:
    with pytest.raises(ValueError, match="is not watched"):
        amp_fx.propose_policy(amp_fx.convert(nn.Linear(2, 2), "O2", device_type="cpu"))
