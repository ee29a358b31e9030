"""Lightning with amp_fx: a LightningModule trained by ``Trainer(plugins=[AmpPrecision(...)])``.

The LightningModule is plain Lightning (FP32 model, ``torch.optim.AdamW`` with a no-decay group,
a cosine schedule, ``gradient_clip_val``). The one amp_fx line is the plugin: it converts the
module's network, gives the optimizer FP32 master weights, scales the loss (fp16), clips the
unscaled gradients and logs the loss scale and skipped steps. The checkpoint it writes is FP32:
it loads into the same LightningModule without amp_fx, and ``ckpt_path`` resumes from it.

    python examples/train_lightning.py [--opt-level O2] [--dtype fp16|bf16] [--epochs 3]
"""

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import amp_fx
from amp_fx.integrations.lightning import AmpPrecision

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Classifier(pl.LightningModule):
    """A small MLP classifier; nothing in it knows about amp_fx."""

    def __init__(self, features: int = 32, classes: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(
            nn.Linear(features, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() > 1]
        no_decay = [p for p in self.parameters() if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def synthetic_data(samples: int = 1024, features: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian points labelled by a fixed random linear map: learnable, no download."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=generator)
    labels = (x @ torch.randn(features, classes, generator=generator)).argmax(dim=1)
    return TensorDataset(x, labels)


def accuracy(module: pl.LightningModule, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (module(x).argmax(dim=1) == y).float().mean().item() * 100.0


def main(argv=None):
    """Train, reload the checkpoint without amp_fx, resume; returns the numbers it printed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="lightning")  # advice about workers and loggers
    if args.checkpoint_dir is None:
        with tempfile.TemporaryDirectory(prefix="amp_fx_lightning_") as checkpoint_dir:
            return run(args, Path(checkpoint_dir))
    return run(args, Path(args.checkpoint_dir))


def run(args: argparse.Namespace, checkpoint_dir: Path) -> dict:
    data = synthetic_data(args.samples)
    loader = DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    module = Classifier()
    plugin = AmpPrecision(args.opt_level, dtype=DTYPES[args.dtype])
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        plugins=[plugin],  # instead of precision="16-mixed"
        gradient_clip_val=1.0,  # clips the unscaled gradients
        callbacks=[ModelCheckpoint(dirpath=checkpoint_dir, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    metrics = trainer.callback_metrics
    print(f"{type(module.model).__name__} converted at {args.opt_level} ({args.dtype}):")
    print("  parameter dtypes:", sorted({str(p.dtype) for p in module.parameters()}))
    optimizer = trainer.optimizers[0]
    masters = sorted({str(m.dtype) for m in amp_fx.optim.master_params(optimizer)})
    print(f"  optimizer: {type(optimizer).__name__}, masters {masters}")
    trained = accuracy(module, data)
    print(f"  final loss {metrics['loss'].item():.4f}, train accuracy {trained:.1f}%")
    if "amp_fx/loss_scale" in metrics:
        scale, skipped = metrics["amp_fx/loss_scale"].item(), int(metrics["amp_fx/skipped_steps"].item())
        print(f"  loss scale {scale:g}, skipped steps {skipped}")

    # The checkpoint holds FP32 weights (the masters): the LightningModule loads it without amp_fx.
    last = checkpoint_dir / "last.ckpt"
    weights = torch.load(last, weights_only=True)["state_dict"]
    print(f"checkpoint {last}: weights {sorted({str(w.dtype) for w in weights.values()})}")
    plain = Classifier.load_from_checkpoint(last, map_location="cpu")
    reloaded = accuracy(plain, data)
    print(f"  reloaded into the FP32 Classifier: accuracy {reloaded:.1f}%")

    # Resume for one more epoch from the checkpoint: masters, moments, scaler and schedule continue.
    torch.manual_seed(0)
    resumed = Classifier()
    more = pl.Trainer(
        max_epochs=args.epochs + 1,
        plugins=[AmpPrecision(args.opt_level, dtype=DTYPES[args.dtype])],
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    more.fit(resumed, train_dataloaders=loader, ckpt_path=last)
    print(f"resumed from epoch {args.epochs}: loss {more.callback_metrics['loss'].item():.4f}")
    return {
        "trained_accuracy": trained,
        "reloaded_accuracy": reloaded,
        "weights_dtypes": {w.dtype for w in weights.values()},
        "resumed_steps": more.global_step - trainer.global_step,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
