"""The torch.export front end of `amp_fx.convert` on models torch.fx cannot trace whole.

Hugging Face transformers (ten families, tiny configs, random weights), nanoGPT's shape (a size
assert, an optional target, a tied head), a detection model and a model whose forward branches on a
tensor's value. Each is converted with default arguments and checked against its references:
O1 against torch.autocast bit for bit (CPU bf16), O2's dtypes and its error against FP32 within
the relative oracle's bound of autocast's, backward, an optimizer step, state dicts both ways and
a second input shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import CapturedModel
from amp_fx.core.module_ops import module_op
from amp_fx.inspect.capture_summary import capture_summary
from amp_fx.optim import FusedAdam
from amp_fx.testing import RELATIVE_BOUND, error_ratio
from amp_fx.testing.references import with_autocast
from tests.models.hf import MODELS
from tests.models.small import DtypeReading, GatedByValue, NanoGPT

pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _floating(output) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves(output.to_tuple() if hasattr(output, "to_tuple") else output)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]


def _assert_within_the_oracles_bound(
    model: nn.Module, o2: nn.Module, args=(), kwargs=None, pick=None, device_type="cpu", dtype=BF16
) -> None:
    """O2's error against the FP32 ``model`` is within `RELATIVE_BOUND` of torch.autocast's, as
    the relative oracle measures it on the given batch; ``pick`` selects what is compared of each
    output (the loss, where the fused head drops O2's training logits)."""

    def picked(module: nn.Module):
        return module if pick is None else (lambda *a, **k: pick(module(*a, **k)))

    autocast = with_autocast(model, device_type, dtype)
    measured = error_ratio(
        picked(model),
        picked(o2),
        args,
        keyword_inputs=kwargs,
        reference=picked(autocast),
        dtype=dtype,
        check_grads=False,
        batches=1,
    )
    assert not measured.failures(RELATIVE_BOUND), measured.failures(RELATIVE_BOUND)


def _check_trains(converted: nn.Module, loss: torch.Tensor, reference: nn.Module) -> None:
    """Backward reaches the parameters the FP32 model's backward reaches, in their stored dtype,
    and a FusedAdam step moves them, finite."""
    loss.backward()
    trained = {name for name, p in reference.named_parameters() if p.grad is not None}
    for name, param in converted.named_parameters():
        assert (param.grad is not None) == (name in trained), name
        if param.grad is not None:
            assert param.grad.dtype == param.dtype and torch.isfinite(param.grad).all(), name
    # Gradients that are rounding noise in FP32 (attention's q/k in a last layer whose other
    # positions are never read) need not move a low-precision weight.
    learning = {
        name for name, p in reference.named_parameters() if p.grad is not None and p.grad.abs().max() > 1e-4
    }
    before = {name: p.detach().clone() for name, p in converted.named_parameters()}
    FusedAdam(converted.parameters(), lr=1e-2).step()
    for name, param in converted.named_parameters():
        assert torch.isfinite(param).all(), name
        if name in learning:
            assert not torch.equal(param, before[name]), f"{name} did not move"


def _check_o2_storage(converted: nn.Module) -> None:
    """O2 stores the weights of matrix products low and keeps norms' and embeddings' FP32, as for
    traced models; transformers' own norm classes (LlamaRMSNorm, T5LayerNorm) count as norms."""
    kinds = {"linear": BF16, "conv1d": BF16, "conv2d": BF16, "layer_norm": torch.float32}
    kinds |= {"rms_norm": torch.float32, "embedding": torch.float32}
    modules = [(name, module, module_op(module)) for name, module in converted.named_modules()]
    # A head tied to an embedding (GPT-2, T5, Gemma, Whisper) shares its FP32 table.
    tied = {id(m.weight) for _, m, op in modules if op == "embedding"}
    seen = set()
    for name, module, op in modules:
        if op in kinds and getattr(module, "weight", None) is not None:
            want = torch.float32 if id(module.weight) in tied else kinds[op]
            assert module.weight.dtype == want, (name, op, module.weight.dtype)
            seen.add(op)
    assert {"linear", "embedding"} & seen or {"conv2d", "linear"} <= seen, seen


def _check_state_dicts(converted: nn.Module, model: nn.Module) -> None:
    assert list(converted.state_dict()) == list(model.state_dict())
    converted.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(converted.state_dict(), strict=True)


# The decoders like Llama, and the encoders like BERT/ViT, run with -m slow: the suite stays under
# its 10 minutes on 2 cores, and test_default_calls covers their default calls.
_SLOW_MODELS = {"bert", "clip", "gemma3", "mistral", "qwen2", "vit"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_MODELS else n for n in sorted(MODELS)]
)
def test_hugging_face_model(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()  # no dropout: O1 is compared with autocast bit for bit
    batch = inputs(2, 8)
    reference = model(**batch)
    reference.loss.backward()
    with torch.autocast("cpu", dtype=BF16):
        autocast = model(**batch)

    o1 = amp_fx.convert(model, "O1", dtype=BF16)
    assert isinstance(o1, type(model)) and isinstance(o1, CapturedModel)
    output = o1(**batch)
    assert type(output) is type(reference)
    for got, want in zip(_floating(output), _floating(autocast), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)

    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    output = o2(**batch)
    assert type(output) is type(reference)
    assert all(t.dtype == torch.float32 for t in _floating(output))
    _check_o2_storage(o2)
    _assert_within_the_oracles_bound(model, o2, kwargs=batch)
    _check_trains(o2, output.loss, model)
    _check_state_dicts(o2, model)

    summary = capture_summary(o2)
    assert summary.parameter_coverage == 1.0 and not summary.islands
    # Another batch size and sequence length: captured once more, with dynamic sizes.
    second = o2(**inputs(3, 6))
    assert type(second) is type(reference) and summary.graphs + 1 == capture_summary(o2).graphs


def test_nanogpt_shape_with_its_assert_and_optional_targets():
    torch.manual_seed(0)
    model = NanoGPT().train()  # dropout-free; the train-mode graph is the one training uses
    idx = torch.randint(0, 64, (2, 8))
    logits, loss = model(idx, idx)
    with torch.autocast("cpu", dtype=BF16):
        auto_logits, auto_loss = model(idx, idx)

    o1 = amp_fx.convert(model, "O1", dtype=BF16)
    got_logits, got_loss = o1(idx, idx)
    assert torch.equal(got_logits, auto_logits) and torch.equal(got_loss, auto_loss)

    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    # The known bug: the integer targets must not be cast (cross_entropy refuses float targets).
    o2_logits, o2_loss = o2(idx, idx)
    # In training the head and its loss run fused, chunk by chunk: no logits are returned.
    assert o2_logits is None and type(o2_loss) is torch.Tensor and o2_loss.dtype == torch.float32
    _assert_within_the_oracles_bound(model, o2, (idx, idx), pick=lambda output: output[1])
    assert o2.wte.weight is o2.lm_head.weight  # tying kept
    logits_only, no_loss = o2(idx)  # targets=None: another argument structure, another graph
    assert no_loss is None and logits_only.dtype == torch.float32
    _assert_within_the_oracles_bound(model, o2, (idx,))
    loss.backward()
    _check_trains(o2, o2_loss, model)
    _check_state_dicts(o2, model)
    _, shorter_loss = o2(idx[:, :5].contiguous(), idx[:, :5].contiguous())
    assert shorter_loss.shape == () and o2(idx[:, :5].contiguous())[0].shape == (2, 5, 64)
    with pytest.raises(AssertionError, match="Cannot forward sequence of length 20"):
        o2(torch.randint(0, 64, (2, 20)))  # the model's own assert, as eagerly


def test_data_dependent_forward_runs_in_an_island_around_captured_children():
    torch.manual_seed(0)
    model = GatedByValue()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=BF16):
        autocast = model(x)
    o1 = amp_fx.convert(model, "O1", dtype=BF16)
    assert torch.equal(o1(x), autocast)
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    output = o2(x)
    assert output.dtype == torch.float32  # the island's outputs, at O2
    summary = capture_summary(o2)
    (reason,) = summary.islands.values()
    assert "small.py" in reason and "h.mean() > 0" in reason  # the line that stopped torch.export
    assert isinstance(o2.encoder, CapturedModel) and capture_summary(o2.encoder).graphs == 1
    assert 0.5 < summary.parameter_coverage < 1.0  # the head not taken was never run
    assert o2.encoder[0].weight.dtype == BF16 and o2.encoder[1].weight.dtype == torch.float32
    _check_state_dicts(o2, model)


