"""fuse_chunked_linear_loss: in graphs captured in training mode, a language model's head and its
cross-entropy (Hugging Face's ``ForCausalLMLoss``: ``logits.float()``, labels padded with -100 and
shifted, ``view(-1, V)``, a mean or a sum divided by ``num_items_in_batch``) become one
`chunked_linear_cross_entropy` call, and the logits the model returns become None.

Reference: the unfused graph's nodes (which must be gone, or left exactly as they were for near
misses), and for the values `tests/test_chunked_lm_loss.py` (O2 against torch.autocast).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import capture_states
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import preset
from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy
from amp_fx.passes.shared.conversion import Conversion
from amp_fx.passes.shared.module_regions import module_paths
from amp_fx.pipeline import rewrite_graph
from amp_fx.testing import assert_close_normwise, grad_tolerances, tolerances, with_autocast
from tests.bit_equality import bits_equal
from tests.models.hf import VOCAB, causal_lm_without_dropout

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _chunked_calls(model: nn.Module) -> list[torch.fx.Node]:
    return [
        node
        for _, state in capture_states(model)
        for graph in state.graphs
        for node in graph.graph.nodes
        if node.target is chunked_linear_cross_entropy
    ]


def _aten_losses(model: nn.Module) -> list[torch.fx.Node]:
    return [
        node
        for _, state in capture_states(model)
        for graph in state.graphs
        for node in graph.graph.nodes
        if node.target is torch.ops.aten.cross_entropy_loss.default
    ]


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("name", "tied"), [("gpt2", True), ("llama", False)])
def test_hugging_face_head_and_loss_become_one_call(name, tied):
    model = causal_lm_without_dropout(name, tied)
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    ids = _ids()
    output = converted(input_ids=ids, labels=ids)
    assert output.logits is None and type(output.loss) is torch.Tensor and output.loss.dtype == torch.float32
    (call,) = _chunked_calls(converted)
    assert not _aten_losses(converted)
    assert call.kwargs == {"ignore_index": -100, "reduction": "mean"}
    assert node_info(call).in_dtypes == (BF16, BF16, torch.int64)
    (note,) = [note for note in node_info(call).notes if "chunked_linear_cross_entropy" in note]
    # The head's name, then every node replaced: the head's call, the loss's cast and view, the loss.
    assert "head lm_head:" in note and len(note.split("; replaced ")[1].split(", ")) >= 4
    assert (converted.lm_head.weight is converted.get_input_embeddings().weight) is tied
    assert module_paths(call)[-1] == "lm_head"  # the head's op: FSDP2 gathers the head for it

    if name != "llama":
        return
    # Trainer's call: a sum divided by the tokens of the whole batch, a graph of its own.
    items = torch.tensor(11)
    summed = converted(input_ids=ids, labels=ids, num_items_in_batch=items)
    calls = _chunked_calls(converted)
    assert len(calls) == 2 and calls[1].kwargs["reduction"] == "sum"
    assert [user.target for user in calls[1].users] == [torch.ops.aten.div.Tensor]
    expected = output.loss * (ids[:, 1:] != -100).sum() / items
    torch.testing.assert_close(
        summed.loss, expected, **dict(zip(("rtol", "atol"), tolerances(torch.float32), strict=True))
    )


def test_eval_and_o1_keep_the_logits():
    model = causal_lm_without_dropout("llama", tied=False)
    ids = _ids()
    evaluated = amp_fx.convert(copy.deepcopy(model).eval(), "O2", dtype=BF16)
    assert evaluated(input_ids=ids, labels=ids).logits.dtype == torch.float32
    o1 = amp_fx.convert(model, "O1", dtype=BF16)  # training, with labels: autocast bit for bit
    output, expected = (
        o1(input_ids=ids, labels=ids),
        with_autocast(model, "cpu", BF16)(input_ids=ids, labels=ids),
    )
    assert bits_equal(output.logits, expected.logits) and bits_equal(output.loss, expected.loss)
    assert not _chunked_calls(evaluated) and not _chunked_calls(o1)


class HeadAndLoss(nn.Module):
    """Hugging Face's causal-LM loss written out; ``variant`` makes one near miss."""

    def __init__(self, variant: str = "", **loss_kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.variant = variant
        self.loss_kwargs = loss_kwargs

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(ids)))
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        if self.variant == "class_dimension":  # (batch, classes, time): no rows of V classes
            loss = F.cross_entropy(logits.float().transpose(1, 2), shifted, **self.loss_kwargs)
        else:
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), shifted.view(-1), **self.loss_kwargs)
        if self.variant == "logits_read":
            return {"loss": loss, "logits": logits, "predicted": logits.argmax(-1)}
        return {"loss": loss, "logits": logits}


