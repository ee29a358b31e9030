"""Hugging Face Trainer with amp_fx: `AmpTrainer`, and `AmpTrainerMixin` / `amp_trainer` for its subclasses.

    trainer = AmpTrainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=data,
                         opt_level="O2")
    trainer.train()

`AmpTrainer` takes ``transformers.Trainer``'s arguments plus ``opt_level`` (default "O2"),
``dtype`` and ``policy``; ``fp16=True`` / ``bf16=True`` pick the dtype (a ``dtype=`` that
contradicts them is refused). What it changes in the Trainer, each through the hook named:

- the model: converted in place with `amp_fx.convert` when the Trainer's initialization ends
  (callback ``on_init_end``), so a subclass's own preparation is converted (``SFTTrainer``'s PEFT
  model) and its code after ``super().__init__`` sees the converted model (TRL's fused LM head).
  As with the plain Trainer, ``trainer.model`` is the model passed in, and it trains: after
  ``train()``, ``model.save_pretrained(out)`` writes the trained FP32 masters (a PEFT model: the
  model it wraps is converted, `amp_fx.integrations._hf_model`). It is converted where it is and
  then moved to the device (``_move_model_to_device``), so the FP32 values kept for the masters
  stay off the device until the optimizer is built.
- precision: accelerate's own mixed precision is off (``create_accelerator_and_postprocess``):
  no autocast, no GradScaler. For fp16 at O1/O2 an `amp_fx.LossScaler` takes the GradScaler's
  place (`amp_fx.integrations._hf_scaler`): the loss is scaled in ``accelerator.backward``, the
  step is skipped on inf/NaN inside the optimizer's kernel, the scaler is saved in each checkpoint.
- the optimizer (``create_optimizer``): the Trainer builds the one ``TrainingArguments.optim``
  names (``adamw_torch_fused``, ``adamw_torch`` or ``sgd``), with its no-decay groups and
  hyperparameters, or takes the one passed in ``optimizers=``; AmpTrainer replaces it by its fused
  equivalent, `amp_fx.optim.FusedAdam` / `FusedSGD`, whose FP32 masters are the weights as they
  were before conversion (`amp_fx.integrations._fused_optimizers`). LR schedulers follow it.
- clipping (``_clip_grad_norm``, ``_get_grad_norm``): `amp_fx.clip_grad_norm_` on the unscaled
  gradients, folded into the kernel; the logged ``grad_norm`` is the true norm.
- logging (``log``): ``loss_scale`` and ``skipped_steps`` beside the loss. No value is read from
  the device between logging steps; schedulers step every step, skipped or not, as in torch's
  GradScaler recipe.
- saving (``_save``): ``save_model`` writes the FP32 masters (`amp_fx.master_state_dict`); for
  a PEFT model, its adapters, as PEFT saves them. Checkpoints hold the masters and moments (the
  optimizer's state dict) and the scaler, so ``resume_from_checkpoint`` continues bit for bit; each
  loads with ``torch.load(weights_only=True)``. Loading (``_load_from_checkpoint``,
  ``_load_best_model``) keeps the dtypes conversion chose (PEFT's ``load_adapter`` makes adapters
  float32).

For a subclass (your own, or TRL's ``SFTTrainer``), put the mixin first::

    class AmpSFTTrainer(AmpTrainerMixin, SFTTrainer): ...
    AmpSFTTrainer = amp_trainer(SFTTrainer)               # the same, built for you

Refused before the Trainer is built, each error naming the fix: a ``dtype`` or ``policy`` that
contradicts ``fp16``/``bf16``; an ``optim`` or optimizer amp_fx cannot give masters to;
``fp16_full_eval``/``bf16_full_eval``, Liger kernels, DeepSpeed, the Trainer's FSDP and
``nn.DataParallel`` (several GPUs without torchrun).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

import amp_fx
from amp_fx.integrations._fused_optimizers import (
    SUPPORTED_CLASSES,
    fused_equivalent,
    retarget_schedulers,
    set_masters,
)
from amp_fx.integrations._hf_arguments import resolve
from amp_fx.integrations._hf_model import check_model, convert_for_trainer, restore_dtypes, storage_dtypes
from amp_fx.integrations._hf_optim import check_optim_name, check_optimizer, check_optimizer_class
from amp_fx.integrations._hf_scaler import AcceleratorScaler
from amp_fx.optim.scaled_optimizer import ScaledOptimizer
from amp_fx.optim.wrappers import unwrap_optimizer

logger = logging.getLogger(__name__)

__all__ = ["AmpTrainer", "AmpTrainerMixin", "amp_trainer"]

# The Trainer methods AmpTrainer overrides that are not documented hooks (transformers 5.x has them).
_PRIVATE_HOOKS = (
    "_clip_grad_norm",
    "_get_grad_norm",
    "_save",
    "_move_model_to_device",
    "_load_from_checkpoint",
    "_load_best_model",
)


class _ConvertAtInitEnd(TrainerCallback):
    """Converts the trainer's model when the Trainer's ``__init__`` ends (see the module docstring)."""

    def __init__(self, trainer: AmpTrainerMixin) -> None:
        self._trainer = weakref.ref(trainer)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is not None:
            trainer._amp_convert_trainer_model()


class AmpTrainerMixin:
    """amp_fx mixed precision for a ``transformers.Trainer`` subclass; goes first among the bases.

    Adds three keywords to the Trainer's arguments (the module docstring says what it changes):

    Args:
        opt_level: "O0" to "O3" (default "O2"); may be left out when ``policy`` is given.
        dtype: torch.float16 or torch.bfloat16, or a name of one ("fp16", "bf16", "half", ...: as
            `amp_fx.convert`); default: from ``fp16=True`` / ``bf16=True``, else torch.float16. A
            dtype contradicting those flags is refused.
        policy: an `amp_fx.Policy` to convert with (it then decides opt level and dtype).
        loss_scaler: the `amp_fx.LossScaler` to scale with (its settings: init_scale, hysteresis,
            ...); default a dynamic one for fp16 at O1/O2, none otherwise.
    """

    def __init__(
        self,
        *args: Any,
        opt_level: str | None = None,
        dtype: torch.dtype | str | None = None,
        policy: amp_fx.Policy | None = None,
        loss_scaler: amp_fx.LossScaler | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(self, Trainer):
            raise TypeError(
                f"{type(self).__name__} uses AmpTrainerMixin without transformers.Trainer; put the mixin "
                "first in the bases of a Trainer subclass: class MyTrainer(AmpTrainerMixin, Trainer)"
            )
        mro = type(self).__mro__
        if mro.index(AmpTrainerMixin) > mro.index(Trainer):
            raise TypeError(f"{type(self).__name__}: AmpTrainerMixin must come before Trainer in the bases")
        missing = [name for name in _PRIVATE_HOOKS if not callable(getattr(Trainer, name, None))]
        if missing:
            raise TypeError(
                f"transformers {transformers.__version__}'s Trainer lacks {missing}, which AmpTrainer "
                "overrides to clip and save; install transformers 5.17 or newer"
            )
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        arguments = bound.arguments
        setup = resolve(arguments.get("args"), opt_level, dtype, policy)
        check_model(arguments.get("model"))
        self._amp_check_optimizers(arguments)
        if loss_scaler is not None and not isinstance(loss_scaler, amp_fx.LossScaler):
            raise TypeError(f"loss_scaler must be an amp_fx.LossScaler, got {type(loss_scaler).__name__}")
        if loss_scaler is None and setup.scaled:
            loss_scaler = amp_fx.LossScaler()
        if "callbacks" not in inspect.signature(super().__init__).parameters:
            raise TypeError(f"{type(self).__name__}.__init__ takes no callbacks=, which AmpTrainer needs")
        self._amp_setup = setup
        self._amp_scaler = (
            AcceleratorScaler(loss_scaler) if loss_scaler is not None and loss_scaler.is_enabled() else None
        )
        self._amp_model: nn.Module | None = None
        # id(parameter) -> its FP32 value before conversion, until the optimizer's masters take it.
        self._amp_originals: dict[int, Tensor] | None = None
        self._amp_storage: dict[str, torch.dtype] = {}
        arguments["callbacks"] = [_ConvertAtInitEnd(self), *(arguments.get("callbacks") or [])]
        super().__init__(*bound.args, **bound.kwargs)
        if self._amp_model is None:  # a subclass whose __init__ never reached Trainer's on_init_end
            self._amp_convert_trainer_model()

    # ------------------------------------------------------------------------------------------
    # Checks and conversion

    def _amp_check_optimizers(self, arguments: dict[str, Any]) -> None:
        optimizer, _ = arguments.get("optimizers") or (None, None)
        cls_and_kwargs = arguments.get("optimizer_cls_and_kwargs")
        model = arguments.get("model")
        if optimizer is not None:
            params = {id(p) for p in model.parameters()} if isinstance(model, nn.Module) else set()
            check_optimizer(optimizer, params)
        elif cls_and_kwargs is not None:
            check_optimizer_class(*cls_and_kwargs)
        elif "create_optimizer" not in _overrides(type(self)):
            args = arguments.get("args")
            check_optim_name(args.optim if args is not None else "adamw_torch_fused")

    def _amp_convert(self, model: nn.Module) -> nn.Module:
        self._amp_originals = convert_for_trainer(model, self._amp_setup, self.args.device.type)
        self._amp_model = model
        self._amp_storage = storage_dtypes(model)
        logger.info(
            "%s converted at %s (%s) for %s",
            type(model).__name__,
            self._amp_setup.opt_level,
            self._amp_setup.dtype,
            self.args.device,
        )
        return model

    def _amp_convert_trainer_model(self) -> None:
        model = getattr(self, "model", None)
        if model is None or model is self._amp_model:
            return  # model_init: converted in call_model_init
        converted = self._amp_convert(model)
        if self.place_model_on_device:
            super()._move_model_to_device(converted, self.args.device)
        self.model = self.model_wrapped = converted
        self.callback_handler.model = converted

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # The Trainer's __init__ moves the model it was given; AmpTrainer moves it once converted
        # (above): its FP32 values kept for the masters stay where they were.
        if self._amp_model is not None:
            super()._move_model_to_device(model, device)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """The model ``model_init`` builds, converted (each hyperparameter-search trial too)."""
        return self._amp_convert(super().call_model_init(trial))

    # ------------------------------------------------------------------------------------------
    # Precision: accelerate's off, amp_fx's scaler in its place

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator without accelerate's mixed precision (the model is converted),
        with amp_fx's loss scaler where accelerate keeps its GradScaler."""
        args = self.args
        saved = args.mixed_precision
        args.mixed_precision = "no"
        try:
            super().create_accelerator_and_postprocess()
        finally:
            args.mixed_precision = saved
        if self.accelerator.mixed_precision != "no":
            raise RuntimeError(
                f"accelerate runs with mixed_precision={self.accelerator.mixed_precision!r} (set by "
                "accelerate config or launch?); amp_fx converts the model itself: launch without "
                "--mixed_precision"
            )
        self.accelerator.scaler = self._amp_scaler

    @property
    def loss_scaler(self) -> amp_fx.LossScaler | None:
        """The `amp_fx.LossScaler` scaling the loss (None without loss scaling: bf16, O0, O3)."""
        return None if self._amp_scaler is None else self._amp_scaler.loss_scaler

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped on inf/NaN gradients since training began (reads the device)."""
        return 0 if self._amp_scaler is None else self._amp_scaler.skipped_steps

    # ------------------------------------------------------------------------------------------
    # The optimizer

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (from ``args.optim``, ``optimizer_cls_and_kwargs`` or ``optimizers=``)
        replaced by its fused equivalent, masters set from the FP32 weights before conversion."""
        super().create_optimizer(model)
        current = unwrap_optimizer(self.optimizer)
        fused = fused_equivalent(current, self._amp_setup.master_weights)
        if fused is not current:
            if self.lr_scheduler is not None:
                retarget_schedulers([self.lr_scheduler], {id(current): fused})
            self.optimizer = fused
        if self._amp_originals is not None:
            set_masters(fused, self._amp_originals)
            self._amp_originals = None  # the FP32 values before conversion are not needed any more
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """The Trainer's scheduler, once the optimizer is known to be amp_fx's fused one."""
        current = unwrap_optimizer(optimizer if optimizer is not None else self.optimizer)
        if current is not None and not isinstance(current, ScaledOptimizer):
            raise TypeError(
                f"{type(self).__name__} trains with {type(current).__name__}, which keeps no FP32 masters "
                "and reads scaled gradients: an override of create_optimizer must call "
                "super().create_optimizer() (AmpTrainer converts what it builds) or build one of "
                f"{SUPPORTED_CLASSES}"
            )
        return super().create_scheduler(num_training_steps, optimizer)

    # ------------------------------------------------------------------------------------------
    # Clipping and the true gradient norm

    def _clip_grad_norm(self, model: nn.Module) -> Tensor:
        return self._amp_unscale_and_clip(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Tensor | float | None = None) -> Any:
        return self._amp_unscale_and_clip(None) if grad_norm is None else grad_norm

    def _amp_unscale_and_clip(self, max_norm: float | None) -> Tensor:
        """Hand the scale to the optimizer's kernel (the step counts an overflow) and clip the unscaled
        gradients to ``max_norm`` (None: measure only); returns their norm, on the device."""
        optimizer = unwrap_optimizer(self.optimizer)
        if self._amp_scaler is not None:
            self._amp_scaler.defer_unscale_(optimizer)
        return amp_fx.clip_grad_norm_(optimizer, max_norm if max_norm else float("inf"))

    # ------------------------------------------------------------------------------------------
    # Loading, logging and saving

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        # PEFT's load_adapter stores the adapters it loads in float32; back in the dtypes conversion chose.
        restore_dtypes(self.model, self._amp_storage)

    def _load_best_model(self) -> None:
        super()._load_best_model()
        restore_dtypes(self.model, self._amp_storage)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs, with ``loss_scale`` and ``skipped_steps`` beside a training loss."""
        if self._amp_scaler is not None and "loss" in logs:
            logs["loss_scale"] = self._amp_scaler.get_scale()
            logs["skipped_steps"] = self._amp_scaler.skipped_steps
        super().log(logs, *args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Tensor] | None = None) -> None:
        # The FP32 masters, not their rounded copies (a PEFT model keeps its adapters' share of them).
        if state_dict is None:
            state_dict = amp_fx.master_state_dict(self.model)
        super()._save(output_dir, state_dict=state_dict)


def _overrides(cls: type) -> set[str]:
    """Names defined by the classes of ``cls``'s MRO before `AmpTrainerMixin` (the user's overrides)."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base is AmpTrainerMixin:
            break
        names.update(vars(base))
    return names


class AmpTrainer(AmpTrainerMixin, Trainer):
    """``transformers.Trainer`` training an amp_fx-converted model; a drop-in (module docstring).

    Example:
        >>> import torch, transformers
        >>> from transformers import TrainingArguments
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        ...                                  bos_token_id=0, eos_token_id=0)
        >>> data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64}] * 8
        >>> args = TrainingArguments("out", bf16=True, max_steps=2, use_cpu=True, report_to=[],
        ...                          save_strategy="no", disable_tqdm=True)
        >>> trainer = AmpTrainer(model=transformers.GPT2LMHeadModel(config), args=args,
        ...                      train_dataset=data, opt_level="O2")  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """


def amp_trainer(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass, e.g. TRL's ``SFTTrainer``) with
    `AmpTrainerMixin` first: the same class with ``opt_level``, ``dtype`` and ``policy``.

    Example:
        >>> from transformers import Trainer
        >>> amp_trainer(Trainer).__name__
        'AmpTrainer'
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"amp_trainer takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, AmpTrainerMixin):
        return trainer_class
    if trainer_class is Trainer:
        return AmpTrainer
    return type(f"Amp{trainer_class.__name__}", (AmpTrainerMixin, trainer_class), {"__module__": __name__})
