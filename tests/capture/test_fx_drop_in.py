"""A model converted by the torch.fx front end behaves like the original: it follows ``.train()`` /
``.eval()`` (also where its forward reads ``self.training``), calls with the original's signature,
captures untraceable children with torch.export, and bad models are refused before any change."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import CapturedModel, capture_states
from amp_fx.core.node_info import OTHER_MODE_GRAPH_KEY
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.testing import tolerances
from tests.models.small import WithCustomBackward

BF16 = torch.bfloat16


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() if not v.is_meta else v for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------
# Models convert cannot take are refused before any change
# ------------------------------------------------------------------------------------------
def test_meta_model_is_refused_with_how_to_materialise_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to("meta")
    hooks = dict(model._load_state_dict_pre_hooks)
    with pytest.raises(ValueError, match=r"meta device.*hold no values.*to_empty.*load_state_dict"):
        amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    assert all(p.is_meta and p.dtype == torch.float32 for p in model.parameters())
    assert type(model) is nn.Sequential and dict(model._load_state_dict_pre_hooks) == hooks


def test_script_module_is_refused_with_the_original_module_as_the_fix():
    original = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    scripted = torch.jit.script(original)
    before = _state(scripted)
    with pytest.raises(TypeError, match=r"TorchScript modules cannot be converted.*original nn.Module"):
        amp_fx.convert(scripted, "O2", dtype=BF16, device_type="cpu")
    after = scripted.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32 for k in before)
    x = torch.randn(2, 4)
    assert torch.equal(scripted(x), original(x))


# ------------------------------------------------------------------------------------------
# The converted model follows .train() / .eval(), also where its forward reads self.training
# ------------------------------------------------------------------------------------------
class DropoutFlag(nn.Module):
    """``self.training`` passed as a value (torch.fx bakes it into the graph as a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.5, self.training)


