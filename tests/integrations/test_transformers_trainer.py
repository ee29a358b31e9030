"""`amp_fx.integrations.transformers.AmpTrainer`: the real Hugging Face Trainer training a converted model.

A tiny Llama (hidden 32, 2 layers, vocab 128) learns sequences that count modulo 8 on the CPU, a few steps
per run. The fp16 run of `fp16_run` (module scope) serves several tests: the model and optimizer it
trains, its logs, its checkpoints (the resume test continues it from its first one).
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

import amp_fx  # noqa: E402
from amp_fx.capture.captured_model import CapturedModel  # noqa: E402
from amp_fx.integrations.transformers import AmpTrainer, AmpTrainerMixin, amp_trainer  # noqa: E402
from amp_fx.kernels.optimizer_step import skip_flag  # noqa: E402
from amp_fx.optim import FusedAdam, FusedSGD, master_params  # noqa: E402

VOCAB, SEQ, CYCLE = 128, 16, 8
LR = 2e-2
STEPS, SAVE_EVERY = 8, 4


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def sequences(count: int = 64, same: bool = False) -> list[dict[str, torch.Tensor]]:
    """Counting mod CYCLE from varied starts (all from 3 with ``same``): each token is the one before
    plus 1, learnable within a few steps."""
    data = []
    for i in range(count):
        ids = (torch.arange(SEQ) + (3 if same else i)) % CYCLE
        data.append({"input_ids": ids, "labels": ids.clone()})
    return data


def training_args(output_dir: Path, **overrides: Any) -> TrainingArguments:
    settings = dict(
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(output_dir=str(output_dir), **{**settings, **overrides})


def training_state(trainer: AmpTrainer) -> dict[str, Any]:
    optimizer = trainer.optimizer.optimizer
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "masters": [m.clone() for m in master_params(optimizer)],
        "optimizer": optimizer.state_dict(),
        "scaler": trainer.loss_scaler.state_dict() if trainer.loss_scaler is not None else None,
        "skipped": trainer.skipped_steps,
        "lr": trainer.lr_scheduler.get_last_lr(),
    }


def assert_equal_states(actual: Any, expected: Any, where: str = "state") -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_equal_states(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_equal_states(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def call_as_the_trainer(model: torch.nn.Module, batch: list[dict[str, torch.Tensor]]) -> Any:
    """``model`` on ``batch`` with the arguments the Trainer passes (so its graph serves both)."""
    labels = torch.stack([b["labels"] for b in batch])
    count = torch.tensor(float(labels[:, 1:].numel()))  # the labels a causal LM predicts
    return model(
        input_ids=torch.stack([b["input_ids"] for b in batch]), labels=labels, num_items_in_batch=count
    )


def train_losses(trainer: AmpTrainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# ------------------------------------------------------------------------------------------------
# One fp16 run, saved every SAVE_EVERY steps


class _ReadGuard(transformers.TrainerCallback):
    """Records each tensor value amp_fx's code reads on the host during the steps after the first
    (the first captures the model's graph)."""

    def __init__(self) -> None:
        self.active = False
        self.reads: list[str] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.active = state.global_step >= 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.active = False

    def wrap(self, name: str) -> Any:
        real = getattr(torch.Tensor, name)

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            caller = frame.f_globals.get("__name__", "")
            # The one read made on purpose: the CPU reference optimizer's skip flag, read only where
            # it lives in CPU memory (no device to sync with; on a GPU it stays on the device, which
            # tests/kernels/test_optimizer_step.py's gpu tests and the Triton path's guard check).
            if self.active and caller.startswith("amp_fx") and frame.f_code is not skip_flag.__code__:
                self.reads.append(f"Tensor.{name} in {caller}")
            return real(tensor, *args, **kwargs)

        return read


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    output_dir = tmp_path_factory.mktemp("fp16_run")
    original = tiny_llama()
    before = {k: v.clone() for k, v in original.state_dict().items()}
    # A scale that grows every 2 clean steps: its state changes across the saved steps.
    args = training_args(output_dir, fp16=True, save_strategy="steps", save_steps=SAVE_EVERY)
    guard = _ReadGuard()
    trainer = AmpTrainer(
        model=original,
        args=args,
        train_dataset=sequences(),
        callbacks=[guard],
        loss_scaler=amp_fx.LossScaler(growth_interval=2),
    )
    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
            patch.setattr(torch.Tensor, name, guard.wrap(name))
        trainer.train()
    return {
        "trainer": trainer,
        "original": original,
        "before": before,
        "dir": output_dir,
        "state": training_state(trainer),
        "reads": guard.reads,
    }


def test_loss_goes_down_on_a_learnable_set(fp16_run: dict[str, Any]) -> None:
    losses = train_losses(fp16_run["trainer"])
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert sum(losses[-2:]) / 2 < 0.7 * sum(losses[:2]) / 2, losses


def test_no_value_is_read_from_the_device_in_a_step(fp16_run: dict[str, Any]) -> None:
    """Nothing amp_fx runs in a step (scaling, unscaling, clipping, the step, the scaler's update,
    the skip count) reads a tensor's value on the host: only logging and saving do."""
    assert fp16_run["reads"] == []


def test_trains_a_converted_model_with_fp32_masters(fp16_run: dict[str, Any]) -> None:
    trainer = fp16_run["trainer"]
    model = trainer.model
    assert isinstance(model, CapturedModel) and isinstance(model, transformers.LlamaForCausalLM)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
    assert model.model.norm.weight.dtype == torch.float32  # O2 keeps norms FP32
    optimizer = trainer.optimizer.optimizer
    assert type(optimizer) is FusedAdam
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param, master in zip(params, master_params(optimizer), strict=True):
        assert master.dtype == torch.float32
        assert (master is param) == (param.dtype == torch.float32)
        assert torch.equal(master.to(param.dtype), param)  # the weight is its master, rounded
    assert trainer.accelerator.mixed_precision == "no"  # no autocast, no GradScaler of accelerate's


def test_the_model_passed_in_is_the_model_that_trained(fp16_run: dict[str, Any]) -> None:
    """As with transformers' Trainer: ``trainer.model is model``, converted in place, and trained."""
    original, trainer = fp16_run["original"], fp16_run["trainer"]
    assert trainer.model is original and isinstance(original, transformers.LlamaForCausalLM)
    masters = amp_fx.master_state_dict(original)
    moved = [k for k in fp16_run["before"] if not torch.equal(masters[k], fp16_run["before"][k])]
    assert len(moved) == len(fp16_run["before"])  # every weight trained, none left initial


def test_logs_loss_scale_and_skipped_steps(fp16_run: dict[str, Any]) -> None:
    """Each step's log follows the scaler's rule: a skipped step halves the scale, two clean steps in
    a row double it (growth_interval=2). (This run's scale grows into overflow: it skipped 2 of its 8
    steps on the machines it was written on; the overflow test below skips for certain.)"""
    logs = [entry for entry in fp16_run["trainer"].state.log_history if "loss" in entry]
    scale, clean, skipped = 2.0**16, 0, 0
    for entry in logs:
        if entry["skipped_steps"] > skipped:
            scale, clean, skipped = scale / 2, 0, entry["skipped_steps"]
            assert not math.isfinite(entry["grad_norm"])
        else:
            clean += 1
            if clean == 2:
                scale, clean = scale * 2, 0
        assert (entry["loss_scale"], entry["skipped_steps"]) == (scale, skipped)
    assert skipped < STEPS // 2 and fp16_run["trainer"].skipped_steps == skipped


def test_resume_from_checkpoint_continues_bit_for_bit(fp16_run: dict[str, Any], tmp_path: Path) -> None:
    checkpoint = fp16_run["dir"] / f"checkpoint-{SAVE_EVERY}"
    for name in ("optimizer.pt", "scheduler.pt", "scaler.pt"):
        torch.load(checkpoint / name, weights_only=True)  # no extra safe globals needed
    scaler_state = torch.load(checkpoint / "scaler.pt", weights_only=True)
    logged = fp16_run["trainer"].state.log_history[SAVE_EVERY - 1]
    assert (scaler_state["scale"], scaler_state["skipped_steps"]) == (
        logged["loss_scale"],
        logged["skipped_steps"],
    )
    args = training_args(tmp_path, fp16=True, save_steps=SAVE_EVERY)
    resumed = AmpTrainer(
        model=tiny_llama(seed=1),  # other weights: the checkpoint must bring them
        args=args,
        train_dataset=sequences(),
        loss_scaler=amp_fx.LossScaler(growth_interval=2),
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert_equal_states(training_state(resumed), fp16_run["state"])
    # The resumed history: the checkpoint's first SAVE_EVERY logs, then the same losses, bit for bit.
    assert train_losses(resumed) == train_losses(fp16_run["trainer"])


def test_resume_restores_a_nonzero_skipped_step_count(fp16_run: dict[str, Any], tmp_path: Path) -> None:
    """The run's overflows come after its checkpoint (whose count is then 0, which a resume that
    forgot the count would also give): here the checkpoint says 3 steps were skipped before it, and
    the resumed run counts on from there, its own skips added."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(fp16_run["dir"] / f"checkpoint-{SAVE_EVERY}", checkpoint)
    scaler_state = torch.load(checkpoint / "scaler.pt", weights_only=True)
    earlier = 3
    scaler_state["skipped_steps"] += earlier
    torch.save(scaler_state, checkpoint / "scaler.pt")
    resumed = AmpTrainer(
        model=tiny_llama(seed=1),
        args=training_args(tmp_path / "out", fp16=True, save_steps=SAVE_EVERY),
        train_dataset=sequences(),
        loss_scaler=amp_fx.LossScaler(growth_interval=2),
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def skipped_after_checkpoint(trainer: AmpTrainer) -> list[int]:
        return [entry["skipped_steps"] for entry in trainer.state.log_history if "loss" in entry][SAVE_EVERY:]

    original = skipped_after_checkpoint(fp16_run["trainer"])
    assert len(original) == STEPS - SAVE_EVERY
    assert skipped_after_checkpoint(resumed) == [count + earlier for count in original]
    assert resumed.skipped_steps == fp16_run["trainer"].skipped_steps + earlier


def test_checkpoints_and_save_model_hold_the_fp32_masters(fp16_run: dict[str, Any], tmp_path: Path) -> None:
    trainer = fp16_run["trainer"]
    masters = amp_fx.master_state_dict(trainer.model)
    final = load_file(fp16_run["dir"] / f"checkpoint-{STEPS}" / "model.safetensors")
    trainer.save_model(str(tmp_path))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)  # the original class, FP32
    for name, tensor in reloaded.state_dict().items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, masters[name]), name
        assert torch.equal(final[name], masters[name]), name


def test_evaluation_and_prediction_run_the_converted_model(fp16_run: dict[str, Any]) -> None:
    trainer = fp16_run["trainer"]
    batch = sequences(4)
    metrics = trainer.evaluate(eval_dataset=batch)
    prediction = trainer.predict(batch)
    with torch.no_grad():
        output = call_as_the_trainer(trainer.model.eval(), batch)
    assert metrics["eval_loss"] == pytest.approx(output.loss.item(), abs=0.0)
    assert torch.equal(torch.as_tensor(prediction.predictions), output.logits)
    assert output.logits.dtype == torch.float32  # O2's outputs, cast by the converted graph


# ------------------------------------------------------------------------------------------------
# Optimizers, masters and clipping


def test_masters_are_the_weights_before_conversion(tmp_path: Path) -> None:
    original = tiny_llama()
    originals = {n: p.detach().clone() for n, p in original.named_parameters()}
    trainer = AmpTrainer(
        model=original, args=training_args(tmp_path, bf16=True, weight_decay=0.1), train_dataset=sequences()
    )
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    rounded = 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param, master in zip(params, master_params(optimizer), strict=True):
        assert torch.equal(master, originals[names[id(param)]]), names[id(param)]  # exact, not rounded
        rounded += param.dtype == torch.bfloat16 and not torch.equal(param.float(), master)
    assert rounded > 0
    # Trainer's no-decay groups (get_decay_parameter_names): biases and norms without decay.
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in no_decay["params"]} == {n for n in originals if "norm" in n}
    assert decay["lr"] == LR and decay["betas"] == (0.9, 0.999) and decay["adam_w_mode"] is True


def test_a_torch_optimizer_passed_in_gets_masters_and_keeps_its_scheduler(tmp_path: Path) -> None:
    original = tiny_llama()
    originals = {n: p.detach().clone() for n, p in original.named_parameters()}
    groups = [
        {"params": [p for n, p in original.named_parameters() if "norm" not in n], "weight_decay": 0.05},
        {"params": [p for n, p in original.named_parameters() if "norm" in n], "lr": 3e-3},
    ]
    torch_optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch_optimizer, lambda step: 0.5**step)
    trainer = AmpTrainer(
        model=original,
        args=training_args(tmp_path, bf16=True),
        train_dataset=sequences(8),
        optimizers=(torch_optimizer, scheduler),
    )
    fused = trainer.create_optimizer()
    assert type(fused) is FusedSGD and trainer.lr_scheduler is scheduler and scheduler.optimizer is fused
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: the scheduler steps here before any optimizer step
        scheduler.step()
    assert [g["lr"] for g in fused.param_groups] == [0.1 * 0.5, 3e-3 * 0.5]  # the scheduler sets them
    assert fused.param_groups[0]["weight_decay"] == 0.05 and fused.param_groups[0]["nesterov"] is True
    converted = dict(trainer.model.named_parameters())
    assert {id(p) for g in fused.param_groups for p in g["params"]} == {id(p) for p in converted.values()}
    names = {id(p): n for n, p in converted.items()}
    params = [p for group in fused.param_groups for p in group["params"]]
    for param, master in zip(params, master_params(fused), strict=True):
        assert torch.equal(master, originals[names[id(param)]])  # FP32: the weights before conversion


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1),  # L2 penalty, not decoupled decay
        lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1, decoupled_weight_decay=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    ],
    ids=["AdamW", "Adam", "Adam-decoupled", "SGD-nesterov"],
)
def test_fused_equivalents_step_as_the_torch_optimizers(make: Any) -> None:
    from amp_fx.integrations._fused_optimizers import fused_equivalent

    torch.manual_seed(0)
    start, grads = torch.randn(3, 5), [torch.randn(3, 5) for _ in range(3)]
    reference, fused_param = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    torch_optimizer = make([reference])
    fused = fused_equivalent(make([fused_param]), master_weights=True)
    for grad in grads:
        reference.grad, fused_param.grad = grad.clone(), grad.clone()
        torch_optimizer.step()
        fused.step()
    torch.testing.assert_close(fused_param, reference, rtol=1e-5, atol=1e-6)


def test_clipping_and_the_logged_grad_norm_use_unscaled_gradients(tmp_path: Path) -> None:
    """fp16 grads carry the loss scale (2**16); SGD's update is lr x the clipped gradient, so the
    masters move by lr x max_grad_norm exactly when the clipping sees the true norm."""
    lr, max_norm = 0.1, 1e-3
    args = training_args(
        tmp_path,
        fp16=True,
        optim="sgd",
        learning_rate=lr,
        max_grad_norm=max_norm,
        max_steps=1,
        lr_scheduler_type="constant",
    )
    trainer = AmpTrainer(model=tiny_llama(), args=args, train_dataset=sequences(4, same=True))
    before = [m.clone() for m in master_params(trainer.create_optimizer())]
    # The true norm: the same batch, forward and backward without any scaling.
    batch = sequences(4, same=True)
    call_as_the_trainer(trainer.model, batch).loss.backward()
    true_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.float().norm() for p in trainer.model.parameters()])
    )
    trainer.model.zero_grad(set_to_none=True)
    trainer.train()
    logged = trainer.state.log_history[0]["grad_norm"]
    assert logged == pytest.approx(true_norm.item(), rel=1e-2) and true_norm > 100 * max_norm
    moved = torch.linalg.vector_norm(
        torch.stack(
            [(m - b).norm() for m, b in zip(master_params(trainer.optimizer.optimizer), before, strict=True)]
        )
    )
    assert moved.item() == pytest.approx(lr * max_norm, rel=1e-2)


def test_overflowing_steps_are_skipped_counted_and_logged(tmp_path: Path) -> None:
    """Scaled by 2**24 the fp16 gradients overflow: those steps change nothing, the scale backs off
    until they fit, the count is logged, and the scheduler steps every step, as with GradScaler."""
    steps = 10
    args = training_args(tmp_path, fp16=True, max_steps=steps, lr_scheduler_type="linear")
    trainer = AmpTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=sequences(),
        loss_scaler=amp_fx.LossScaler(init_scale=2.0**24),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    skipped = [entry["skipped_steps"] for entry in logs]
    assert skipped[0] == 1 and skipped == sorted(skipped) and 0 < skipped[-1] < steps, skipped
    assert logs[0]["loss_scale"] == 2.0**23 and not math.isfinite(logs[0]["grad_norm"])
    assert trainer.skipped_steps == skipped[-1]
    optimizer = trainer.optimizer.optimizer
    assert optimizer.param_groups[0]["step"].item() == steps - skipped[-1]  # skipped steps took no step
    expected_lr = [LR * (steps - s) / steps for s in range(steps)]
    assert [entry["learning_rate"] for entry in logs] == pytest.approx(expected_lr)


def test_gradient_accumulation_matches_one_larger_batch(tmp_path: Path) -> None:
    """2 accumulated steps of batch 2 = 1 step of batch 4 (num_items_in_batch normalises the loss)."""
    masters = []
    for batch, accumulate in ((4, 1), (2, 2)):
        args = training_args(
            tmp_path / str(batch),
            fp16=True,
            max_steps=2,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulate,
        )
        trainer = AmpTrainer(model=tiny_llama(), args=args, train_dataset=sequences(16))
        trainer.train()
        masters.append([m.clone() for m in master_params(trainer.optimizer.optimizer)])
    rtol, atol = amp_fx.testing.tolerances(torch.float16)
    for i, (accumulated, whole) in enumerate(zip(masters[1], masters[0], strict=True)):
        amp_fx.testing.assert_close_normwise(accumulated, whole, rtol=rtol, atol=atol, name=f"master {i}")


# ------------------------------------------------------------------------------------------------
# Subclasses and PEFT


class CountingTrainer(AmpTrainer):
    """A user's subclass with its own loss: cross-entropy on the logits, counted."""

    calls = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
        type(self).calls += 1
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        return (loss, outputs) if return_outputs else loss


def test_a_subclass_overriding_compute_loss_trains_converted(tmp_path: Path) -> None:
    trainer = CountingTrainer(
        model=tiny_llama(), args=training_args(tmp_path, bf16=True), train_dataset=sequences(), opt_level="O2"
    )
    trainer.train()
    assert CountingTrainer.calls == STEPS and isinstance(trainer.model, CapturedModel)
    assert trainer.model.lm_head.weight.dtype == torch.bfloat16
    losses = train_losses(trainer)
    assert losses[-1] < 0.8 * losses[0], losses


def test_peft_trains_masters_of_the_adapters_only_saves_them_and_resumes(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")

    def lora_llama() -> torch.nn.Module:
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(tiny_llama(), lora)

    args = training_args(tmp_path / "run", fp16=True, max_steps=4, save_strategy="steps", save_steps=2)
    trainer = AmpTrainer(model=lora_llama(), args=args, train_dataset=sequences())
    trainer.train()
    optimizer = trainer.optimizer.optimizer
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert trained and all("lora_" in n for n in trained) and len(held) == len(trained)
    for param, master in zip(held, master_params(optimizer), strict=True):
        assert param.dtype == torch.float16 and master.dtype == torch.float32  # stored low, FP32 masters
    trainer.save_model(str(tmp_path / "adapter"))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    masters = amp_fx.master_state_dict(trainer.model)
    assert saved and all("lora_" in k and v.dtype == torch.float32 for k, v in saved.items())
    for key, value in saved.items():  # PEFT drops the adapter name from the keys
        assert torch.equal(value, masters[key.replace(".weight", ".default.weight")]), key
    # PEFT loads the checkpoint's adapters (load_adapter, which makes them float32: stored low again).
    resumed = AmpTrainer(
        model=lora_llama(),
        args=training_args(tmp_path / "resumed", fp16=True, max_steps=4, save_steps=2),
        train_dataset=sequences(),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert_equal_states(training_state(resumed), training_state(trainer))


# ------------------------------------------------------------------------------------------------
# Bad input: refused before anything changes, each error naming the fix


def _refused(tmp_path: Path, **kwargs: Any) -> str:
    kwargs.setdefault("model", tiny_llama())
    before = {k: v.clone() for k, v in kwargs["model"].state_dict().items()}
    output_dir = tmp_path / "never_created"
    args = kwargs.pop("args", {})
    with pytest.raises((TypeError, ValueError)) as error:
        AmpTrainer(args=training_args(output_dir, **args), train_dataset=sequences(8), **kwargs)
    assert not output_dir.exists(), "the Trainer was built before the error"
    assert_equal_states(kwargs["model"].state_dict(), before)
    return str(error.value)


def test_contradicting_dtypes_are_refused(tmp_path: Path) -> None:
    assert "dtype=torch.float16" in _refused(tmp_path, args={"bf16": True}, dtype=torch.float16)
    message = _refused(tmp_path, args={"fp16": True}, policy=amp_fx.preset("O2", torch.bfloat16))
    assert "dtype=torch.float16" in message
    assert "leave opt_level out" in _refused(tmp_path, opt_level="O1", policy=amp_fx.preset("O2"))
    assert "without device_type" in _refused(tmp_path, policy=amp_fx.preset("O2", device_type="cuda"))


def test_optimizers_without_masters_are_refused(tmp_path: Path) -> None:
    assert "'adamw_torch_fused'" in _refused(tmp_path, args={"optim": "adafactor"})
    model = tiny_llama()
    assert "torch.optim.AdamW" in _refused(
        tmp_path, model=model, optimizers=(torch.optim.Adagrad(model.parameters()), None)
    )
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)
    assert "amsgrad=False" in _refused(tmp_path, model=model, optimizers=(amsgrad, None))
    foreign = torch.optim.AdamW(tiny_llama().parameters())
    assert "model.parameters()" in _refused(tmp_path, model=model, optimizers=(foreign, None))
    assert "FusedAdam" in _refused(tmp_path, optimizer_cls_and_kwargs=(torch.optim.RMSprop, {}))


def test_arguments_that_would_undo_the_conversion_are_refused(tmp_path: Path) -> None:
    assert "leave fp16_full_eval out" in _refused(tmp_path, args={"fp16_full_eval": True})
    assert "leave use_liger_kernel out" in _refused(tmp_path, args={"use_liger_kernel": True})
    spread = tiny_llama()
    spread.hf_device_map = {"model.embed_tokens": 0, "lm_head": 1}  # as from_pretrained(device_map=...)
    assert "without device_map" in _refused(tmp_path, model=spread)


def test_the_mixin_needs_a_trainer_and_comes_first() -> None:
    class Plain(AmpTrainerMixin):
        pass

    with pytest.raises(TypeError, match="put the mixin first"):
        Plain()
    assert amp_trainer(transformers.Trainer) is AmpTrainer
    assert amp_trainer(transformers.Seq2SeqTrainer).__mro__[1] is AmpTrainerMixin


# ------------------------------------------------------------------------------------------------
# The example


def test_the_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    """examples/train_hf_trainer.py, shortened (tests/test_examples.py runs the other examples)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "train_hf_trainer.py"
    spec = importlib.util.spec_from_file_location("amp_fx_example_train_hf_trainer", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    verbosity = transformers.logging.get_verbosity()
    try:  # 80 windows of 64 bytes: 72 to train on, 8 held out, whole batches of 4
        arguments = [
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--corpus-bytes",
            "5120",
            "--output-dir",
            str(tmp_path),
        ]
        results = example.main(arguments)
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
    assert results["exact_save"] and results["same_after_resume"]
    assert math.isfinite(results["eval_loss"]) and results["last_loss"] < results["first_loss"]
