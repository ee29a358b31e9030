"""fuse_linear_loss: with ``fused_linear_loss=True`` a language model's head and its FP32 loss run as
one `linear_cross_entropy` call, in graphs of either front end.

Reference: the same conversion without the flag (the head, then `fp32_cross_entropy`): losses and
eager gradients are bit-identical; on torch.compile's path losses agree to float32 summation order
and gradients differ by one low-dtype rounding. Through both front ends (a classifier's
``F.cross_entropy(self.head(x), y)``): the loss and every gradient against torch.autocast's and the
float64 model's, within the suite's per-dtype tolerances.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Policy, preset
from amp_fx.ops.cross_entropy import fp32_cross_entropy, linear_cross_entropy
from amp_fx.passes.fuse_linear_loss import fuse_linear_loss
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.testing import tolerances, with_autocast
from tests.capture.tracer_path import PassThroughMode
from tests.passes.training_signal import mismatches, step

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
VOCAB = 37


class LanguageModel(nn.Module):
    """Embedding -> MLP -> head -> row view -> loss; ``flatten`` picks how the rows are made."""

    def __init__(self, flatten: str = "view_size", tied: bool = False, **loss_kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB, bias=not tied)
        if tied:
            self.head.weight = self.embed.weight
        self.flatten = flatten
        self.loss_kwargs = loss_kwargs

    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids))))
        if self.flatten == "view_size":
            rows = logits.view(-1, logits.size(-1))
        elif self.flatten == "reshape_shape":
            rows = logits.reshape(-1, logits.shape[-1])
        elif self.flatten == "view_number":
            rows = logits.contiguous().view(-1, VOCAB)
        else:
            rows = logits.flatten(0, -2)
        return F.cross_entropy(rows, targets.view(-1), **self.loss_kwargs)


class FunctionalHead(nn.Module):
    """F.linear with an explicit weight and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.weight = nn.Parameter(torch.randn(VOCAB, 16) / 4)
        self.bias = nn.Parameter(torch.randn(VOCAB))

    def forward(self, ids, targets):
        logits = F.linear(self.embed(ids), self.weight, self.bias)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")


class LogitsAlsoReturned(LanguageModel):
    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids))))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class SizesReadElsewhere(LanguageModel):
    """The logits' sizes feed something besides the view: the head must stay."""

    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids))))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        tokens = logits.size(0) * logits.size(1)
        return loss * tokens / tokens


class ScaledLogits(LanguageModel):
    """Logits divided by a constant before the loss: a power of two fuses (the call reads the
    head's input scaled), any other is left alone."""

    def __init__(self, divisor: float = 8.0) -> None:
        super().__init__()
        self.divisor = divisor

    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids)))) / self.divisor
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class SoftcappedLogits(LanguageModel):
    """Gemma2's final logit softcapping, ``c * tanh(logits / c)``: `linear_cross_entropy` computes
    no cap, so it is left to the chunked pass (which runs only on graphs known to train)."""

    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids))))
        logits = torch.tanh(logits / 30.0) * 30.0
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class ClassDimensionLoss(LanguageModel):
    """The loss over (batch, classes, time): not a row view."""

    def forward(self, ids, targets):
        logits = self.head(torch.relu(self.fc(self.embed(ids))))
        return F.cross_entropy(logits.transpose(1, 2), targets)


def _batch():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 5), generator=generator)
    targets = torch.randint(0, VOCAB, (3, 5), generator=generator)
    targets[0, :2] = 0  # ignored where ignore_index=0
    return ids, targets


