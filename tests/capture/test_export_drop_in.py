"""A model converted by the torch.export front end behaves like the original (issue 21).

A failed call changes nothing, `generate()` and islands are followed by real training, any argument
structure captures (``None`` anywhere), the signature is the original's, the model follows
``.train()``/``.eval()``, pickles, deep-copies and keeps its tied weights, and an island's
descendants are captured at any depth. Models are called as their docs show: Hugging Face ones with
their default arguments.
"""

from __future__ import annotations

import copy
import inspect
import io
import logging
import pickle

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import CapturedModel, capture_states
from amp_fx.optim import FusedAdam
from amp_fx.testing import tolerances, with_autocast
from tests.bit_equality import bits_equal
from tests.models.small import WithCustomBackward

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def _ids(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(1))


def _capture_picture(model: nn.Module) -> list[tuple]:
    """Every module's class and capture state: what a failed call must leave as it was."""
    states = dict(capture_states(model))
    return [
        (
            name,
            type(module),
            len(states[name].graphs) if name in states else None,
            dict(states[name].islands) if name in states else None,
        )
        for name, module in model.named_modules()
    ]


def _check_trains(model: nn.Module, loss: torch.Tensor) -> FusedAdam:
    """Real tensors, and one optimizer step moves every trainable parameter."""
    assert type(loss) is torch.Tensor
    loss.backward()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    for name, param in trainable:
        assert type(param.grad) is torch.Tensor, name
    before = [p.detach().clone() for _, p in trainable]
    optimizer = FusedAdam([p for _, p in trainable], lr=1e-2)
    optimizer.step()
    for (name, param), old in zip(trainable, before, strict=True):
        assert type(param) is nn.Parameter and not torch.equal(param, old), f"{name} did not move"
    return optimizer


@pytest.mark.parametrize(
    "mistake",
    [
        pytest.param(lambda ids: {"input_idz": ids}, id="keyword-typo"),
        pytest.param(lambda ids: {"input_ids": ids.float()}, id="float-ids"),
    ],
)
def test_a_failed_call_changes_nothing_and_training_follows(mistake) -> None:
    converted = amp_fx.convert(_gpt2(), "O2", dtype=BF16)
    ids = _ids()
    before = _capture_picture(converted)
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        converted(**mistake(ids))
    assert _capture_picture(converted) == before
    _check_trains(converted, converted(input_ids=ids, labels=ids).loss)


def _generates_autocasts_tokens(
    model: nn.Module, converted: nn.Module, ids: torch.Tensor, **options
) -> torch.Tensor:
    """Greedy `generate` of `converted` (O1) gives autocast's tokens and logits bit for bit; the tokens."""
    options = {**options, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
    ours = converted.generate(ids, **options)
    with torch.autocast("cpu", dtype=BF16):
        expected = model.generate(ids, **options)
    assert type(ours.sequences) is torch.Tensor and torch.equal(ours.sequences, expected.sequences)
    assert all(bits_equal(a, b) for a, b in zip(ours.logits, expected.logits, strict=True))
    return ours.sequences


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_generate_then_train(opt_level: str) -> None:
    model = _gpt2().eval()  # generation without dropout, then training in train mode
    converted = amp_fx.convert(model, opt_level, dtype=BF16)
    ids = _ids()
    tokens = converted.generate(ids, max_new_tokens=3, do_sample=False)
    assert type(tokens) is torch.Tensor and tokens.shape == (2, 11)
    if opt_level == "O1":  # O1 computes what autocast does, bit for bit: the same tokens and logits
        assert torch.equal(tokens, _generates_autocasts_tokens(model, converted, ids, max_new_tokens=3))
    converted.train()
    _check_trains(converted, converted(input_ids=ids, labels=ids).loss)


def test_generate_on_a_sliding_window_cache_gives_autocasts_tokens() -> None:
    """A sliding-window cache (a Mistral with a window shorter than prompt and answer) drops the
    keys that leave the window and counts its tokens in an int: O1 still gives autocast's tokens
    and logits bit for bit, and the count does not make each new token a new capture."""
    torch.manual_seed(0)
    window = 4
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=window,
    )  # fmt: skip
    model = transformers.MistralForCausalLM(config).eval()
    ids = _ids(batch=2, length=window + 2)
    options = {"attention_mask": torch.ones_like(ids), "max_new_tokens": window + 1}
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    tokens = _generates_autocasts_tokens(model, converted, ids, **options)
    assert tokens.shape == (2, 2 * window + 3)
    # The prompt, then every decoding step in one graph: not one per token.
    assert sum(len(state.graphs) for _, state in capture_states(converted)) == 2
    # The window decides these tokens: without it autocast gives others.
    model.config.sliding_window = None
    with torch.autocast("cpu", dtype=BF16):
        assert not torch.equal(tokens, model.generate(ids, do_sample=False, **options))