def _run(model: nn.Module, policy=None) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    converted = amp_fx.convert(model, "O2", dtype=BF16, policy=policy, front_end="export")
    ids = _ids()
    return converted, converted(ids, ids)


def test_written_out_loss_and_another_ignore_index_fuse():
    """The op computes any ignore_index exactly: -1 (nanoGPT's) fuses as -100 does."""
    for kwargs in ({}, {"ignore_index": -1}):
        converted, output = _run(HeadAndLoss(**kwargs))
        assert output["logits"] is None and type(output["loss"]) is torch.Tensor
        (call,) = _chunked_calls(converted)
        assert call.kwargs["ignore_index"] == kwargs.get("ignore_index", -100)


@pytest.mark.parametrize(
    "make",
    [
        lambda: HeadAndLoss(label_smoothing=0.1),
        lambda: HeadAndLoss(weight=torch.ones(VOCAB)),
        lambda: HeadAndLoss(reduction="none"),
        lambda: HeadAndLoss("logits_read"),
        lambda: HeadAndLoss("class_dimension"),
    ],
    ids=["label_smoothing", "class_weights", "reduction_none", "logits_read_by_argmax", "class_dimension"],
)
def test_near_misses_are_left_alone(make):
    converted, output = _run(make())
    assert not _chunked_calls(converted)
    assert output["logits"].dtype == torch.float32


class ScaledHeadAndLoss(nn.Module):
    """A logit scale between the head and the loss (``logits / 16``, ``logits * 0.0625``: a model
    dividing its logits by a config constant), as ``scale`` writes it; the near misses scale by a
    number that rounds, by one above 1 (fp16 hidden states could overflow), by a tensor, or scale
    the log-probabilities instead."""

    def __init__(self, scale: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.temperature = nn.Parameter(torch.tensor(0.5))
        self.scale = scale

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(ids)))
        logits = {
            "divided": lambda: logits / 16.0,
            "multiplied": lambda: 0.0625 * logits,
            "identity": lambda: logits / 1.0,
            "twice": lambda: logits * 0.5 / 2,
            "enlarging": lambda: logits * 2.0,
            "rounding": lambda: logits / 3.0,
            "tensor": lambda: logits * self.temperature,
            "log_probs": lambda: logits,
        }[self.scale]()
        rows = logits.float().view(-1, VOCAB)
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        if self.scale == "log_probs":
            loss = F.nll_loss(F.log_softmax(rows, -1) * 0.5, shifted.view(-1))
        else:
            loss = F.cross_entropy(rows, shifted.view(-1))
        return {"loss": loss, "logits": logits}


def _loss_and_grads(model: nn.Module, policy) -> tuple[torch.Tensor, dict[str, torch.Tensor], nn.Module]:
    converted = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16, policy=policy, front_end="export")
    ids = _ids()
    output = converted(ids, ids)
    output["loss"].backward()
    grads = {name: p.grad for name, p in converted.named_parameters() if p.grad is not None}
    return output, grads, converted


def assert_like_the_unfused_conversion(model: nn.Module, output, grads) -> None:
    """The fused conversion's loss and gradients are within bf16's tolerances of the unfused O2
    conversion's, which returns real logits."""
    unfused = preset("O2", BF16, "cpu", fused_chunked_linear_loss=False)
    reference, expected, _ = _loss_and_grads(model, unfused)
    assert type(reference["logits"]) is torch.Tensor
    rtol, atol = tolerances(BF16)
    torch.testing.assert_close(output["loss"], reference["loss"], rtol=rtol, atol=atol)
    scale_of_grads = torch.cat([g.flatten() for g in expected.values()]).pow(2).mean().sqrt().item()
    rtol, atol = grad_tolerances(BF16)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert_close_normwise(grad, expected[name], rtol=rtol, atol=atol, scale=scale_of_grads, name=name)