def _seeded(cls=LanguageModel, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return cls(**kwargs)


def _convert(model: nn.Module, dtype: torch.dtype, fused: bool, **policy_kwargs) -> torch.fx.GraphModule:
    policy = preset("O2", dtype=dtype, device_type="cpu", fused_linear_loss=fused, **policy_kwargs)
    return amp_fx.convert(model, "O2", policy=policy)


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _loss_and_grads(gm: nn.Module, *inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = gm(*inputs)
    loss = out[1] if isinstance(out, tuple) else out
    params = [p for p in gm.parameters() if p.requires_grad]
    return loss, list(torch.autograd.grad(loss.sum(), params))


def _assert_same_training_signal(make, dtype: torch.dtype) -> torch.fx.GraphModule:
    """The fused model, run eagerly and on the path torch.compile takes (the fused op, under a
    pass-through dispatch mode), trains like the unfused one."""
    inputs = _batch()
    fused = _convert(make(), dtype, fused=True)
    unfused = _convert(make(), dtype, fused=False)
    ref_loss, ref_grads = _loss_and_grads(unfused, *inputs)
    eps = torch.finfo(dtype).eps
    rtol, atol = tolerances(F32)
    for path in (contextlib.nullcontext, PassThroughMode):
        with path():
            loss, grads = _loss_and_grads(fused, *inputs)
        assert loss.dtype == ref_loss.dtype == F32
        if path is contextlib.nullcontext:
            torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        else:
            # The op pads the classes to 16 bytes a row (-inf logits): the same float32 math over
            # more columns, summed in another order.
            torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
        for grad, ref in zip(grads, ref_grads, strict=True):
            assert grad.dtype == ref.dtype
            if path is contextlib.nullcontext:
                # Eagerly the fused call runs the unfused ops in the same order: bit-identical.
                torch.testing.assert_close(grad, ref, rtol=0, atol=0)
            else:
                # On torch.compile's path the logits' gradient is computed in the forward kernel and
                # rounded to the low dtype there, not where the unfused backward rounds it: entries
                # differ by one rounding. Sums of them downstream cancel, so the bound is one unit
                # in the last place of the low dtype at the gradient's scale, not per element.
                scale = ref.abs().max().item()
                torch.testing.assert_close(grad, ref, rtol=eps, atol=eps * scale)
    return fused


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("flatten", ["view_size", "reshape_shape", "view_number", "flatten"])
def test_head_and_loss_become_one_call(dtype, flatten):
    gm = _assert_same_training_signal(lambda: _seeded(flatten=flatten), dtype)
    targets = _targets(gm)
    assert linear_cross_entropy in targets and fp32_cross_entropy not in targets
    assert not any(n.op == "call_module" and n.target == "head" for n in gm.graph.nodes)
    (loss,) = [n for n in gm.graph.nodes if n.target is linear_cross_entropy]
    (note,) = [note for note in node_info(loss).notes if "fused with the linear layer head" in note]
    assert "; replaced head" in note  # the replaced nodes, from the head on
    assert node_info(loss).in_dtypes[:3] == (dtype, dtype, dtype)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _seeded(tied=True),
        lambda: _seeded(ignore_index=0, reduction="none"),
        lambda: _seeded(FunctionalHead),
    ],
    ids=["tied_weights", "ignore_index_none", "functional_linear"],
)
def test_other_heads_and_loss_arguments(make):
    gm = _assert_same_training_signal(make, F16)
    assert linear_cross_entropy in _targets(gm)


def test_a_power_of_two_logit_scale_scales_the_head_input_and_bias():
    """``(h @ W.T + b) / 8`` is ``(h / 8) @ W.T + b / 8`` exactly, value for value, in bf16 (fp16's
    subnormals would round the unfused graph's scaled logit gradients, not the fused call's)."""
    gm = _assert_same_training_signal(lambda: _seeded(ScaledLogits), BF16)
    (loss,) = [n for n in gm.graph.nodes if n.target is linear_cross_entropy]
    rows, _, bias = loss.args[:3]
    assert [node_info(n).op for n in (rows.args[0], bias)] == ["mul", "mul"]
    assert rows.args[0].args[1] == bias.args[1] == 0.125


@pytest.mark.parametrize(
    "make",
    [
        lambda: _seeded(LogitsAlsoReturned),
        lambda: _seeded(SizesReadElsewhere),
        lambda: _seeded(ClassDimensionLoss),
        lambda: _seeded(label_smoothing=0.1),
        lambda: _seeded(ScaledLogits, divisor=3.0),
        lambda: _seeded(SoftcappedLogits),
    ],
    ids=[
        "logits_returned",
        "sizes_read_elsewhere",
        "class_dimension",
        "label_smoothing",
        "rounding_scale",
        "softcap",
    ],
)
def test_left_alone_where_not_exact(make):
    gm = _convert(make(), F16, fused=True)
    assert linear_cross_entropy not in _targets(gm)
    unfused = _convert(make(), F16, fused=False)
    assert gm.code == unfused.code