class Branch(nn.Module):
    """``if self.training:`` in a submodule torch.fx traces through."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.fc(x) * 2 + 1
        return self.fc(x).softmax(-1)


class BranchingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Branch()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.block(x))
        return y.relu() if self.training else y


def _autocast_reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=BF16):
        return model(x)


def _converted_output(gm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    return gm(x)


@pytest.mark.parametrize("model_class", [DropoutFlag, BranchingNet])
@pytest.mark.parametrize("converted_in_training", [True, False])
def test_o1_follows_train_and_eval_as_autocast_does(
    model_class: type[nn.Module], converted_in_training: bool
):
    torch.manual_seed(0)
    model = model_class().train(converted_in_training)
    gm = amp_fx.convert(model, "O1", dtype=BF16, device_type="cpu")
    x = torch.randn(8, 16)
    for training in (not converted_in_training, converted_in_training, not converted_in_training):
        gm.train(training)
        model.train(training)
        out = _converted_output(gm, x)
        assert type(out) is torch.Tensor
        assert torch.equal(out, _autocast_reference(model, x)), f"training={training}"


def test_dropout_read_from_self_training_drops_only_in_training():
    model = DropoutFlag()
    with torch.no_grad():
        model.fc.bias.fill_(1.0)  # every output nonzero unless dropped
    gm = amp_fx.convert(model.eval(), "O2", dtype=BF16, device_type="cpu")
    x = torch.randn(64, 16)
    assert (gm(x) != 0).all()
    zeros = (gm.train()(x) == 0).float().mean().item()
    assert 0.3 < zeros < 0.7  # p=0.5
    assert (gm.eval()(x) != 0).all()


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_each_mode_computes_what_a_conversion_in_that_mode_computes(opt_level: str):
    torch.manual_seed(0)
    model = BranchingNet()
    in_train = amp_fx.convert(model.train(), opt_level, dtype=BF16, device_type="cpu")
    in_eval = amp_fx.convert(model.eval(), opt_level, dtype=BF16, device_type="cpu")
    x = torch.randn(8, 16)
    assert torch.equal(in_train.eval()(x), in_eval.eval()(x))
    assert torch.equal(in_eval.train()(x), in_train.train()(x))
    assert {k: v.dtype for k, v in in_train.state_dict().items()} == {
        k: v.dtype for k, v in in_eval.state_dict().items()
    }


def test_a_model_with_two_mode_graphs_keeps_state_dict_report_and_printing():
    model = BranchingNet().eval()
    gm = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    assert OTHER_MODE_GRAPH_KEY in gm.meta  # the two graphs differ
    assert list(gm.state_dict()) == list(model.state_dict())
    assert sorted(n for n, _ in gm.named_parameters()) == sorted(n for n, _ in model.named_parameters())
    assert "softmax" in str(amp_fx.report(gm))  # gm.graph is the eval graph it was converted in
    assert "block" in repr(gm)
    gm.load_state_dict(gm.state_dict())
    plain = amp_fx.convert(nn.Sequential(nn.Linear(4, 4)), "O2", dtype=BF16, device_type="cpu")
    assert OTHER_MODE_GRAPH_KEY not in plain.meta  # one graph where the modes do not differ


@pytest.mark.parametrize("copy_with", ["deepcopy", "torch.save"])
def test_copies_follow_train_and_eval(tmp_path, copy_with: str):
    torch.manual_seed(0)
    model = BranchingNet()
    gm = amp_fx.convert(model.eval(), "O1", dtype=BF16, device_type="cpu")
    if copy_with == "deepcopy":
        copied = copy.deepcopy(gm)
    else:
        torch.save(gm, tmp_path / "gm.pt")
        copied = torch.load(tmp_path / "gm.pt", weights_only=False)
    x = torch.randn(8, 16)
    for training in (True, False):
        model.train(training)
        assert torch.equal(copied.train(training)(x), _autocast_reference(model, x))
    assert inspect.signature(copied.forward) == inspect.signature(model.forward)


def test_torch_compile_follows_train_and_eval():
    torch.manual_seed(0)
    model = BranchingNet()
    gm = amp_fx.convert(model.eval(), "O1", dtype=BF16, device_type="cpu")
    compiled = torch.compile(gm, backend="eager")
    x = torch.randn(8, 16)
    for training in (False, True, False):
        model.train(training)
        gm.train(training)
        assert torch.equal(compiled(x), _autocast_reference(model, x))


# ------------------------------------------------------------------------------------------
# inspect.signature(converted.forward) is the original's, and calls bind as they do to it
# ------------------------------------------------------------------------------------------
class Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, shift: float = 0.0, *, scale: float = 1.0) -> torch.Tensor:
        return self.fc(input_ids) * scale + shift


class Variadic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc(x) * scale + sum(extra)


def test_signature_is_the_originals_and_keyword_calls_work():
    torch.manual_seed(0)
    model = Keywords()
    gm = amp_fx.convert(model, "O1", dtype=BF16, device_type="cpu")
    assert inspect.signature(gm.forward) == inspect.signature(model.forward)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=BF16):
        expected = model(input_ids=x, scale=2.0)
    assert torch.equal(gm(input_ids=x, scale=2.0), expected)
    with pytest.raises(TypeError):
        gm(x, 1.0, 2.0)  # scale is keyword-only, as in the original


def test_keyword_only_arguments_after_varargs_bind_as_in_the_original():
    torch.manual_seed(0)
    model = Variadic()
    gm = amp_fx.convert(model, "O1", dtype=BF16, device_type="cpu")
    assert inspect.signature(gm.forward) == inspect.signature(model.forward)
    x, a, b = torch.randn(3, 2, 8).unbind(0)
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x, a, b, scale=3.0)
    assert torch.equal(gm(x, a, b, scale=3.0), expected)


# ------------------------------------------------------------------------------------------
# Untraceable children of a traced root are captured with torch.export, not run in islands
# ------------------------------------------------------------------------------------------
def _island_parameter_share(gm: nn.Module) -> float:
    """The share of parameters whose module's own code runs in an autocast island: a module the
    graph calls through `AutocastIsland`, or a captured module whose call torch.export refused
    (its own tensors; its captured children run in graphs)."""
    in_islands: dict[int, int] = {}
    for module in gm.modules():
        if isinstance(module, AutocastIsland) and isinstance(module.wrapped, nn.Module):
            in_islands.update({id(p): p.numel() for p in module.wrapped.parameters()})
    states = dict(capture_states(gm))
    for name, state in states.items():
        if state.islands:
            module = gm.get_submodule(name)
            captured_below = {
                id(p)
                for child_name, _ in states.items()
                if child_name.startswith(f"{name}.")
                for p in gm.get_submodule(child_name).parameters()
            }
            in_islands.update({id(p): p.numel() for p in module.parameters() if id(p) not in captured_below})
    return sum(in_islands.values()) / sum(p.numel() for p in gm.parameters())


class Resize(nn.Module):
    """torch.fx cannot branch on a traced size; torch.export specialises it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 8:
            x = x[:8]
        return self.norm(self.fc(x)).softmax(-1)


