"""Hugging Face models called with their defaults, and ``generate()``, through the torch.export front end.

The default call (``use_cache`` from the config) passes a ``DynamicCache`` (an
``EncoderDecoderCache`` for encoder-decoders) across every module boundary; it is captured whole,
the cache it fills holds real tensors equal to autocast's (O1), and it keeps the compute dtype at
O2 (issue 22). `generate()` captures a handful of graphs, not one per token.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import capture_states
from amp_fx.core.containers import flatten
from amp_fx.testing import with_autocast
from tests.bit_equality import bits_equal
from tests.models.hf import MODELS, VOCAB, bart

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _model(name: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    if name == "bart":
        ids = torch.randint(3, VOCAB, (2, 8))
        return bart(), {"input_ids": ids, "labels": ids.clone()}
    model, make_inputs = MODELS[name]()
    return model, make_inputs(2, 8)


def _islands(model: nn.Module) -> dict[str, list[str]]:
    return {name: list(state.islands.values()) for name, state in capture_states(model) if state.islands}


def _cache_tensors(output) -> list[torch.Tensor]:
    return [leaf for leaf in flatten(output.past_key_values)[0] if isinstance(leaf, torch.Tensor)]


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "gemma3", "t5", "bart", "whisper"])
def test_default_call_is_captured_whole(name: str) -> None:
    """One graph, no island; O1 equals torch.autocast bit for bit, the cache included."""
    model, inputs = _model(name)
    model.eval()
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    output = converted(**inputs)
    reference = with_autocast(model, "cpu", BF16)(**inputs)
    assert not _islands(converted) and len(capture_states(converted)[0][1].graphs) == 1
    assert type(output.loss) is torch.Tensor and bits_equal(output.loss, reference.loss)
    assert bits_equal(output.logits, reference.logits)
    cache, expected = _cache_tensors(output), _cache_tensors(reference)
    assert len(cache) == len(expected)  # BART drops its cache when given labels, as its docs say
    assert all(type(t) is torch.Tensor and bits_equal(t, e) for t, e in zip(cache, expected, strict=True))


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_o2_keeps_the_cache_in_the_compute_dtype(name: str) -> None:
    """O2's float32 outputs are the logits and the loss; a KV cache in float32 would double.
    Evaluated: in training the head and its loss run fused and the logits are None."""
    model, inputs = _model(name)
    output = amp_fx.convert(model.eval(), "O2", dtype=BF16)(**inputs)
    assert output.logits.dtype == torch.float32 and output.loss.dtype == torch.float32
    assert {t.dtype for t in _cache_tensors(output)} == {BF16}


def test_the_capturing_call_frees_its_outputs() -> None:
    """Dropping the first call's output frees its loss and cache at once, as after any other call:
    torch.export's reference cycles would otherwise hold them (4 GiB on GPT-2 16 x 1024)."""
    model, inputs = _model("gpt2")
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    gc.collect()
    gc.disable()
    try:
        output = converted(**inputs)
        loss, cache = weakref.ref(output.loss), weakref.ref(output.past_key_values)
        del output
        assert loss() is None and cache() is None
    finally:
        gc.enable()


def test_a_cache_the_callee_fills_holds_what_the_original_leaves_there() -> None:
    """``DynamicCache.update`` appends to the caller's cache: after a captured call the caller's
    own cache object holds real tensors, equal to those the original model leaves in its cache."""
    from transformers.cache_utils import DynamicCache

    model, inputs = _model("llama")
    model.eval()
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    reference = with_autocast(model, "cpu", BF16)
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    ids = inputs["input_ids"]
    for step in (ids[:, :6], ids[:, 6:7], ids[:, 7:]):  # a prefill, then two decode steps
        converted(input_ids=step, past_key_values=caches[0])
        reference(input_ids=step, past_key_values=caches[1])
        mine, theirs = flatten(caches[0])[0], flatten(caches[1])[0]
        assert len(mine) == len(theirs) and mine[0].shape[-2] == theirs[0].shape[-2]
        assert all(type(t) is torch.Tensor and bits_equal(t, e) for t, e in zip(mine, theirs, strict=True))


@dataclasses.dataclass(eq=False)
class _Images:
    """A container type no code has seen: a dataclass of tensors plus sizes, filled in place."""

    tensors: torch.Tensor
    sizes: list[tuple[int, int]]
    features: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _UnhashableImages(_Images):
    """The same, unhashable (a dataclass with ``eq=True`` sets ``__hash__`` to None)."""


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, images: _Images) -> _Images:
        images.features.append(self.proj(images.tensors))
        return images


class _Detector(nn.Module):
    def __init__(self, container: type) -> None:
        super().__init__()
        self.container = container
        self.backbone = _Backbone()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> dict:
        images = self.backbone(self.container(x, [(x.shape[0], x.shape[1])]))
        return {"scores": self.head(images.features[-1]), "images": images}


OLD_TORCH = tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 14)


@pytest.mark.parametrize(
    "container",
    [
        _Images,
        pytest.param(
            _UnhashableImages,
            marks=pytest.mark.skipif(
                OLD_TORCH,
                reason="torch 2.11's export hashes an object the captured code creates: an island",
            ),
        ),
    ],
)
def test_unknown_containers_cross_boundaries(container: type) -> None:
    torch.manual_seed(0)
    model = _Detector(container)
    converted = amp_fx.convert(model, "O1", dtype=BF16, front_end="export")
    x = torch.randn(3, 4)
    output = converted(x)
    reference = with_autocast(model, "cpu", BF16)(x)
    assert not _islands(converted)
    assert type(output["images"]) is container and output["images"].sizes == [(3, 4)]
    assert bits_equal(output["scores"], reference["scores"])
    assert bits_equal(output["images"].features[0], reference["images"].features[0])
    # A captured child fills the caller's object in place.
    images = container(x, [(3, 4)])
    child = amp_fx.convert(model.backbone, "O1", dtype=BF16, front_end="export")
    assert child(images) is images and type(images.features[0]) is torch.Tensor
    assert bits_equal(images.features[0], reference["images"].features[0])