def test_hooked_head_is_left_alone():
    model = _seeded()
    calls = []
    model.head.register_forward_hook(lambda *args: calls.append(1))
    gm = _convert(model, F16, fused=True)
    assert linear_cross_entropy not in _targets(gm)
    gm(*_batch())
    assert calls == [1]


def test_on_by_default_at_o2_on_cuda_and_needs_fused_losses():
    assert preset("O2", device_type="cuda").fused_linear_loss
    assert preset("O2", torch.bfloat16, "cuda").fused_linear_loss
    assert not preset("O1").fused_linear_loss and not preset("O3").fused_linear_loss
    assert not preset("O2", fused_losses=False).fused_linear_loss
    # Its fused op runs the pure-torch reference off CUDA: off by default there.
    assert not preset("O2", device_type="cpu").fused_linear_loss
    assert linear_cross_entropy not in _targets(amp_fx.convert(_seeded(), "O2", dtype=F16, device_type="cpu"))
    gm = _convert(_seeded(), F16, fused=True, fused_losses=False)
    assert linear_cross_entropy not in _targets(gm) and fp32_cross_entropy not in _targets(gm)


def test_converting_twice_changes_nothing():
    gm = _convert(_seeded(), F16, fused=True)
    again = amp_fx.convert(gm, "O2", policy=gm.meta["amp_fx_policy"])
    assert again.code == gm.code
    assert fuse_linear_loss(again, Conversion(gm.meta["amp_fx_policy"])) == (again, False)
    again.recompile()
    assert again.code == gm.code  # nothing left to fuse
    torch.testing.assert_close(again(*_batch()), gm(*_batch()))


def test_flag_is_checked_reported_and_serialized():
    with pytest.raises(TypeError, match="fused_linear_loss must be True or False"):
        preset("O2", fused_linear_loss="yes")
    policy = preset("O2", F16, "cpu", fused_linear_loss=True)
    assert Policy.from_dict(policy.to_dict()).fused_linear_loss is True
    gm = amp_fx.convert(_seeded(), "O2", policy=policy)
    assert amp_fx.report(gm).to_dict()["policy"]["fused_linear_loss"] is True
    assert "fused_linear_loss=True" in str(policy)


def test_converted_model_compiles_without_graph_breaks():
    gm = _convert(_seeded(), F16, fused=True)
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
    loss, grads = _loss_and_grads(compiled, *_batch())
    # The compiled model runs linear_cross_entropy's op, as the converted model does eagerly
    # under a pass-through dispatch mode: the same kernels, the same bits.
    with PassThroughMode():
        expected_loss, expected_grads = _loss_and_grads(gm, *_batch())
    assert torch.equal(loss, expected_loss)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert torch.equal(grad, expected)


# ---------------------------------------------------------------------------------------------
# Both front ends: one description of the pattern (amp_fx.passes.shared.linear_loss_chains).
# ---------------------------------------------------------------------------------------------


class Classifier(nn.Module):
    """A model of a user's own: ``F.cross_entropy(self.head(x), y)`` on 2-D logits, no view; ``form``
    writes the loss another way (``view``, ``nll``: log_softmax + nll_loss) or makes a near miss."""

    def __init__(self, form: str = "plain", **loss_kwargs) -> None:
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.form = form
        self.loss_kwargs = loss_kwargs

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.body(x)))
        if self.form == "view":
            return F.cross_entropy(logits.view(-1, VOCAB), y, **self.loss_kwargs)
        if self.form in ("nll", "nll_dim_0"):
            dim = 0 if self.form == "nll_dim_0" else -1
            return F.nll_loss(F.log_softmax(logits, dim=dim), y, **self.loss_kwargs)
        if self.form == "returned":
            return F.cross_entropy(logits, y, **self.loss_kwargs), logits
        if self.form == "sequence":  # (batch, time, V) read without a view: dim 1's 3 are the classes
            return F.cross_entropy(logits.view(2, 3, VOCAB), y, **self.loss_kwargs)
        return F.cross_entropy(logits, y, **self.loss_kwargs)