def test_island_outputs_in_float64_stay_float64_at_o2():
    # As on the fx front end (cast_if_floating) and under autocast: float64 is never cast.
    class GatedWithStatistics(GatedByValue):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            probabilities = super().forward(x)
            return probabilities, probabilities.double().sum(-1)

    torch.manual_seed(0)
    o2 = amp_fx.convert(GatedWithStatistics(), "O2", dtype=BF16)
    probabilities, sums = o2(torch.randn(4, 8))
    assert capture_summary(o2).islands  # the outputs come from the island
    assert (probabilities.dtype, sums.dtype) == (torch.float32, torch.float64)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_code_that_reads_the_running_dtype_sees_the_converted_dtype(level):
    torch.manual_seed(0)
    model = DtypeReading()
    x = torch.randn(3, 5, 16)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1] = False  # a fully masked row: finite only if the fill value is bf16's own minimum
    with torch.autocast("cpu", dtype=BF16):
        autocast = model(x, keep)
    converted = amp_fx.convert(model, level, dtype=BF16)
    output = converted(x, keep)
    assert torch.isfinite(output).all() and torch.isfinite(autocast).all()
    if level == "O1":
        assert torch.equal(output, autocast)
    else:
        assert output.dtype == torch.float32
        _assert_within_the_oracles_bound(model, converted, (x, keep))