def _graphs(model: nn.Module) -> int:
    return sum(len(state.graphs) for _, state in capture_states(model))


@pytest.mark.parametrize(
    ("name", "opt_level"),
    [
        ("llama", "O1"),
        ("llama", "O2"),
        pytest.param("mistral", "O1", marks=pytest.mark.slow),
        pytest.param("gemma3", "O1", marks=pytest.mark.slow),
    ],
)
def test_generate_greedy_and_sampled(name: str, opt_level: str) -> None:
    """Mistral's and Gemma 3's sliding-window caches count their tokens in an int: the count is an
    input of the graph, not a constant that would make every new token a new capture."""
    model, inputs = _model(name)
    model.eval()
    converted = amp_fx.convert(model, opt_level, dtype=BF16)
    reference = with_autocast(model, "cpu", BF16)
    ids = inputs["input_ids"]
    tokens = converted.generate(ids, max_new_tokens=8, do_sample=False)
    assert type(tokens) is torch.Tensor and tokens.shape == (2, 16)
    assert not _islands(converted) and _graphs(converted) <= 4
    if opt_level == "O1":
        assert torch.equal(tokens, reference.generate(ids, max_new_tokens=8, do_sample=False))
        torch.manual_seed(3)
        sampled = converted.generate(ids, max_new_tokens=8, do_sample=True)
        torch.manual_seed(3)
        assert torch.equal(sampled, reference.generate(ids, max_new_tokens=8, do_sample=True))
    before = _graphs(converted)
    converted.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)  # batch 1, another length
    assert _graphs(converted) <= before + 2


def test_o2_sees_a_cache_passed_in_as_it_is() -> None:
    """A cache's tensors are the model's state, not input data: O2 does not cast them to the low
    dtype at entry, as it casts the model's inputs. The cache then holds what autocast's would, and
    a graph taking a cache fits the cache it returns (transformers 5.17 leaves an FP32 value cache
    after the prompt; an entry cast made every second token a new capture)."""
    model, inputs = _model("llama")
    model.eval()
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    ids = inputs["input_ids"]
    with torch.no_grad():
        cache = converted(ids).past_key_values
    for layer in cache.layers:
        layer.values = layer.values.float()
    reference_cache = copy.deepcopy(cache)
    step = ids[:, -1:]
    with torch.no_grad():
        converted(step, past_key_values=cache)
        graphs = _graphs(converted)
        converted(step, past_key_values=cache)
        assert _graphs(converted) == graphs
        with_autocast(model, "cpu", BF16)(step, past_key_values=reference_cache)
        with_autocast(model, "cpu", BF16)(step, past_key_values=reference_cache)
    for mine, theirs in zip(cache.layers, reference_cache.layers, strict=True):
        assert type(mine.values) is torch.Tensor and mine.values.dtype == theirs.values.dtype == torch.float32
        assert mine.keys.dtype == theirs.keys.dtype and mine.values.shape == theirs.values.shape


def test_mixture_of_experts_islands_are_few_and_named() -> None:
    """Expert routing may be data-dependent: an island is allowed there, naming the line that
    forces it, and holding at most a quarter of the parameters."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    ids = torch.randint(0, VOCAB, (2, 8))
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    output = converted(input_ids=ids, labels=ids)
    assert bits_equal(output.logits, with_autocast(model, "cpu", BF16)(input_ids=ids, labels=ids).logits)
    for reasons in _islands(converted).values():
        assert all(".py:" in reason for reason in reasons), reasons
    assert amp_fx.capture_summary(converted, input_ids=ids, labels=ids).parameter_coverage >= 0.75


def test_coexists_with_transformers_own_cache_registration() -> None:
    """transformers can register DynamicCache as a pytree node itself; the capture works either way
    (a cache is taken apart by its attributes, registered or not) and leaves the registry as found."""
    import torch.utils._pytree as pytree
    from transformers.cache_utils import DynamicCache

    executorch = pytest.importorskip("transformers.integrations.executorch")
    register = getattr(executorch, "register_dynamic_cache_export_support", None)
    if register is None:
        pytest.skip("this transformers has no register_dynamic_cache_export_support")
    registered = DynamicCache in pytree.SUPPORTED_NODES
    register()
    try:
        model, inputs = _model("llama")
        model.eval()
        converted = amp_fx.convert(model, "O1", dtype=BF16)
        output = converted(**inputs)
        assert not _islands(converted)
        assert bits_equal(output.logits, with_autocast(model, "cpu", BF16)(**inputs).logits)
    finally:
        if not registered:
            pytree._deregister_pytree_node(DynamicCache)


@torch.library.custom_op("amp_fx_tests::matmul_inside", mutates_args=())
def _matmul_inside(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight


@_matmul_inside.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


class _LibraryOp(nn.Module):
    """Calls another library's custom op (as transformers' grouped_mm_fallback), whose kernel
    multiplies matrices: autocast casts inside it, not at it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.amp_fx_tests.matmul_inside(x, self.weight) * 2


def test_a_library_custom_op_runs_as_under_autocast() -> None:
    torch.manual_seed(0)
    model, x = _LibraryOp(), torch.randn(3, 4)
    converted = amp_fx.convert(model, "O1", dtype=BF16, front_end="export")
    assert bits_equal(converted(x), with_autocast(model, "cpu", BF16)(x))