def test_a_call_on_fake_tensors_keeps_no_graph() -> None:
    """A capture on someone else's fake tensors (their torch.export of the model) is not kept:
    its graph would compute fake values at the next real call."""
    converted = amp_fx.convert(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "O2", dtype=BF16, front_end="export"
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        converted(mode.from_tensor(torch.randn(2, 4)))
    assert all(not state.graphs for _, state in capture_states(converted))
    assert type(converted(torch.randn(2, 4))) is torch.Tensor


class _Optional(nn.Module):
    """A forward with optional arguments before and after tensor ones, positional or keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, mask=None, bias=None, *, scale=None, shift=None):
        out = self.proj(x)
        if mask is not None:
            out = out * mask
        if bias is not None:
            out = out + bias
        if scale is not None:
            out = out * scale
        return out if shift is None else out + shift


@pytest.mark.parametrize(
    "args, kwargs",
    [
        pytest.param((None,), {}, id="positional-none"),
        pytest.param((None, "t"), {}, id="none-then-tensor"),
        pytest.param((), {"mask": None, "bias": "t"}, id="keyword-none-then-tensor"),
        pytest.param(("t", None), {"scale": None, "shift": "t"}, id="both"),
        pytest.param((), {"scale": 2.0, "shift": None}, id="constant-and-none"),
    ],
)
def test_any_argument_structure_captures(args, kwargs) -> None:
    """None for any argument, in any position, captures; O1 equals torch.autocast bit for bit."""
    torch.manual_seed(0)
    model, x, t = _Optional(), torch.randn(3, 4), torch.randn(3, 4)
    resolve = {"t": t}
    args = tuple(resolve.get(a, a) if isinstance(a, str) else a for a in args)
    kwargs = {k: resolve.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    converted = amp_fx.convert(model, "O1", dtype=BF16, front_end="export")
    output = converted(x, *args, **kwargs)
    reference = with_autocast(model, "cpu", BF16)(x, *args, **kwargs)
    assert type(output) is torch.Tensor and bits_equal(output, reference)
    assert not any(state.islands for _, state in capture_states(converted))


def test_hugging_face_encoder_with_explicit_none() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    model = transformers.BertModel(config).eval()
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    ids = _ids()
    output = converted(input_ids=ids, token_type_ids=None, attention_mask=None)
    reference = with_autocast(model, "cpu", BF16)(input_ids=ids, token_type_ids=None, attention_mask=None)
    assert type(output.last_hidden_state) is torch.Tensor
    assert bits_equal(output.last_hidden_state, reference.last_hidden_state)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(_gpt2, id="gpt2"),
        pytest.param(
            lambda: transformers.BertForSequenceClassification(
                transformers.BertConfig(
                    vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64,
                )
            ),
            id="bert",
        ),
        pytest.param(_Optional, id="hand-written"),
    ],
)  # fmt: skip
def test_signature_is_the_originals(build) -> None:
    model = build()
    converted = amp_fx.convert(model, "O2", dtype=BF16, front_end="export")
    assert inspect.signature(converted.forward) == inspect.signature(model.forward)
    assert converted.forward.__doc__ == model.forward.__doc__


class _ReadsTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        out = self.proj(x)
        return out * 2 if self.training else out


@pytest.mark.parametrize("start_in_train", [True, False])
def test_follows_train_and_eval(start_in_train: bool) -> None:
    torch.manual_seed(0)
    model = _ReadsTraining().train(start_in_train)
    converted = amp_fx.convert(model, "O1", dtype=BF16, front_end="export")
    x = torch.randn(3, 4)
    for mode in (start_in_train, not start_in_train, start_in_train):
        model.train(mode)
        converted.train(mode)
        assert bits_equal(converted(x), with_autocast(model, "cpu", BF16)(x)), mode


def _round_trips(converted: nn.Module) -> dict[str, nn.Module]:
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    return {
        "pickle": pickle.loads(pickle.dumps(converted)),
        "deepcopy": copy.deepcopy(converted),
        "torch.save": torch.load(buffer, weights_only=False),
    }


def test_pickle_torch_save_and_deepcopy_round_trip() -> None:
    converted = amp_fx.convert(_gpt2(), "O2", dtype=BF16).eval()
    ids = _ids()
    expected = converted(input_ids=ids, labels=ids)
    for how, copied in _round_trips(converted).items():
        assert type(copied) is type(converted) and isinstance(copied, CapturedModel), how
        assert copied.lm_head.weight is copied.transformer.wte.weight, how  # still tied
        output = copied(input_ids=ids, labels=ids)
        assert type(output.logits) is torch.Tensor, how
        assert bits_equal(output.logits, expected.logits) and bits_equal(output.loss, expected.loss), how
        assert copied.state_dict().keys() == converted.state_dict().keys(), how


def test_tied_weights_stay_tied_through_convert() -> None:
    converted = amp_fx.convert(_gpt2(), "O2", dtype=BF16)
    assert converted.lm_head.weight is converted.transformer.wte.weight


def test_save_pretrained_saves_the_masters(tmp_path) -> None:
    """After optimizer steps the masters differ from the rounded copies; save_pretrained writes the
    masters, and the original class's from_pretrained gives them back bit for bit, tied."""
    converted = amp_fx.convert(_gpt2(), "O2", dtype=BF16)
    optimizer = FusedAdam(converted.parameters(), lr=1e-2)
    ids = _ids()
    for _ in range(2):
        converted(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    masters = {id(p): s["master_param"] for p, s in optimizer.state.items() if "master_param" in s}
    rounded = converted.transformer.h[0].attn.c_attn.weight
    assert not torch.equal(masters[id(rounded)].to(BF16).float(), masters[id(rounded)])
    converted.save_pretrained(tmp_path)
    loaded = type(_gpt2()).from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    parameters = dict(converted.named_parameters())
    for name, param in loaded.named_parameters():
        saved = parameters[name]
        expected = masters.get(id(saved), saved.detach())
        assert bits_equal(param.detach(), expected), name


def test_from_pretrained_on_the_converted_class_refuses(tmp_path) -> None:
    converted = amp_fx.convert(_gpt2(), "O2", dtype=BF16)
    converted.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"amp_fx.convert\(GPT2LMHeadModel.from_pretrained"):
        type(converted).from_pretrained(tmp_path)


class _Gated(nn.Module):
    """Data-dependent control flow: an island whose code reaches its parameters two levels down."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Module()  # never called itself: the island calls its children
        self.inner.first = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.inner.second = nn.Linear(8, 4)

    def forward(self, x):
        hidden = self.inner.first(x)
        if hidden.sum() > 0:  # data-dependent: this module is an island
            hidden = hidden * 2
        return self.inner.second(hidden)


def test_island_descendants_are_captured_at_any_depth(caplog) -> None:
    torch.manual_seed(0)
    model = _Gated()
    converted = amp_fx.convert(model, "O1", dtype=BF16, front_end="export")
    x = torch.randn(3, 4)
    with caplog.at_level(logging.WARNING, logger="amp_fx.capture.captured_model"):
        for _ in range(2):
            output = converted(x)
    assert bits_equal(output, with_autocast(model, "cpu", BF16)(x))
    states = dict(capture_states(converted))
    assert states[""].islands and "torch.where" in next(iter(states[""].islands.values()))
    assert len(states["inner.first"].graphs) == 1 and len(states["inner.second"].graphs) == 1
    assert len([r for r in caplog.records if "autocast islands" in r.getMessage()]) == 1
    _check_trains(converted, converted(x).float().square().mean())  # an island trains too


class _TwoIslands(nn.Module):
    """Two data-dependent modules (islands) in one call, and an optional keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.first, self.second = _Gated(), _Gated()

    def forward(self, x, scale=None):
        out = self.second(self.first(self.stem(x)))
        return out if scale is None else out * scale


def _island_notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "autocast islands" in r.getMessage()]


