"""`AmpTrainer` trains the model object it is given, as transformers' Trainer does: the model is
converted in place, ``trainer.model is model``, and the common ending ``model.save_pretrained(out)``
writes the trained FP32 masters, which the plain class loads back exactly.

Members: a GPT-2 language model (tied embedding and head) and a BERT classifier, at O2 (FP32
masters apart from the low weights) and O1 (FP32 weights are their own masters), fp16 and bf16.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from amp_fx.integrations.transformers import AmpTrainer  # noqa: E402
from amp_fx.optim import master_params  # noqa: E402

VOCAB, SEQ = 64, 12


def tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


def lm_data(count: int = 16) -> list[dict[str, torch.Tensor]]:
    ids = [(torch.arange(SEQ) + i) % 8 for i in range(count)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def classification_data(count: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)
    return [{"input_ids": x, "labels": x[0] % 3} for x in ids]


MEMBERS = {
    "gpt2-O2-fp16": (tiny_gpt2, lm_data, "O2", {"fp16": True}),
    "bert-O2-bf16": (tiny_bert, classification_data, "O2", {"bf16": True}),
    "bert-O1-fp16": (tiny_bert, classification_data, "O1", {"fp16": True}),
}


def train_in_place(make: Any, data: Any, level: str, flags: dict[str, bool], out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = transformers.TrainingArguments(
        str(out / "run"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **flags,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = AmpTrainer(model=model, args=args, train_dataset=data(), opt_level=level)
        assert trainer.model is model  # before accelerate wraps it
        trainer.train()
    return {"model": model, "trainer": trainer, "initial": initial}


@pytest.mark.parametrize("member", list(MEMBERS))
def test_save_pretrained_of_the_model_passed_in_writes_its_masters(member: str, tmp_path: Path) -> None:
    make, data, level, flags = MEMBERS[member]
    run = train_in_place(make, data, level, flags, tmp_path)
    model, trainer, initial = run["model"], run["trainer"], run["initial"]
    assert trainer.model is model
    # The trainer's masters, by parameter name (the optimizer holds the model's own parameters).
    optimizer = trainer.optimizer.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    masters = {names[id(p)]: m for p, m in zip(held, master_params(optimizer), strict=True)}
    assert all(m.dtype == torch.float32 for m in masters.values())
    if level == "O2":
        low = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        params = dict(model.named_parameters())
        assert low and all(masters[n] is not params[n] for n in low)  # FP32 masters apart

    model.save_pretrained(tmp_path / "saved")
    original_class = type(make())  # the plain class, not amp_fx's converted one
    loaded = original_class.from_pretrained(tmp_path / "saved")
    assert type(loaded) is original_class
    state = dict(loaded.named_parameters())
    for name, master in masters.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], master), name
    moved = [name for name in masters if not torch.equal(masters[name], initial[name])]
    assert len(moved) > len(masters) // 2, f"only {moved} moved from their initial values"
