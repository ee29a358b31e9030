"""Tiny Hugging Face transformers models from configs (random weights, no downloads) and a
function making their keyword inputs for a batch size and sequence length."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VOCAB = 128

Inputs = Callable[[int, int], dict[str, Any]]


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length))


def _causal_lm(batch: int, length: int) -> dict[str, Any]:
    ids = _ids(batch, length)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, -1] = 0  # one padded position: the mask path is taken
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _decoder(cls_config: str, cls_model: str) -> Callable[[], tuple[torch.nn.Module, Inputs]]:
    def build() -> tuple[torch.nn.Module, Inputs]:
        import transformers

        config = getattr(transformers, cls_config)(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return getattr(transformers, cls_model)(config), _causal_lm

    return build


def gpt2() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    return transformers.GPT2LMHeadModel(config), _causal_lm


def bert() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
    )  # fmt: skip

    def inputs(batch: int, length: int) -> dict[str, Any]:
        return {
            "input_ids": _ids(batch, length),
            "attention_mask": torch.ones(batch, length, dtype=torch.long),
            "token_type_ids": torch.zeros(batch, length, dtype=torch.long),
            "labels": torch.randint(0, 3, (batch,)),
        }

    return transformers.BertForSequenceClassification(config), inputs


def t5() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config), _causal_lm


def vit() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=5,
    )  # fmt: skip

    def inputs(batch: int, length: int) -> dict[str, Any]:  # length: the image size is fixed
        return {"pixel_values": torch.randn(batch, 3, 32, 32), "labels": torch.randint(0, 5, (batch,))}

    return transformers.ViTForImageClassification(config), inputs


def whisper() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip

    def inputs(batch: int, length: int) -> dict[str, Any]:
        ids = _ids(batch, length)
        return {
            "input_features": torch.randn(batch, 8, 32),
            "decoder_input_ids": ids,
            "labels": ids.clone(),
        }

    return transformers.WhisperForConditionalGeneration(config), inputs


def gemma3() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    return transformers.Gemma3ForCausalLM(config), _causal_lm


def clip() -> tuple[torch.nn.Module, Inputs]:
    import transformers

    config = transformers.CLIPConfig(
        text_config={"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 16},
        vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 2},
        projection_dim=16,
    )  # fmt: skip

    def inputs(batch: int, length: int) -> dict[str, Any]:
        return {
            "input_ids": _ids(batch, length),
            "attention_mask": torch.ones(batch, length, dtype=torch.long),
            "pixel_values": torch.randn(batch, 3, 32, 32),
            "return_loss": True,
        }

    return transformers.CLIPModel(config), inputs


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Inputs]]] = {
    "gpt2": gpt2,
    "llama": _decoder("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _decoder("MistralConfig", "MistralForCausalLM"),
    "qwen2": _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "whisper": whisper,
    "gemma3": gemma3,
    "clip": clip,
}


def causal_lm_without_dropout(name: str, tied: bool) -> torch.nn.Module:
    """A one-layer GPT-2 ("gpt2") or Llama ("llama") causal LM with no dropout (two runs draw no
    random numbers, so they compare), its head tied to the embedding or not."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def bart() -> torch.nn.Module:
    """A one-layer BART encoder-decoder (its default call holds an ``EncoderDecoderCache``)."""
    import transformers

    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)
