"""TRL's ``SFTTrainer`` with amp_fx, through ``amp_trainer(SFTTrainer)``: the Trainer subclass TRL
users train with, which builds the PEFT model in its ``__init__`` and patches a fused LM head onto
the model after ``Trainer.__init__`` (its loss reads the base model's hidden states directly)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import amp_fx  # noqa: E402
from amp_fx.capture.captured_model import CapturedModel  # noqa: E402
from amp_fx.integrations.transformers import amp_trainer  # noqa: E402
from amp_fx.optim import master_params  # noqa: E402
from tests.integrations.test_transformers_trainer import CYCLE, SEQ, VOCAB, tiny_llama  # noqa: E402

AmpSFTTrainer = amp_trainer(SFTTrainer)
STEPS = 6


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory: token i is the word str(i) (no download)."""
    vocab = {str(i): i for i in range(VOCAB)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token=str(VOCAB - 1), eos_token=str(VOCAB - 2))


def dataset() -> datasets.Dataset:
    """Tokenized counting sequences, as `test_transformers_trainer.sequences`."""
    return datasets.Dataset.from_dict(
        {"input_ids": [[(i + j) % CYCLE for j in range(SEQ)] for i in range(32)]}
    )


def sft_trainer(output_dir: Path, **kwargs: object) -> SFTTrainer:
    args = SFTConfig(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=2e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        bf16=True,
        seed=0,
    )
    return AmpSFTTrainer(
        model=tiny_llama(), args=args, train_dataset=dataset(), processing_class=tokenizer(), **kwargs
    )


def losses(trainer: SFTTrainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_sft_trainer_trains_the_converted_model_through_its_fused_lm_head(tmp_path: Path) -> None:
    trainer = sft_trainer(tmp_path)
    model = trainer.model
    # TRL patched the fused LM head onto the converted model; its loss calls the base model
    # directly, which runs converted too.
    assert isinstance(model, CapturedModel) and "forward" in vars(model)
    assert isinstance(model.model, CapturedModel)
    trainer.train()
    history = losses(trainer)
    assert len(history) == STEPS and history[-1] < 0.7 * history[0], history
    optimizer = trainer.optimizer.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    assert any(p.dtype == torch.bfloat16 for p in params)
    for param, master in zip(params, master_params(optimizer), strict=True):
        assert master.dtype == torch.float32 and torch.equal(master.to(param.dtype), param)


def test_sft_trainer_with_peft_keeps_masters_of_the_adapters_and_saves_them(tmp_path: Path) -> None:
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = sft_trainer(tmp_path, peft_config=lora)
    inner = trainer.model.get_base_model()  # the PEFT wrapper's model, converted, adapters inside
    assert isinstance(inner, CapturedModel) and inner.model.layers[
        0
    ].self_attn.q_proj.base_layer.weight.dtype == (torch.bfloat16)
    trainer.train()
    history = losses(trainer)
    assert all(torch.isfinite(torch.tensor(history))) and history[-1] < history[0], history
    optimizer = trainer.optimizer.optimizer
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert trained and all("lora_" in n for n in trained) and len(held) == len(trained)
    for param, master in zip(held, master_params(optimizer), strict=True):
        assert param.dtype == torch.bfloat16 and master.dtype == torch.float32  # masters of adapters only
    trainer.save_model(str(tmp_path / "adapter"))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    masters = amp_fx.master_state_dict(trainer.model)
    assert saved and all("lora_" in key for key in saved)
    for key, value in saved.items():  # PEFT's file names the adapters without their name ("default")
        assert value.dtype == torch.float32 and torch.equal(
            value, masters[key.replace(".weight", ".default.weight")]
        )