@pytest.mark.parametrize("scale", ["divided", "multiplied", "identity", "twice"])
def test_a_power_of_two_logit_scale_fuses_into_the_head_input(scale):
    """The call reads h * scale: its low-precision logits are the scaled ones, rounded alike, so
    loss and gradients are those of the unfused graph."""
    torch.manual_seed(0)
    model = ScaledHeadAndLoss(scale)
    output, grads, converted = _loss_and_grads(model, preset("O2", BF16, "cpu"))
    assert output["logits"] is None and type(output["loss"]) is torch.Tensor
    (call,) = _chunked_calls(converted)
    scaled = call.args[0]
    expected_scale = 1.0 if scale == "identity" else 0.25 if scale == "twice" else 0.0625
    if expected_scale == 1.0:
        assert node_info(scaled).op != "mul"
    else:
        assert node_info(scaled).op == "mul" and scaled.args[1] == expected_scale
    assert_like_the_unfused_conversion(model, output, grads)


@pytest.mark.parametrize("scale", ["rounding", "enlarging", "tensor", "log_probs"])
def test_other_logit_scales_are_left_alone(scale):
    torch.manual_seed(0)
    converted, output = _run(ScaledHeadAndLoss(scale))
    assert not _chunked_calls(converted)
    assert type(output["logits"]) is torch.Tensor


class SoftcappedHeadAndLoss(nn.Module):
    """Final logit softcapping (Gemma2's ``logits / c; tanh; * c``) between the head and the loss,
    as ``variant`` writes it; the near misses use two different constants, a negative one, a tanh
    without the scales, a logit scale after the cap (the call scales the logits before it), or
    read the tanh elsewhere too."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.variant = variant

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        # Logits of scale ~4 against a cap of 3: the cap's tanh bends them.
        logits = self.head(4 * torch.tanh(self.embed(ids)))
        extra = {}
        if self.variant == "divided":
            logits = logits / 3.0
            logits = torch.tanh(logits)
            logits = logits * 3.0
        elif self.variant == "reciprocal":
            logits = 3.0 * torch.tanh(logits * (1 / 3.0))
        elif self.variant == "power_of_two_cap":  # its steps are no logit scales
            logits = torch.tanh(logits / 2.0) * 2.0
        elif self.variant == "tanh_in_float32":  # a cast between the steps
            logits = 3.0 * torch.tanh((logits / 3.0).float())
        elif self.variant == "scaled_first":
            logits = torch.tanh(logits * 0.5 / 3.0) * 3.0
        elif self.variant == "different_caps":
            logits = torch.tanh(logits / 3.0) * 2.0
        elif self.variant == "negative_cap":
            logits = torch.tanh(logits / -3.0) * -3.0
        elif self.variant == "tanh_only":
            logits = torch.tanh(logits)
        elif self.variant == "scaled_after":
            logits = torch.tanh(logits / 3.0) * 3.0 * 0.5
        elif self.variant == "tanh_read":
            capped = torch.tanh(logits / 3.0)
            extra["tanh"] = capped
            logits = capped * 3.0
        rows = logits.float().view(-1, VOCAB)
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return {"loss": F.cross_entropy(rows, shifted.view(-1)), "logits": logits, **extra}


@pytest.mark.parametrize(
    "variant", ["divided", "reciprocal", "power_of_two_cap", "tanh_in_float32", "scaled_first"]
)
def test_a_softcap_fuses_and_trains_as_the_unfused_graph(variant):
    """The call computes the cap in float32 (softcap=3), where the unfused O2 graph rounds after
    each of its steps in bf16: loss and gradients within bf16's tolerances of it."""
    torch.manual_seed(0)
    model = SoftcappedHeadAndLoss(variant)
    output, grads, converted = _loss_and_grads(model, preset("O2", BF16, "cpu"))
    assert output["logits"] is None and type(output["loss"]) is torch.Tensor
    (call,) = _chunked_calls(converted)
    assert call.kwargs["softcap"] == (2.0 if variant == "power_of_two_cap" else 3.0)
    assert node_info(call.args[0]).op == ("mul" if variant == "scaled_first" else "to")
    assert_like_the_unfused_conversion(model, output, grads)


@pytest.mark.parametrize(
    "variant", ["different_caps", "negative_cap", "tanh_only", "scaled_after", "tanh_read"]
)
def test_softcap_near_misses_are_left_alone(variant):
    torch.manual_seed(0)
    converted, output = _run(SoftcappedHeadAndLoss(variant))
    assert not _chunked_calls(converted)
    assert type(output["logits"]) is torch.Tensor


