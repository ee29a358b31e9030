"""Where O2 casts a floating model input: at its first lowered consumer, not at the graph's entry.

Inputs that carry precision (an offset, a scale, a regression target, coordinates) keep it through
the ops that run in FP32 or pass their dtype through (statistics, subtraction and division by them,
norms, losses), on both front ends, and O2 stays within the relative oracle against autocast; an
input a matmul or convolution reads first is cast once, as at the entry (images); integer inputs
are never cast; ``cast_inputs_at_entry=True`` restores Apex's entry cast; O1 and O3 are unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Policy, preset
from amp_fx.testing import assert_equivalent

BF16 = torch.bfloat16
FRONT_ENDS = ("fx", "export")


class LearnedOffset(nn.Module):
    """Subtracts a learned level from raw readings around 100, then a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.level = nn.Parameter(torch.full((6,), 100.0))
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x - self.level)))


class CenteredPoints(nn.Module):
    """Point clouds far from the origin (coordinates around 1000), centred on their own mean."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 8)

    def forward(self, points):
        centred = points - points.mean(dim=1, keepdim=True)
        return self.fc(centred / centred.abs().amax(dim=1, keepdim=True)).amax(dim=1)


class RegressionLoss(nn.Module):
    """A regression head and its MSE loss against float targets around 50, standardised by the
    dataset's statistics (buffers) before the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.register_buffer("target_mean", torch.tensor(50.0))
        self.register_buffer("target_std", torch.tensor(0.1))

    def forward(self, x, target):
        return F.mse_loss(self.fc(x).squeeze(-1), (target - self.target_mean) / self.target_std)