def test_one_notice_per_model_and_call_structure(caplog) -> None:
    torch.manual_seed(0)
    converted = amp_fx.convert(_TwoIslands(), "O1", dtype=BF16, front_end="export")
    x = torch.randn(3, 4)
    with caplog.at_level(logging.WARNING, logger="amp_fx.capture.captured_model"):
        for _ in range(3):
            converted(x)
        (notice,) = _island_notices(caplog)  # both islands of the call, in one notice, once
        assert "first (_Gated)" in notice and "second (_Gated)" in notice  # and the root, which calls them
        for _ in range(2):
            converted(x, scale=torch.full((1,), 2.0))  # another call structure: its own notice, once
        assert len(_island_notices(caplog)) == 2


def test_no_notice_without_islands(caplog) -> None:
    converted = amp_fx.convert(_gpt2(), "O2", dtype=BF16)
    ids = _ids()
    with caplog.at_level(logging.WARNING, logger="amp_fx.capture.captured_model"):
        for _ in range(2):
            converted(input_ids=ids, labels=ids)
    assert not any(state.islands for _, state in capture_states(converted))
    assert _island_notices(caplog) == []


def test_lora_model_trains_only_its_adapters() -> None:
    """PEFT's LoRA wrapper (which reaches the transformer through a grandchild) converts whole,
    adapters and frozen base in one graph, and only the adapters are trained (masters for them alone)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _gpt2(),
        peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM", init_lora_weights=False),
    )
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    ids = _ids()
    loss = converted(input_ids=ids, labels=ids).loss
    states = capture_states(converted)  # every part is a captured module; only the root ran
    assert [(name, len(s.graphs), s.islands) for name, s in states if s.graphs or s.islands] == [("", 1, {})]
    read = {id(p) for _, state in capture_states(converted) for g in state.graphs for p in g.parameters()}
    assert all(id(p) in read for p in converted.parameters())
    trainable = {id(p) for p in converted.parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n, p in converted.named_parameters() if p.requires_grad)
    optimizer = _check_trains(converted, loss)
    with_masters = {id(p) for p in converted.parameters() if "master_param" in optimizer.state.get(p, {})}
    low = {id(p) for p in converted.parameters() if p.requires_grad and p.dtype == BF16}
    assert low and with_masters == low


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _saved_bytes_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Bytes the forward saves for the backward (what checkpointing frees), and the gradients; on
    a second call, so that a capture's own tracing is not counted."""
    model(input_ids=ids, labels=ids)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in parameters:  # weights cost nothing to keep
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return saved[0], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("when", ["before", "after", "after-a-call"])
def test_gradient_checkpointing_before_or_after_convert(when: str) -> None:
    """Checkpointing frees what it frees under torch.autocast, and the gradients are autocast's (O1)."""
    ids = _ids(2, 16)
    eager = with_autocast(_llama(), "cpu", BF16)
    eager_plain, _ = _saved_bytes_and_grads(eager, ids)
    eager.gradient_checkpointing_enable()
    eager_checkpointed, eager_grads = _saved_bytes_and_grads(eager, ids)
    model = _llama()
    if when == "before":
        model.gradient_checkpointing_enable()
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    if when == "after-a-call":
        converted(input_ids=ids, labels=ids)
    if when != "before":
        converted.gradient_checkpointing_enable()
    checkpointed, grads = _saved_bytes_and_grads(converted, ids)
    assert eager_checkpointed < 0.5 * eager_plain
    assert checkpointed <= 1.1 * eager_checkpointed, (checkpointed, eager_checkpointed)
    assert all(bits_equal(a, b) for a, b in zip(grads, eager_grads, strict=True))


