"""fuse_losses: at O2 the cross-entropy reads the low-precision logits instead of a float32 copy.

Reference: the same conversion with ``fused_losses=False`` (the cast and torch's float32
cross-entropy, what torch.autocast computes): losses agree to float32 rounding, gradients to the
low dtype's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import preset
from amp_fx.ops.cross_entropy import fp32_cross_entropy
from amp_fx.passes.fuse_losses import fuse_losses
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.dtypes import dtype_is_assumed
from amp_fx.testing import tolerances, with_autocast
from tests.passes.training_signal import mismatches, step

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
VOCAB = 37


class LanguageModel(nn.Module):
    """Embedding -> MLP -> logits, with the loss in forward (nanoGPT / Hugging Face style)."""

    def __init__(self, loss: nn.Module | None = None, return_logits: bool = False, **loss_kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.loss = loss
        self.loss_kwargs = loss_kwargs
        self.return_logits = return_logits

    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids))))
        flat, flat_targets = logits.view(-1, logits.size(-1)), targets.view(-1)
        if self.loss is not None:
            loss = self.loss(flat, flat_targets)
        else:
            loss = F.cross_entropy(flat, flat_targets, **self.loss_kwargs)
        return (logits, loss) if self.return_logits else loss


def _batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 5), generator=generator)
    targets = torch.randint(0, VOCAB, (3, 5), generator=generator)
    targets[0, :2] = 0  # ignored where ignore_index=0
    return ids, targets


def _seeded(**kwargs) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(**kwargs)


def _loss_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if node_info(n).op == "cross_entropy_loss"]


def _float32_casts_of_logits(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    # Guarded casts of values derived from the (integer) targets, whose dtype is unknown, aside.
    return [
        n
        for n in gm.graph.nodes
        if node_info(n).is_cast
        and node_info(n).out_dtype == F32
        and node_info(n).in_dtypes[0] in (F16, BF16)
        and not dtype_is_assumed(n.args[0])
    ]


def _convert(model: nn.Module, dtype: torch.dtype, fused: bool, level: str = "O2") -> torch.fx.GraphModule:
    policy = preset(level, dtype=dtype, device_type="cpu", fused_losses=fused)
    return amp_fx.convert(model, level, policy=policy)


def _loss_and_grads(gm: nn.Module, *inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = gm(*inputs)
    loss = out[1] if isinstance(out, tuple) else out
    params = [p for p in gm.parameters() if p.requires_grad]
    return loss, list(torch.autograd.grad(loss.sum(), params))


def _assert_same_training_signal(model_kwargs: dict, dtype: torch.dtype) -> torch.fx.GraphModule:
    inputs = _batch()
    fused = _convert(_seeded(**model_kwargs), dtype, fused=True)
    cast = _convert(_seeded(**model_kwargs), dtype, fused=False)
    loss, grads = _loss_and_grads(fused, *inputs)
    ref_loss, ref_grads = _loss_and_grads(cast, *inputs)
    assert loss.dtype == ref_loss.dtype == F32
    # The fused loss sums the same fp32 terms in another order: equal up to fp32 rounding. Its
    # gradient (softmax minus one-hot, scaled) is the same fp32 math, rounded once: bit-identical.
    torch.testing.assert_close(loss, ref_loss, **dict(zip(("rtol", "atol"), tolerances(F32), strict=True)))
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == ref.dtype
        torch.testing.assert_close(grad, ref, rtol=0, atol=0)
    return fused


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_o2_cross_entropy_reads_the_low_precision_logits(dtype):
    gm = _assert_same_training_signal({}, dtype)
    (loss,) = _loss_nodes(gm)
    assert loss.target is fp32_cross_entropy
    assert node_info(loss.args[0]).out_dtype == dtype
    assert node_info(loss).in_dtypes[0] == dtype
    assert any("fused" in note for note in node_info(loss).notes)
    assert not _float32_casts_of_logits(gm)
    assert "fp32_cross_entropy" in gm.code


@pytest.mark.parametrize(
    "model_kwargs",
    [
        {"loss": nn.CrossEntropyLoss(ignore_index=0, reduction="sum")},
        {"ignore_index": 0, "reduction": "none"},
    ],
    ids=["module", "functional_none"],
)
def test_loss_arguments_carry_over(model_kwargs):
    gm = _assert_same_training_signal(model_kwargs, F16)
    (loss,) = _loss_nodes(gm)
    assert loss.target is fp32_cross_entropy


@pytest.mark.parametrize(
    "model_kwargs",
    [{"label_smoothing": 0.1}, {"loss": nn.CrossEntropyLoss(weight=torch.rand(VOCAB))}],
    ids=["label_smoothing", "class_weights"],
)
def test_losses_the_kernel_does_not_compute_keep_the_cast(model_kwargs):
    gm = _convert(_seeded(**model_kwargs), F16, fused=True)
    assert len(_float32_casts_of_logits(gm)) == 1
    assert all(n.target is not fp32_cross_entropy for n in _loss_nodes(gm))


def test_a_loss_module_with_hooks_stays_a_module():
    calls: list[str] = []
    loss = nn.CrossEntropyLoss()
    loss.register_forward_hook(lambda m, i, o: calls.append("loss"))
    gm = _convert(_seeded(loss=loss), F16, fused=True)
    assert all(n.target is not fp32_cross_entropy for n in _loss_nodes(gm))
    gm(*_batch())
    assert calls == ["loss"]


def test_logits_also_returned_keep_their_output_cast():
    gm = _assert_same_training_signal({"return_logits": True}, F16)
    (loss,) = _loss_nodes(gm)
    assert loss.target is fp32_cross_entropy and node_info(loss.args[0]).out_dtype == F16
    logits, _ = gm(*_batch())
    assert logits.dtype == F32  # cast_model_outputs


class ScaledLogits(LanguageModel):
    """Logits from a multiply after the head (tanh soft-capping and the like)."""

    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids)))) * 0.5
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _grad_into_input(gm: torch.fx.GraphModule) -> bool:
    (loss,) = _loss_nodes(gm)
    return loss.kwargs.get("grad_into_input", False)


def test_logits_only_the_loss_reads_take_the_gradient_in_place():
    # head (a linear layer: its backward needs its input, not its output) -> view -> loss.
    assert _grad_into_input(_convert(_seeded(), F16, fused=True))
    gm = _convert(_seeded(return_logits=True), F16, fused=True)
    assert not _grad_into_input(gm)  # also returned: the caller reads them
    torch.manual_seed(0)
    assert not _grad_into_input(_convert(ScaledLogits(), F16, fused=True))  # not a known producer


def test_a_second_backward_through_overwritten_logits_is_refused():
    gm = _convert(_seeded(), F16, fused=True)
    loss = gm(*_batch())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


class LossOnly(nn.Module):
    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets)


def test_logits_of_an_assumed_dtype_keep_the_guarded_cast():
    # A model input's dtype is only assumed without example_inputs: float64 logits must reach
    # torch's loss as float64, as under autocast, so nothing is fused.
    gm = _convert(LossOnly(), F16, fused=True)
    assert all(n.target is not fp32_cross_entropy for n in _loss_nodes(gm))
    logits, targets = torch.randn(4, 7, dtype=torch.float64), torch.tensor([0, 6, 2, 3])
    torch.testing.assert_close(gm(logits, targets), F.cross_entropy(logits, targets))
    exact = amp_fx.convert(
        LossOnly(), "O2", policy=preset("O2", F16, "cpu"), example_inputs=(logits.half(), targets)
    )
    (loss,) = _loss_nodes(exact)
    assert loss.target is fp32_cross_entropy  # known float16 logits: read as they are


def test_only_o2_fuses_by_default():
    assert preset("O2").fused_losses and not preset("O1").fused_losses and not preset("O3").fused_losses
    gm = amp_fx.convert(_seeded(), "O1", dtype=F16, device_type="cuda")
    assert all(n.target is not fp32_cross_entropy for n in _loss_nodes(gm))


def test_converting_twice_changes_nothing():
    gm = _convert(_seeded(), F16, fused=True)
    again = amp_fx.convert(gm, "O2", policy=gm.meta["amp_fx_policy"])
    assert again.code == gm.code
    assert fuse_losses(again, Conversion(gm.meta["amp_fx_policy"])) == (again, False)
    again.recompile()
    assert again.code == gm.code  # nothing left to fuse


def test_fused_losses_must_be_a_bool():
    with pytest.raises(TypeError, match="fused_losses must be True or False"):
        preset("O2", fused_losses="yes")


class LogitsAndLoss(nn.Module):
    """A classifier returning its logits and their loss: ``F.cross_entropy``, or ``F.nll_loss`` of
    ``F.log_softmax`` over rows of classes (torch.export records ATen's cross_entropy_loss, or
    log_softmax + nll_loss_nd; the row view shows a torch.fx graph the rank its dim is read in)."""

    def __init__(self, form: str = "cross_entropy", dim: int = -1, **loss_kwargs) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.form, self.dim, self.loss_kwargs = form, dim, loss_kwargs

    def forward(self, x, y):
        logits = self.head(torch.relu(self.fc(x)))
        if self.form == "nll":
            rows = logits.view(-1, logits.size(-1))
            return logits, F.nll_loss(F.log_softmax(rows, dim=self.dim), y, **self.loss_kwargs)
        return logits, F.cross_entropy(logits, y, **self.loss_kwargs)


def _classifier_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=generator)
    y = torch.randint(0, VOCAB, (6,), generator=generator)
    y[1] = -100
    return x, y


def _convert_front_end(model: nn.Module, front_end: str, dtype: torch.dtype) -> nn.Module:
    # keep_logits: the returned logits stay, so no head-and-loss fusion takes the loss first.
    policy = preset("O2", dtype=dtype, device_type="cpu", keep_logits=True)
    return amp_fx.convert(copy.deepcopy(model), "O2", policy=policy, front_end=front_end)


def _reported_losses(converted: nn.Module) -> list[dict]:
    """The report's loss nodes: fused ones (fp32_cross_entropy) or torch's."""
    nodes = amp_fx.report(converted).to_dict()["nodes"]
    return [node for node in nodes if any(op in node["target"] for op in ("cross_entropy", "nll_loss"))]


def _is_fused(node: dict) -> bool:
    return node["target"] == "amp_fx.ops.cross_entropy.fp32_cross_entropy" and any(
        note.startswith("fused: reads the") for note in node["notes"]
    )


@pytest.mark.parametrize(
    ("front_end", "form", "dtype"),
    [
        ("fx", "cross_entropy", BF16),
        ("export", "cross_entropy", BF16),
        ("export", "nll", F16),
        ("fx", "nll", F16),
        ("export", "cross_entropy", F16),
    ],
)
def test_both_front_ends_fuse_a_loss_beside_returned_logits(front_end, form, dtype):
    """ATen's cross_entropy_loss and log_softmax + nll_loss fuse as F.cross_entropy does: the report
    names the fusion, no float32 copy of the logits feeds the loss, and the step trains as under
    autocast and as the float64 model."""
    torch.manual_seed(0)
    model = LogitsAndLoss(form)
    x, y = _classifier_batch()
    autocast = step(with_autocast(model, "cpu", dtype), x, y)
    exact = step(copy.deepcopy(model).double(), x.double(), y)
    converted = _convert_front_end(model, front_end, dtype)
    ours = step(converted, x, y)
    (loss,) = _reported_losses(converted)
    assert _is_fused(loss), loss
    assert loss["in_dtypes"][0] == str(dtype).removeprefix("torch.")
    assert not any(node["op"] == "log_softmax" for node in amp_fx.report(converted).to_dict()["nodes"])
    logits, _ = converted(x, y)
    assert type(logits) is torch.Tensor and logits.dtype == F32  # still returned, as O2 casts outputs
    assert ours[0].dtype == F32
    assert not mismatches(ours, autocast, dtype, "autocast") + mismatches(ours, exact, dtype, "float64")


_NEAR_MISSES = {
    "label_smoothing": lambda: LogitsAndLoss(label_smoothing=0.1),
    "class_weights": lambda: LogitsAndLoss(weight=torch.rand(VOCAB)),
    "nll_class_weights": lambda: LogitsAndLoss("nll", weight=torch.rand(VOCAB)),
    "log_softmax_dim_0": lambda: LogitsAndLoss("nll", dim=0),
}


@pytest.mark.parametrize(
    ("front_end", "make"),
    [
        *[(front_end, make) for make in _NEAR_MISSES.values() for front_end in ("fx", "export")],
        # torch.fx keeps the legacy flag (torch.export folds it into reduction="none", fused).
        ("fx", lambda: LogitsAndLoss(reduce=False)),
    ],
    ids=[*[f"{name}-{fe}" for name in _NEAR_MISSES for fe in ("fx", "export")], "legacy_reduce-fx"],
)
@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
def test_near_misses_stay_unfused_in_both_front_ends(front_end, make):
    """What the fused op does not compute keeps torch's float32 loss, as under autocast."""
    torch.manual_seed(0)
    model = make()
    x, y = _classifier_batch()
    converted = _convert_front_end(model, front_end, BF16)
    _, loss = converted(x, y)
    assert not any(_is_fused(node) for node in _reported_losses(converted))
    _, expected = with_autocast(model, "cpu", BF16)(x, y)
    assert type(loss) is torch.Tensor
    rtol, atol = tolerances(BF16)
    torch.testing.assert_close(loss, expected.float(), rtol=rtol, atol=atol)