def test_attention_masks_that_are_all_true_are_dropped():
    # Traced, transformers always builds a mask; ViT's (arange >= 0) is True everywhere and would
    # keep SDPA off its fused kernels (not bit-identical to autocast on CUDA). BERT's reads its
    # attention_mask and stays.
    masks = {}
    for name in ("vit", "bert"):
        model, inputs = MODELS[name]()
        converted = amp_fx.convert(model.eval(), "O1", dtype=BF16)
        converted(**inputs(2, 8))
        (graph,) = amp_fx.captured_graphs(converted)
        calls = graph.graph.find_nodes(
            op="call_function", target=torch.ops.aten.scaled_dot_product_attention.default
        )
        masks[name] = {call.args[3] is None if len(call.args) > 3 else True for call in calls}
    assert masks == {"vit": {True}, "bert": {False}}


def test_a_call_that_fails_eagerly_raises_its_error_and_leaves_no_island():
    o2 = amp_fx.convert(NanoGPT(), "O2", dtype=BF16)
    idx = torch.randint(0, 64, (2, 8))[:, :5]  # not contiguous: targets.view(-1) fails eagerly too
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        o2(idx, idx)
    assert not capture_summary(o2).islands
    assert o2(idx.contiguous(), idx.contiguous())[1].dtype == torch.float32


def test_detection_model_converts_around_its_data_dependent_parts():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=3
    ).train()
    images = [torch.rand(3, 96, 96) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 60.0, 70.0]]), "labels": torch.tensor([1])}] * 2
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    losses = converted(images, targets)
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"}
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
    summary = capture_summary(converted)
    assert "" in summary.islands and "roi_heads" in summary.islands  # the model's and RoIHeads' code
    assert summary.parameter_coverage > 0.9
    sum(losses.values()).backward()
    assert all(p.grad is not None for p in converted.backbone.parameters() if p.requires_grad)
    _check_state_dicts(converted, model)


def test_converting_a_converted_model_is_refused():
    converted = amp_fx.convert(NanoGPT(), "O2", dtype=BF16)
    with pytest.raises(TypeError, match="convert the original model"):
        amp_fx.convert(converted, "O1")