def test_a_softcap_in_a_torch_fx_graph():
    """The softcap as torch.fx records it (operator.truediv, torch.tanh, operator.mul) fuses alike."""
    torch.manual_seed(0)
    model = SoftcappedHeadAndLoss("divided")
    policy = preset("O2", BF16, "cpu")
    unknown = amp_fx.convert(copy.deepcopy(model), "O2", policy=policy, front_end="fx")
    assert not any(n.target is chunked_linear_cross_entropy for n in unknown.graph.nodes)
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    rewrite_graph(gm, Conversion(policy, training=True))
    (call,) = [n for n in gm.graph.nodes if n.target is chunked_linear_cross_entropy]
    assert call.kwargs["softcap"] == 3.0
    ids = _ids()
    output, expected = gm(ids, ids), unknown(ids, ids)
    assert output["logits"] is None
    rtol, atol = tolerances(BF16)
    torch.testing.assert_close(output["loss"], expected["loss"], rtol=rtol, atol=atol)
    output["loss"].backward()
    expected["loss"].backward()
    weight, reference = gm.get_parameter("head.weight").grad, unknown.get_parameter("head.weight").grad
    rtol, atol = grad_tolerances(BF16)
    assert_close_normwise(weight, reference, rtol=rtol, atol=atol, name="head.weight")


class Classifier(nn.Module):
    """2-D logits read without a view (their rank is in the recorded shapes), the loss written as
    cross_entropy or as nll_loss of log_softmax."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.head = nn.Linear(16, VOCAB)
        self.form = form

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(x))
        if self.form == "nll_loss":
            loss = F.nll_loss(F.log_softmax(logits.float(), dim=-1), y)
        else:
            loss = F.cross_entropy(logits.float(), y)
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("form", ["cross_entropy", "nll_loss"])
def test_rows_shown_by_the_recorded_shapes_and_the_written_out_loss(form):
    """The description `fuse_linear_loss` shares: no view where the capture recorded the rank."""
    torch.manual_seed(0)
    model = Classifier(form)
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 16, generator=generator), torch.randint(0, VOCAB, (6,), generator=generator)
    expected = with_autocast(model, "cpu", BF16)(x, y)["loss"]
    converted = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16, front_end="export")
    output = converted(x, y)
    assert output["logits"] is None and type(output["loss"]) is torch.Tensor
    assert len(_chunked_calls(converted)) == 1
    rtol, atol = tolerances(BF16)
    torch.testing.assert_close(output["loss"], expected, rtol=rtol, atol=atol)


def test_keep_logits_and_the_flag():
    converted, output = _run(HeadAndLoss(), preset("O2", BF16, keep_logits=True))
    assert not _chunked_calls(converted) and output["logits"].dtype == torch.float32
    converted, output = _run(HeadAndLoss(), preset("O2", BF16, fused_chunked_linear_loss=False))
    assert not _chunked_calls(converted) and output["logits"].dtype == torch.float32
    assert preset("O2", device_type="cpu").fused_chunked_linear_loss
    assert preset("O2", device_type="cuda").fused_chunked_linear_loss
    assert not preset("O1").fused_chunked_linear_loss and not preset("O3").fused_chunked_linear_loss
    policy = preset("O2", BF16, "cpu", keep_logits=True)
    assert amp_fx.Policy.from_dict(policy.to_dict()).keep_logits is True and "keep_logits=True" in str(policy)
    with pytest.raises(TypeError, match="keep_logits must be True or False"):
        preset("O2", keep_logits="yes")


def test_torch_fx_graph_of_known_training_mode():
    """The same description matches a torch.fx graph (call_module head, method calls): fused once its
    mode is known to be training; a graph of unknown mode serves eval too and is left alone."""
    model = HeadAndLoss()
    policy = preset("O2", BF16, "cpu")
    unknown = amp_fx.convert(model, "O2", policy=policy, front_end="fx")
    assert not any(n.target is chunked_linear_cross_entropy for n in unknown.graph.nodes)
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    rewrite_graph(gm, Conversion(policy, training=True))
    (call,) = [n for n in gm.graph.nodes if n.target is chunked_linear_cross_entropy]
    assert call.args[1].op == "get_attr" and call.args[1].target == "head.weight"
    ids = _ids()
    output = gm(ids, ids)
    assert output["logits"] is None
    torch.testing.assert_close(output["loss"], unknown(ids, ids)["loss"], rtol=1e-5, atol=1e-5)
