"""A small GPT-2 learns the Python standard library's source, byte by byte, through Hugging Face's
Trainer with amp_fx: `AmpTrainer` in place of ``transformers.Trainer``, one argument more.

    trainer = AmpTrainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=train,
                         eval_dataset=held_out, opt_level="O2")
    trainer.train()
    trainer.save_model(path)      # the FP32 masters: GPT2LMHeadModel.from_pretrained(path) loads them

The model is built from a config (no download) and trained at O2: matrix products in bf16 (or
fp16 with ``--dtype fp16``, then a dynamic loss scale, logged with the steps it skipped), FP32
master weights in amp_fx's FusedAdam, gradients clipped at their true norm. It evaluates on held-out
text, saves, reloads the saved model with the original class and checks that it holds the masters,
then continues from the last checkpoint to show that resuming picks up where training stopped.
Runs on a CPU in well under a minute with its defaults::

    python examples/train_hf_trainer.py
    python examples/train_hf_trainer.py --dtype fp16 --steps 60
    torchrun --nproc_per_node=2 examples/train_hf_trainer.py      # DistributedDataParallel
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import tempfile

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, TrainerCallback, TrainingArguments

import amp_fx
from amp_fx.integrations.transformers import AmpTrainer

VOCAB_SIZE = 256  # bytes


def stdlib_windows(block_size: int, max_bytes: int) -> tuple[list[dict], list[dict]]:
    """Windows of ``block_size`` bytes of the standard library's .py files: 90% to train on, 10% held out."""
    root = sysconfig.get_paths()["stdlib"]
    data = b""
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and len(data) < max_bytes:
            with open(os.path.join(root, name), "rb") as handle:
                data += handle.read()
    tokens = torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).long()
    windows = [
        {"input_ids": w, "labels": w}
        for w in tokens[: len(tokens) // block_size * block_size].view(-1, block_size)
    ]
    split = len(windows) * 9 // 10
    return windows[:split], windows[split:]


class PrintLogs(TrainerCallback):
    """One line per logging step (rank 0): loss, the true gradient norm, and under fp16 the loss scale."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        line = f"step {state.global_step:4d}  loss {logs['loss']:.3f}  grad norm {logs['grad_norm']:.2f}"
        if "loss_scale" in logs:
            line += f"  loss scale {logs['loss_scale']:g}  skipped {logs['skipped_steps']}"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--corpus-bytes", type=int, default=200_000)
    parser.add_argument(
        "--output-dir",
        default=os.path.join(tempfile.gettempdir(), "amp_fx_train_hf_trainer"),
        help="checkpoints and the saved model (one folder for every process of a torchrun job)",
    )
    args = parser.parse_args(argv)
    output_dir = args.output_dir
    transformers.logging.set_verbosity_error()  # the lines below say what happens
    transformers.logging.disable_progress_bar()

    train, held_out = stdlib_windows(args.block_size, args.corpus_bytes)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=args.block_size,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    half = args.steps // 2
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=args.steps // 10,
        logging_steps=max(1, args.steps // 8),
        save_strategy="steps",
        save_steps=half,  # a checkpoint half-way, to resume from below
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        **{args.dtype: True},  # fp16=True or bf16=True picks AmpTrainer's dtype
    )
    trainer = AmpTrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=held_out,
        opt_level=args.opt_level,
        callbacks=[PrintLogs()],
    )
    trainer.remove_callback(PrinterCallback)  # PrintLogs prints the logs, shorter

    def say(text: str) -> None:  # once, on the first process of a torchrun job
        if trainer.is_world_process_zero():
            print(text, flush=True)

    say(
        f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters) at "
        f"{args.opt_level} {args.dtype}, {len(train)} windows of {args.block_size} bytes, "
        f"{trainer.args.device}"
    )
    trainer.train()
    evaluation = trainer.evaluate()
    say(f"held-out loss {evaluation['eval_loss']:.3f}")

    saved = os.path.join(output_dir, "final")
    trainer.save_model(saved)
    exact = True
    if trainer.is_world_process_zero():  # the process that saved
        reloaded = GPT2LMHeadModel.from_pretrained(saved)
        masters = amp_fx.master_state_dict(trainer.model)
        exact = all(
            torch.equal(v, masters[k].cpu()) for k, v in reloaded.state_dict().items() if k in masters
        )
        dtypes = sorted({str(p.dtype) for p in reloaded.parameters()})
        say(f"saved to {saved}: {', '.join(dtypes)} weights, equal to the FP32 masters: {exact}")

    # A new trainer continues from the half-way checkpoint: its steps are the ones the first run took.
    resumed = AmpTrainer(
        model=GPT2LMHeadModel(config), args=training_args, train_dataset=train, opt_level=args.opt_level
    )
    resumed.remove_callback(PrinterCallback)
    resumed.train(resume_from_checkpoint=os.path.join(output_dir, f"checkpoint-{half}"))
    same = all(
        torch.equal(a, b) for a, b in zip(resumed.model.parameters(), trainer.model.parameters(), strict=True)
    )
    say(f"resumed from step {half} to {args.steps}: the same weights as the run that did not stop: {same}")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "eval_loss": evaluation["eval_loss"],
        "exact_save": float(exact),
        "same_after_resume": float(same),
    }


if __name__ == "__main__":
    main()