def test_amp_initialize_and_disable_casts_on_a_hugging_face_model() -> None:
    """Apex's ``amp.disable_casts`` runs the model's own code in FP32 on the stored weights."""
    from amp_fx import amp

    model = _gpt2().eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", dtype=BF16, verbosity=0)
    reference = _gpt2().eval()
    with torch.no_grad():
        for mine, stored in zip(reference.parameters(), model.parameters(), strict=True):
            mine.copy_(stored.float())
    ids = _ids()
    with amp.disable_casts():
        output = model(input_ids=ids).logits
    assert type(output) is torch.Tensor and bits_equal(output, reference(input_ids=ids).logits)
    assert not bits_equal(model(input_ids=ids).logits, output)  # converted again outside the block


class _ChoosesWithoutGrad(nn.Module):
    """DeepSeek-V3.2's indexer picks positions under ``torch.no_grad()``: torch.export wraps the
    region in a higher-order op (``wrap_with_set_grad_enabled``) holding a subgraph."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 4)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            picked = self.score(x).float().softmax(-1).topk(2, dim=-1).indices
        return self.proj(x).gather(-1, picked)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_no_grad_region_runs_as_autocast_runs_it(opt_level: str) -> None:
    torch.manual_seed(0)
    model = _ChoosesWithoutGrad()
    x = torch.randn(3, 8)
    converted = amp_fx.convert(copy.deepcopy(model), opt_level, dtype=BF16, front_end="export")
    out = converted(x)
    assert type(out) is torch.Tensor and not dict(capture_states(converted))[""].islands
    if opt_level == "O1":
        assert bits_equal(out, with_autocast(model, "cpu", BF16)(x))
    out.float().sum().backward()
    assert converted.proj.weight.grad is not None and converted.score.weight.grad is None


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_part_called_on_its_own_runs_converted(opt_level: str) -> None:
    """TRL's fused head calls ``model.transformer(...)`` / ``model.model(...)`` on the converted
    model, and people call one layer to probe it: that part runs a rewritten graph of its own, not
    the original code on the stored weights (FP32 at O1, no autocast; a dtype error at O2)."""
    model = _gpt2().eval()
    converted = amp_fx.convert(model, opt_level, dtype=BF16)
    ids = _ids()
    hidden = converted.transformer(input_ids=ids).last_hidden_state
    reference = with_autocast(model.transformer, "cpu", BF16)(input_ids=ids).last_hidden_state
    assert type(hidden) is torch.Tensor
    if opt_level == "O1":
        assert bits_equal(hidden, reference)
    else:
        rtol, atol = tolerances(BF16)
        torch.testing.assert_close(hidden.float(), reference.float(), rtol=rtol, atol=atol)
    assert dict(capture_states(converted))["transformer"].graphs  # its own graph
    converted(input_ids=ids)  # the whole model still captures whole, its parts inside
    assert len(dict(capture_states(converted))[""].graphs) == 1


def test_a_custom_autograd_function_keeps_its_backward() -> None:
    """torch.export records a Function's forward ops, and a graph would differentiate those: the
    module calling it runs in an island (its backward kept, the line named), its layers captured."""
    torch.manual_seed(0)
    model = WithCustomBackward()
    x = torch.randn(3, 4)
    converted = amp_fx.convert(copy.deepcopy(model), "O1", dtype=BF16, front_end="export")
    converted(x).float().sum().backward()
    with torch.autocast("cpu", BF16):
        expected = model(x)
    expected.float().sum().backward()
    assert bits_equal(converted.fc.weight.grad, model.fc.weight.grad)
    states = dict(capture_states(converted))
    (reason,) = states[""].islands.values()
    assert "ClippedGradient" in reason and "small.py" in reason
    assert len(states["fc"].graphs) == 1
    # A first call under no_grad captures for either grad mode too: a later training call on that
    # capture still runs the Function's own backward.
    first_inference = amp_fx.convert(copy.deepcopy(model), "O1", dtype=BF16, front_end="export")
    with torch.no_grad():
        first_inference(x)
    assert dict(capture_states(first_inference))[""].islands
    first_inference(x).float().sum().backward()
    assert bits_equal(first_inference.fc.weight.grad, model.fc.weight.grad)