def _classifier_batch():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=generator)
    y = torch.randint(0, VOCAB, (6,), generator=generator)
    y[1] = -100
    return x, y


def _convert_with(model: nn.Module, front_end: str, dtype: torch.dtype = BF16) -> nn.Module:
    policy = preset("O2", dtype=dtype, device_type="cpu", fused_linear_loss=True)
    return amp_fx.convert(copy.deepcopy(model), "O2", policy=policy, front_end=front_end)


def _fused_nodes(converted: nn.Module) -> list[dict]:
    """The report's nodes that are the fused head and loss."""
    nodes = amp_fx.report(converted).to_dict()["nodes"]
    return [node for node in nodes if node["target"] == "amp_fx.ops.cross_entropy.linear_cross_entropy"]


@pytest.mark.parametrize(
    ("front_end", "form", "dtype"),
    [("fx", "view", BF16), ("export", "plain", BF16), ("export", "nll", F16), ("fx", "view", F16)],
)
def test_both_front_ends_fuse_and_train_as_autocast(front_end, form, dtype):
    """The torch.export front end's ATen loss (cross_entropy_loss, or log_softmax + nll_loss) fuses
    as the torch.fx graph's does, no view needed where the capture recorded the logits' rank; the
    report names the fusion, and the step trains as under autocast and as the float64 model."""
    model = _seeded(Classifier, form=form)
    x, y = _classifier_batch()
    autocast = step(with_autocast(model, "cpu", dtype), x, y)
    exact = step(copy.deepcopy(model).double(), x.double(), y)
    converted = _convert_with(model, front_end, dtype)
    ours = step(converted, x, y)
    (fused,) = _fused_nodes(converted)
    assert any("fused with the linear layer head" in note for note in fused["notes"])
    assert fused["in_dtypes"][:3] == [str(dtype).removeprefix("torch.")] * 3
    assert ours[0].dtype == torch.float32
    assert not mismatches(ours, autocast, dtype, "autocast") + mismatches(ours, exact, dtype, "float64")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_export_graph_in_eval_and_every_reduction(reduction):
    """A graph captured in eval (a validation loss) and a per-row loss: only this pass fuses them."""
    model = _seeded(Classifier, reduction=reduction)
    x, y = _classifier_batch()
    converted = _convert_with(model, "export")
    converted.eval()
    with torch.no_grad():
        loss = converted(x, y)
        expected = with_autocast(model, "cpu", BF16)(x, y)
    assert len(_fused_nodes(converted)) == 1
    assert type(loss) is torch.Tensor and loss.dtype == torch.float32 and loss.shape == expected.shape
    rtol, atol = tolerances(BF16)
    torch.testing.assert_close(loss, expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    ("front_end", "make"),
    [
        ("export", lambda: Classifier(label_smoothing=0.1)),
        ("export", lambda: Classifier(weight=torch.rand(VOCAB))),
        ("export", lambda: Classifier("returned")),
        ("export", lambda: Classifier("nll_dim_0")),
        ("export", lambda: Classifier("sequence")),
        ("fx", lambda: Classifier()),  # 2-D logits without a view: their rank is not in the graph
    ],
    ids=[
        "label_smoothing",
        "class_weights",
        "logits_returned",
        "log_softmax_dim_0",
        "classes_in_dim_1",
        "fx_no_view",
    ],
)
def test_near_misses_stay_unfused_in_both_front_ends(front_end, make):
    torch.manual_seed(0)
    model = make()
    converted = _convert_with(model, front_end)
    x, y = _classifier_batch()
    if model.form == "sequence":
        y = torch.randint(0, 3, (2, VOCAB))
    output = converted(x, y)
    assert not _fused_nodes(converted)
    loss = output[0] if isinstance(output, tuple) else output
    assert type(loss) is torch.Tensor and loss.isfinite().all()