class ScaledSeries(nn.Module):
    """Min-max scales each series over time (a comparison picks valid steps), then a GRU-free conv1d head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3, padding=1)

    def forward(self, series):
        low = series.amin(dim=-1, keepdim=True)
        high = series.amax(dim=-1, keepdim=True)
        scaled = (series - low) / (high - low)
        scaled = torch.where(series > low, scaled, torch.zeros_like(scaled))
        return self.conv(scaled.unsqueeze(1)).mean(-1)


def _precise_cases():
    torch.manual_seed(0)
    return {
        "learned_offset": (LearnedOffset(), (100 + 0.05 * torch.randn(8, 6),)),
        "centred_points": (CenteredPoints(), (1000 + torch.randn(4, 16, 3),)),
        "regression_loss": (RegressionLoss(), (torch.randn(16, 4), 50 + 0.1 * torch.randn(16))),
        "scaled_series": (ScaledSeries(), (20 + 0.02 * torch.randn(4, 12),)),
    }


def _convert(model: nn.Module, front_end: str, level: str = "O2", **options) -> nn.Module:
    policy = preset(level, BF16, "cpu", **options)
    return amp_fx.convert(copy.deepcopy(model), policy=policy, front_end=front_end)


def _graphs(converted: nn.Module) -> list[torch.fx.GraphModule]:
    return list(amp_fx.report(converted).graphs.values())


def _casts_of(gm: torch.fx.GraphModule, placeholder: str) -> list[torch.fx.Node]:
    (node,) = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name == placeholder]
    return [user for user in node.users if node_info(user).is_cast]


@pytest.mark.parametrize("name", sorted(_precise_cases()))
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_precise_inputs_are_as_accurate_as_autocast(name, front_end) -> None:
    model, inputs = _precise_cases()[name]
    converted = _convert(model, front_end)
    converted(*inputs)
    assert_equivalent(model, converted, inputs)


@pytest.mark.parametrize("name", sorted(_precise_cases()))
def test_the_entry_cast_loses_what_these_inputs_carry(name) -> None:
    # The class is real: with Apex's entry cast these models fail the oracle.
    model, inputs = _precise_cases()[name]
    with pytest.raises(AssertionError, match="exceeds"):
        assert_equivalent(model, _convert(model, "fx", cast_inputs_at_entry=True), inputs)


@pytest.mark.parametrize("name", sorted(_precise_cases()))
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_training_step_moves_every_parameter(name, front_end) -> None:
    model, inputs = _precise_cases()[name]
    converted = _convert(model, front_end)
    optimizer = amp_fx.optim.FusedAdam(converted.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in converted.named_parameters()}
    out = converted(*inputs)
    assert type(out) is torch.Tensor and torch.isfinite(out).all()
    out.float().square().mean().backward()
    optimizer.step()
    assert not [n for n, p in converted.named_parameters() if torch.equal(p, before[n])]


class SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, images):
        return F.relu(self.bn(self.conv1(images))).mean() + self.conv2(images).mean()


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_an_image_read_by_convolutions_is_cast_once(front_end) -> None:
    torch.manual_seed(0)
    model, images = SmallConvNet(), torch.randn(2, 3, 8, 8)
    converted = _convert(model, front_end)
    converted(images)
    (gm,) = _graphs(converted)
    (cast,) = _casts_of(gm, "images")  # one copy, shared by both convolutions, as at the entry
    assert node_info(cast).out_dtype == BF16 and len(cast.users) == 2
    placeholder = next(n for n in gm.graph.nodes if n.name == "images")
    assert set(placeholder.users) == {cast}
    assert_equivalent(model, converted, (images,))


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

    def forward(self, ids):
        return self.head(self.embed(ids))


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_token_ids_are_not_copied(front_end) -> None:
    ids = torch.randint(0, 20, (2, 5))
    converted = _convert(Tokens(), front_end)
    converted(ids)
    for gm in _graphs(converted):
        casts = _casts_of(gm, "ids")
        # fx without example inputs guards its cast (a no-op on integers); export casts nothing.
        assert all(node_info(c).cast_reason for c in casts) and len(casts) <= 1
        assert front_end == "fx" or not casts


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_policy_option_restores_the_entry_cast(front_end) -> None:
    model, (x,) = _precise_cases()["learned_offset"]
    converted = _convert(model, front_end, cast_inputs_at_entry=True)
    converted(x)
    (gm,) = _graphs(converted)
    (cast,) = _casts_of(gm, "x")
    assert "at entry" in node_info(cast).cast_reason
    assert not [u for u in next(n for n in gm.graph.nodes if n.name == "x").users if u is not cast]


def test_the_option_is_a_serialized_policy_field_with_level_defaults() -> None:
    assert not preset("O2").cast_inputs_at_entry and preset("O3").cast_inputs_at_entry
    assert preset("O2").entry_cast_dtype is None and preset("O3", BF16).entry_cast_dtype == BF16
    assert preset("O1").entry_cast_dtype is None  # O1 casts no input anywhere
    for policy in (preset("O2", BF16, "cpu", cast_inputs_at_entry=True), preset("O2", BF16, "cpu")):
        assert Policy.from_dict(policy.to_dict()) == policy
    old = preset("O2", BF16, "cpu").to_dict()
    del old["cast_inputs_at_entry"]  # a dict written before the field: the level's default
    assert Policy.from_dict(old).cast_inputs_at_entry is False
    with pytest.raises(TypeError, match="cast_inputs_at_entry"):
        preset("O2", cast_inputs_at_entry="yes")


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_o1_and_o3_are_unchanged(level) -> None:
    model, (x,) = _precise_cases()["learned_offset"]
    default = _convert(model, "fx", level)
    entry = _convert(model, "fx", level, cast_inputs_at_entry=level == "O3")
    assert default.code == entry.code
    users = next(n for n in default.graph.nodes if n.op == "placeholder").users
    if level == "O3":
        assert all(node_info(u).is_cast for u in users)  # Apex's O3: the input cast at entry
    else:
        assert not [u for u in users if node_info(u).is_cast]  # the subtraction reads it as it is


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_report_says_where_each_input_was_cast_and_why(front_end) -> None:
    model, inputs = _precise_cases()["regression_loss"]
    converted = _convert(model, front_end)
    converted(*inputs)
    rep = amp_fx.report(converted)
    by_name = {cast.name: cast for cast in rep.input_casts}
    x, target = by_name["x"], by_name["target"]
    assert "first lowered consumer" in x.reason and x.consumers and not x.read_as_is_by
    assert not target.casts and target.reason.startswith("not cast: read as it is by sub, div")
    assert "target: not cast" in str(rep)  # the summary lists inputs not simply cast at the entry
    assert rep.to_dict()["summary"]["inputs"][1]["name"] == "target"

    images = _convert(SmallConvNet(), front_end)
    images(torch.randn(2, 3, 8, 8))
    (cast,) = amp_fx.report(images).input_casts
    assert cast.casts == ("images_to_bfloat16",) and "where its first lowered consumer" in cast.reason


def test_the_report_names_the_entry_cast() -> None:
    model, (x,) = _precise_cases()["centred_points"]
    (cast,) = amp_fx.report(_convert(model, "fx", cast_inputs_at_entry=True)).input_casts
    assert cast.reason.startswith("cast to bf16 at the graph's entry") and not cast.read_as_is_by
    (delayed,) = amp_fx.report(_convert(model, "fx")).input_casts
    assert delayed.read_as_is_by[:2] == ("mean", "sub") and "cast to bf16 where fc (linear)" in delayed.reason
