"""`assert_equivalent` on what people run with Hugging Face models (issue 36).

- The default call (``use_cache`` from the config) returns a ``DynamicCache`` (an
  ``EncoderDecoderCache`` for encoder-decoders): a model against itself, and O1 against
  torch.autocast, pass bit for bit, outputs, cache and gradients (T5's relative position bias
  too, with a padding mask and without).
- The documented O2 training call (``labels=``, train mode) returns logits=None: it is compared by
  the loss, the cache and the gradients, passes, and a final norm 2% off fails (on logits as sharp
  as a trained model's: at random init the loss hardly depends on them).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.testing import assert_equivalent, forward_backward, with_autocast
from tests.models.hf import MODELS, VOCAB, bart, causal_lm_without_dropout

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _default_call(name: str) -> tuple[nn.Module, dict]:
    """The model in eval mode and the inputs of its default call: no labels, no ``use_cache``."""
    torch.manual_seed(0)
    if name == "bart":
        return bart().eval(), {"input_ids": torch.randint(3, VOCAB, (2, 8))}
    model, make_inputs = MODELS[name]()
    inputs = {k: v for k, v in make_inputs(2, 8).items() if k != "labels"}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :4]
    return model.eval(), inputs


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bart", "bert"])
def test_a_default_call_against_itself_is_exact(name: str) -> None:
    model, inputs = _default_call(name)
    assert_equivalent(model, copy.deepcopy(model), (), keyword_inputs=inputs, exact=True)


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bert"])
def test_o1_on_a_default_call_is_autocast_bit_for_bit(name: str) -> None:
    """The README's claim, checked with the API it documents: outputs, the cache (where the
    model returns one) and every gradient."""
    model, inputs = _default_call(name)
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    reference = with_autocast(model, "cpu", BF16)
    run = forward_backward(converted, (), keyword_inputs=inputs)
    assert (run.spec.objects > 0) == (name != "bert")  # the default call returns a cache
    assert_equivalent(reference, converted, (), keyword_inputs=inputs, exact=True, check_grads=False)
    assert_equivalent(reference, converted, (), keyword_inputs=inputs, exact=True)
    wrong = amp_fx.convert(model, "O1", dtype=torch.float16)  # autocast at another dtype
    with pytest.raises(AssertionError, match="bit-identical"):
        assert_equivalent(reference, wrong, (), keyword_inputs=inputs, exact=True)


def _umt5() -> nn.Module:
    config = transformers.UMT5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = transformers.UMT5ForConditionalGeneration(config)
    # transformers 5.17 builds the decoder's self-attention with is_causal=False: with nothing
    # padded, its SDPA path then attends to later tokens eagerly, while a traced graph (torch.export,
    # torch.compile) is given the causal mask. Causal, as transformers 5.24 builds it.
    for block in model.decoder.block:
        block.layer[0].SelfAttention.is_causal = True
    return model


@pytest.mark.parametrize("name", ["t5", "umt5"])
def test_o1_of_a_position_bias_without_padding_is_autocast_bit_for_bit(name: str) -> None:
    """A relative position bias folded into the attention mask: traced, its mask (all True in the
    encoder, causal in the decoder) is expanded over the batch; autocast's is not, and the bias's
    gradient is summed over the batch where autocast sums it. UMT5 has a bias in every layer."""
    torch.manual_seed(0)
    model = (_umt5() if name == "umt5" else MODELS[name]()[0]).eval()
    ids = torch.randint(3, VOCAB, (2, 8))
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    assert_equivalent(with_autocast(model, "cpu", BF16), converted, (), keyword_inputs=inputs, exact=True)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_o2_training_call_is_compared_by_loss_and_gradients(name: str) -> None:
    torch.manual_seed(0)
    model = causal_lm_without_dropout(name, tied=True).train()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(10)  # the tied head too: logits a trained model's size
    ids = torch.randint(0, VOCAB, (2, 8))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    assert converted(**inputs).logits is None  # the head runs fused with its loss
    assert_equivalent(model, converted, (), keyword_inputs=inputs, batches=3)
    wrong = amp_fx.convert(model, "O2", dtype=BF16)
    with torch.no_grad():
        wrong.get_submodule("model.norm" if name == "llama" else "transformer.ln_f").weight.mul_(1.02)
    with pytest.raises(AssertionError, match=r"exceeds 1\.5x.*\n  output\.loss"):
        assert_equivalent(model, wrong, (), keyword_inputs=inputs, batches=3)