def test_moving_the_model_drops_its_graphs():
    converted = amp_fx.convert(GatedByValue().encoder, "O1", front_end="export", dtype=BF16)
    x = torch.randn(2, 8)
    converted(x)
    assert capture_summary(converted).graphs == 1
    converted.to(torch.device("cpu"))
    assert capture_summary(converted).graphs == 0
    assert converted(x).dtype == BF16 and capture_summary(converted).graphs == 1


def test_torch_fx_options_with_the_export_front_end_are_refused_or_logged(caplog):
    model = NanoGPT()
    with pytest.raises(ValueError, match="leaf_modules and concrete_args are torch.fx's"):
        amp_fx.convert(model, "O1", dtype=BF16, front_end="export", leaf_modules=[nn.Linear])
    with caplog.at_level("WARNING", logger="amp_fx.convert"):
        converted = amp_fx.convert(model, "O1", dtype=BF16, leaf_modules=[nn.Linear])
    assert isinstance(converted, CapturedModel)  # torch.fx stopped at nanoGPT's assert
    assert "leaf_modules are torch.fx's and the torch.export front end ignores them" in caplog.text


def test_unknown_front_end_is_refused():
    with pytest.raises(ValueError, match="front_end must be one of 'auto', 'fx', 'export'"):
        amp_fx.convert(nn.Linear(2, 2), "O1", front_end="dynamo")


def test_trains_under_torch_compile_with_one_capture_per_structure():
    torch.manual_seed(0)
    model, inputs = MODELS["llama"]()
    converted = amp_fx.convert(model.eval(), "O2", dtype=BF16)
    batch = inputs(2, 8)
    eager = converted(**batch)
    compiled = torch.compile(converted, backend="aot_eager")
    output = compiled(**batch)
    assert type(output) is type(eager) and torch.equal(output.logits, eager.logits)
    output.loss.backward()
    assert all(p.grad is not None for p in converted.parameters())
    assert compiled(**inputs(3, 6)).logits.shape == (3, 6, 128)
    assert capture_summary(converted).graphs == 2


def test_compiled_loss_keeps_the_graph_whole_once_captured():
    # The graph for a call is chosen in code Dynamo traces: no graph break inside the model, so
    # a compiled `model(...).loss` outputs the loss only, not O2's float32 logits as well.
    torch.manual_seed(0)
    model, inputs = MODELS["gpt2"]()
    converted = amp_fx.convert(model.eval(), "O2", dtype=BF16)
    batch = inputs(2, 8)
    eager = converted(**batch).loss
    outputs = []

    def recording(gm, example_inputs):
        outputs.append([node.name for node in gm.graph.find_nodes(op="output")[0].all_input_nodes])
        return gm

    compiled = torch.compile(lambda **kwargs: converted(**kwargs).loss, backend=recording)
    assert torch.equal(compiled(**batch), eager)
    assert len(outputs) == 1 and len(outputs[0]) == 1


def test_trains_through_amp_initialize_and_scale_loss():
    from amp_fx import amp

    torch.manual_seed(0)
    model, inputs = MODELS["gpt2"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    converted, optimizer = amp.initialize(model.eval(), optimizer, opt_level="O2", verbosity=0)
    assert isinstance(converted, CapturedModel)
    assert converted.transformer.h[0].attn.c_attn.weight.dtype == torch.float16
    before = [p.detach().clone() for p in converted.parameters()]
    loss = converted(**inputs(2, 8)).loss
    assert loss.dtype == torch.float32
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    moved = [not torch.equal(p, b) for p, b in zip(converted.parameters(), before, strict=True)]
    assert sum(moved) > len(moved) // 2


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hugging_face_model_o1_equals_autocast_on_cuda_fp16(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model = model.eval().cuda()
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs(2, 8).items()}
    with torch.autocast("cuda", dtype=torch.float16):
        autocast = model(**batch)
    output = amp_fx.convert(model, "O1")(**batch)
    for got, want in zip(_floating(output), _floating(autocast), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    o2 = amp_fx.convert(model, "O2")
    _assert_within_the_oracles_bound(model, o2, kwargs=batch, device_type="cuda", dtype=torch.float16)
