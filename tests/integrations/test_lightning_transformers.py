"""A Hugging Face model held by a LightningModule, under AmpPrecision: torch.fx cannot trace it, so
`amp_fx.convert` captures it with torch.export; its tied embedding and head stay one parameter, and
its checkpoint keys and FP32 values are the original model's; validation runs it in eval mode."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from amp_fx.integrations.lightning import AmpPrecision

transformers = pytest.importorskip("transformers")
VOCAB, LENGTH = 64, 16


class LanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH)
        self.model = transformers.GPT2LMHeadModel(config)
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)  # eval mode, inference_mode

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_hugging_face_model_trains_tied_and_saves_fp32(tmp_path):
    module = LanguageModel()
    keys = list(module.state_dict())
    ids = torch.randint(0, VOCAB, (8, LENGTH), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="lightning")
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=6,
            plugins=[AmpPrecision("O2", dtype=torch.bfloat16)],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path,
            num_sanity_val_steps=0,
            limit_val_batches=1,
        )
        loader = DataLoader(ids, batch_size=4)
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    # The torch.export front end's copy: a subclass of the model's own class.
    assert isinstance(module.model, transformers.GPT2LMHeadModel)
    assert type(module.model) is not transformers.GPT2LMHeadModel
    assert module.model.lm_head.weight is module.model.transformer.wte.weight
    assert module.model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    assert module.losses[-1] < module.losses[0] < 1.1 * math.log(VOCAB)
    assert trainer.callback_metrics["val_loss"].item() < module.losses[0]
    state = module.state_dict()
    assert list(state) == keys and {v.dtype for v in state.values() if v.is_floating_point()} == {
        torch.float32
    }