class Gate(nn.Module):
    """Neither torch.fx nor torch.export takes a branch on tensor values: its children are captured."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = -x
        return self.down(self.up(x).relu())


class TracedRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.resize = Resize()
        self.gate = Gate()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.resize(self.stem(x))))


def test_untraceable_children_are_captured_and_o1_equals_autocast():
    torch.manual_seed(0)
    model = TracedRoot().eval()
    gm = amp_fx.convert(model, "O1", dtype=BF16, device_type="cpu")
    assert isinstance(gm, torch.fx.GraphModule)
    assert not any(isinstance(m, AutocastIsland) for m in gm.modules())
    assert isinstance(gm.get_submodule("resize"), CapturedModel)
    assert list(gm.state_dict()) == list(model.state_dict())
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x)
    out = gm(x)
    assert type(out) is torch.Tensor and torch.equal(out, expected)
    assert _island_parameter_share(gm) == 0.0
    assert "resize" in str(amp_fx.report(gm))  # the report still reads the graph


def test_o2_with_captured_children_trains_every_parameter():
    torch.manual_seed(0)
    model = TracedRoot()
    gm = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    x = torch.randn(8, 16)
    loss = gm(x).float().square().mean()
    assert type(loss) is torch.Tensor
    loss.backward()
    assert all(type(p.grad) is torch.Tensor for p in gm.parameters())
    gm.zero_grad(set_to_none=True)
    # By value: outputs and every parameter's gradient (captured children's and islands' alike) as
    # accurate against FP32 as torch.autocast's, over seeded batches.
    amp_fx.testing.assert_equivalent(model, gm, (x,), dtype=BF16)


def test_leaf_modules_stay_islands_as_asked():
    model = TracedRoot().eval()
    gm = amp_fx.convert(model, "O1", dtype=BF16, device_type="cpu", leaf_modules=["resize"])
    islands = [m.name for m in gm.modules() if isinstance(m, AutocastIsland)]
    assert islands == ["resize"]
    assert isinstance(gm.get_submodule("gate"), CapturedModel)


def test_mobilevit_runs_under_a_tenth_of_its_parameters_in_islands():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("mobilevitv2_050", pretrained=False).eval()
    gm = amp_fx.convert(model, "O1", dtype=BF16, device_type="cpu")
    x = torch.randn(1, 3, 64, 64)
    out = gm(x)
    assert type(out) is torch.Tensor and out.shape == (1, 1000)
    assert _island_parameter_share(gm) < 0.1


class TiedHead(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 20, bias=False)
        self.proj.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 2:
            x = x[:2]
        return self.proj(x)


class TiedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.head = TiedHead(self.embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids))


def test_weights_tied_into_a_captured_child_stay_tied():
    torch.manual_seed(0)
    model = TiedModel()
    gm = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    assert isinstance(gm.get_submodule("head"), CapturedModel)
    assert gm.get_parameter("head.proj.weight") is gm.get_parameter("embedding.weight")
    assert len(list(gm.parameters())) == len(list(model.parameters()))
    out = gm(torch.tensor([1, 2]))
    assert type(out) is torch.Tensor and out.shape == (2, 20)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_custom_autograd_function_keeps_its_backward(opt_level: str) -> None:
    """torch.fx would trace through the Function's forward and differentiate its ops: the call is
    one opaque node instead, and the Function's own backward runs."""
    torch.manual_seed(0)
    model = WithCustomBackward()
    x = torch.randn(3, 4)
    converted = amp_fx.convert(copy.deepcopy(model), opt_level, dtype=torch.bfloat16, front_end="fx")
    converted(x).float().sum().backward()
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    expected.float().sum().backward()
    if opt_level == "O1":
        assert torch.equal(converted.fc.weight.grad, model.fc.weight.grad)
    else:  # bf16 weights: their gradient within bf16's tolerance of autocast's
        rtol, atol = tolerances(torch.bfloat16)
        grad = converted.fc.weight.grad.float()
        torch.testing.assert_close(grad, model.fc.weight.grad, rtol=rtol, atol=atol)
    reasons = [row.opaque_reason for row in amp_fx.report(converted).opaque]
    assert any("ClippedGradient" in reason for reason in reasons), reasons
