"""Lightning with amp_fx: `AmpPrecision`, a precision plugin for ``lightning.pytorch.Trainer`` and ``Fabric``.

    trainer = lightning.pytorch.Trainer(plugins=[AmpPrecision("O2", dtype=torch.bfloat16)])
    trainer.fit(lightning_module, train_dataloaders=loader)

What it does, in the order Lightning calls it:

- ``convert_module``: each child of the LightningModule that holds parameters is replaced by
  ``amp_fx.convert(child, ...)`` (`amp_fx.integrations._lightning_convert`); the LightningModule
  object stays the user's. Its state dict becomes FP32 (the masters), so checkpoints hold the
  training state and load into the FP32 model.
- ``connect`` (Trainer): the optimizers ``configure_optimizers`` returned are replaced by their
  fused equivalents, with FP32 masters made from the weights before conversion where the opt
  level keeps masters (O2, as ``amp.initialize``; `amp_fx.integrations._fused_optimizers`),
  and the LR schedulers pointed at them. An optimizer with no fused equivalent is refused and
  the children are put back.
- backward: the loss is scaled by an `amp_fx.LossScaler` (fp16 at O1/O2; bf16, O0 and O3 need
  no scaling), for ``training_step``'s loss and for ``manual_backward`` alike.
- ``optimizer_step``: the scaler's ``defer_unscale_`` hands ``1 / scale`` to the optimizer's kernel
  (the fast path: the grads stay scaled); where user code sees the grads before the step (the
  module or a callback overrides ``on_before_optimizer_step``, or the module
  ``configure_gradient_clipping``) its ``unscale_`` instead writes the true grads (FP32), as
  ``"16-mixed"`` does, and what the hooks do to them is what the step applies. Then
  Lightning's hooks and clipping run, then the step, which the kernel skips on inf/NaN; the
  skip is counted on the device. The scale is updated once per iteration, before the next loss
  is scaled, so optimizers stepped on one backward share a scale. Schedulers step as Lightning
  steps them, every step, skipped or not, as under ``precision="16-mixed"``.
- ``clip_gradients`` (``gradient_clip_val``, ``self.clip_gradients``): `amp_fx.clip_grad_norm_`,
  the norm of the unscaled grads, folded into the kernel's multiplier.
- logged each step (``self.log``, on_step): ``amp_fx/loss_scale`` and ``amp_fx/skipped_steps``
  when scaling, ``amp_fx/grad_norm`` (unscaled, before clipping) when clipping by norm. They are
  device tensors: no host read per step.
- ``state_dict``: the loss scaler and the skip count, in Lightning's checkpoint beside the fused
  optimizers' state (masters, moments) and the schedulers', so ``ckpt_path`` resumes bit for bit.

Under Fabric the same class converts the module and scales, unscales and steps; Fabric gives a
precision plugin no way to replace an optimizer, so build amp_fx's fused optimizer after the
module is set up: ``model = fabric.setup_module(model)``, then
``optimizer = fabric.setup_optimizers(amp_fx.optim.FusedAdam(model.parameters(), lr=...))``.
Clip with ``plugin.clip_gradients(optimizer, max_norm)`` (the fast path), or with
``fabric.clip_gradients`` (unscales the grads first, then torch's clip); log ``plugin.skipped_steps``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

import amp_fx
from amp_fx.core.dtypes import low_precision_dtype
from amp_fx.core.opt_levels import lookup_opt_level
from amp_fx.integrations._fused_optimizers import fused_equivalent, retarget_schedulers, set_masters
from amp_fx.integrations._lightning_convert import ConvertedChildren
from amp_fx.integrations._lightning_optimizers import SUPPORTED, check_optimizer
from amp_fx.optim.model_load_hooks import masters_of
from amp_fx.optim.scaled_optimizer import ScaledOptimizer
from amp_fx.optim.wrappers import unwrap_optimizer

logger = logging.getLogger(__name__)

__all__ = ["AmpPrecision"]


def _trainer_of(module: Any) -> Any:
    """The pytorch Trainer running ``module`` (None under Fabric or for a plain module)."""
    return getattr(module, "_trainer", None)


def _overrides(obj: Any, base: type, name: str) -> bool:
    """Whether ``obj``'s ``name`` (its class's, or set on it as LambdaCallback does) is not ``base``'s."""
    method = getattr(obj, name, None)
    return getattr(method, "__func__", method) is not getattr(base, name)


def _reads_grads_in_hooks(module: Any) -> bool:
    """Whether user code sees the grads between backward and the step: ``module`` or a callback
    overrides ``on_before_optimizer_step``, or ``module`` overrides ``configure_gradient_clipping``."""
    hook = "on_before_optimizer_step"
    if _overrides(module, LightningModule, hook) or _overrides(
        module, LightningModule, "configure_gradient_clipping"
    ):
        return True
    trainer = _trainer_of(module)
    return trainer is not None and any(_overrides(cb, Callback, hook) for cb in trainer.callbacks)


class AmpPrecision(Precision):
    """amp_fx's mixed precision as a Lightning precision plugin (module docstring: what it does).

    Args:
        opt_level: "O0" to "O3", as `amp_fx.convert` (may be left out when ``policy`` is given).
        dtype: torch.float16 (default) or torch.bfloat16, or a name of one ("fp16", "bf16",
            "half", ...: as `amp_fx.convert`).
        policy: an `amp_fx.Policy` (it then decides opt level and dtype; arguments that
            contradict it are refused).
        device_type: "cuda" or "cpu" for the policy's op lists; default: the Trainer's device,
            or under Fabric the module's when it is set up (pass ``device_type="cuda"`` there when
            the module is still on the CPU).
        loss_scaler: an `amp_fx.LossScaler` to use; default: a dynamic one for fp16 at O1/O2,
            none otherwise.

    Example:
        >>> import torch
        >>> from amp_fx.integrations.lightning import AmpPrecision
        >>> plugin = AmpPrecision("O2", dtype=torch.float16)
        >>> plugin.precision, plugin.loss_scaler.is_enabled()
        ('16-mixed', True)
        >>> AmpPrecision("O2", dtype=torch.bfloat16).loss_scaler.is_enabled()
        False
    """

    def __init__(
        self,
        opt_level: str | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        policy: amp_fx.Policy | None = None,
        device_type: str | None = None,
        loss_scaler: amp_fx.LossScaler | None = None,
    ) -> None:
        level, low_dtype = self._check_arguments(opt_level, dtype, policy, device_type, loss_scaler)
        self.opt_level = level
        self.dtype = low_dtype
        self.policy = policy
        self.device_type = device_type
        self.precision = "bf16-mixed" if low_dtype == torch.bfloat16 else "16-mixed"
        if loss_scaler is None:
            # bf16 has float32's range: only fp16 is scaled, at the levels whose loss scale is dynamic.
            scaled = low_dtype == torch.float16 and lookup_opt_level(level).dynamic_loss_scale
            loss_scaler = amp_fx.LossScaler(enabled=scaled)
        self.loss_scaler = loss_scaler
        # Device count of steps the kernel skipped (inf/NaN grads); None until the first scaled step.
        self.skipped_steps: Tensor | None = None
        self._forget_the_run()

    def _forget_the_run(self) -> None:
        """Reset what refers to one process's model and optimizers (not pickled: ddp_spawn copies
        the plugin into new processes before any of it exists)."""
        self._converted: ConvertedChildren | None = None
        # The parameters conversion replaced (an optimizer over them trains nothing the model holds),
        # and the optimizers checked against them.
        self._replaced_params = WeakIdKeyDictionary()
        self._checked_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        # Optimizers unscaled this step (ids): True where the grads hold the true values (unscale_),
        # False where 1 / scale waits in the kernel (defer_unscale_).
        self._unscaled: dict[int, bool] = {}
        # Optimizers stepped since the last scale update (ids).
        self._stepped: set[int] = set()
        self._grad_norm: Tensor | None = None
        self._fitting = False

    def __getstate__(self) -> dict[str, Any]:
        transient = (
            "_converted",
            "_replaced_params",
            "_checked_optimizers",
            "_unscaled",
            "_stepped",
            "_grad_norm",
            "_fitting",
        )
        return {k: v for k, v in self.__dict__.items() if k not in transient}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._forget_the_run()

    @staticmethod
    def _check_arguments(
        opt_level: Any, dtype: Any, policy: Any, device_type: Any, loss_scaler: Any
    ) -> tuple[str, torch.dtype]:
        if dtype is not None:
            dtype = low_precision_dtype(dtype)
        if policy is not None:
            if not isinstance(policy, amp_fx.Policy):
                raise TypeError(
                    "policy must be an amp_fx.Policy (amp_fx.preset('O2', dtype=...)), got "
                    f"{type(policy).__name__}"
                )
            conflicts = []
            if opt_level is not None and opt_level != policy.opt_level:
                conflicts.append(f"opt_level={opt_level!r} but the policy is {policy.opt_level}")
            if dtype is not None and dtype != policy.dtype:
                conflicts.append(f"dtype={dtype} but the policy's is {policy.dtype}")
            if conflicts:
                raise ValueError(
                    f"AmpPrecision got a policy and arguments that contradict it ({'; '.join(conflicts)}); "
                    "the policy decides: pass only policy=, or build it with "
                    "amp_fx.preset(opt_level, dtype=...)"
                )
            opt_level, dtype = policy.opt_level, policy.dtype
        if opt_level is None:
            raise TypeError(
                "AmpPrecision needs an opt_level ('O0' to 'O3') or a policy: AmpPrecision('O2', dtype=...)"
            )
        dtype = torch.float16 if dtype is None else dtype
        amp_fx.preset(opt_level, dtype=dtype)  # checks the level, with the library's messages
        if device_type not in (None, "cpu", "cuda"):
            raise ValueError(
                f"device_type must be 'cuda', 'cpu' or None (the Trainer's), got {device_type!r}"
            )
        if loss_scaler is not None and not isinstance(loss_scaler, amp_fx.LossScaler):
            raise TypeError(f"loss_scaler must be an amp_fx.LossScaler, got {type(loss_scaler).__name__}")
        return opt_level, dtype

    def __repr__(self) -> str:
        return f"AmpPrecision(opt_level={self.opt_level!r}, dtype={self.dtype})"

    # ------------------------------------------------------------------------------------------
    # The model and the optimizers
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s children in place (the module object stays); returns ``module``."""
        trainer = _trainer_of(module)
        clips_by_value = (
            trainer is not None and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE
        )
        if clips_by_value and trainer.gradient_clip_val:
            raise ValueError(
                "AmpPrecision clips by norm only (the grads stay scaled until the optimizer's kernel): use "
                "Trainer(gradient_clip_algorithm='norm'), or no gradient_clip_algorithm"
            )
        device_type = self.device_type
        if device_type is None and trainer is not None:
            device_type = trainer.strategy.root_device.type
        elif device_type is None and torch.cuda.is_available():
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            if on_cpu:  # Fabric converts before it moves the module: its device is not known here
                logger.warning(
                    "AmpPrecision converts %s with the CPU's policy (it is on the CPU); if Fabric runs it "
                    "on a GPU, pass AmpPrecision(..., device_type='cuda')",
                    type(module).__name__,
                )
        if self.policy is not None:
            kwargs: dict[str, Any] = {"policy": self.policy, "device_type": device_type}
        else:
            kwargs = {"opt_level": self.opt_level, "dtype": self.dtype, "device_type": device_type}
        converted = ConvertedChildren.convert(module, kwargs)
        converted.install()
        logger.info(
            "AmpPrecision converted %s of %s at %s (%s)",
            [name for name, _, _ in converted.children],
            type(module).__name__,
            self.opt_level,
            self.dtype,
        )
        # The Trainer builds the optimizers next (connect); Fabric's are the user's to build.
        self._converted = converted if trainer is not None else None
        for param in converted.original_params():
            self._replaced_params[param] = True
        return module

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Replace the optimizers by their fused equivalents with FP32 masters, the schedulers following."""
        converted, self._converted = self._converted, None
        stale = converted.original_params() if converted is not None else []
        try:
            for index, optimizer in enumerate(optimizers):
                check_optimizer(optimizer, index, stale)
        except (TypeError, ValueError):
            if converted is not None:
                converted.restore()
            raise
        # Masters from the FP32 weights before conversion, or, for children converted by an earlier
        # fit, from the masters an earlier optimizer keeps (a second fit continues from those).
        originals = {key: found[0] for key, found in masters_of(model).items()}
        originals.update(converted.originals_by_param() if converted is not None else {})
        masters = lookup_opt_level(self.opt_level).keeps_fp32_masters  # as amp.initialize: not at O3
        fused = [fused_equivalent(optimizer, masters) for optimizer in optimizers]
        for optimizer in fused:
            set_masters(optimizer, originals)
        retarget_schedulers(
            [config.scheduler for config in lr_schedulers],
            {id(old): new for old, new in zip(optimizers, fused, strict=True)},
        )
        self._fitting = bool(fused)
        return model, fused, lr_schedulers

    # ------------------------------------------------------------------------------------------
    # Backward
    def _scale(self, loss: Tensor) -> Tensor:
        self._finish_iteration()
        return self.loss_scaler.scale(loss)

    def _finish_iteration(self) -> None:
        """Update the scale from the steps since the last update.

        One update per iteration, after every optimizer has stepped (GradScaler's protocol): it
        runs before the next loss is scaled, so that two optimizers stepped on one backward (manual
        optimization) both unscale by the scale their gradients carry.
        """
        if self._stepped:
            self.loss_scaler.update()
            self._stepped.clear()

    def pre_backward(self, tensor: Tensor, module: Any) -> Any:
        if _trainer_of(module) is None:
            return None  # Fabric: its strategy ignores this; `backward` scales
        return super().pre_backward(self._scale(tensor), module)

    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if _trainer_of(model) is not None:
            super().backward(tensor, model, *args, **kwargs)  # scaled by pre_backward
        else:
            self._scale(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: Any) -> Any:
        if _trainer_of(module) is None:
            return None
        return super().post_backward(tensor, module)

    # ------------------------------------------------------------------------------------------
    # The step
    def _fused(self, optimizer: Any) -> Any:
        """The amp_fx optimizer behind Lightning's wrappers, checked once: refused unless it is one."""
        optimizer = unwrap_optimizer(optimizer)
        if optimizer in self._checked_optimizers:
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer) and any(
            p in self._replaced_params for group in optimizer.param_groups for p in group["params"]
        ):
            raise ValueError(
                f"the {type(optimizer).__name__} holds the model's parameters from before AmpPrecision "
                "converted it; build it after: model = fabric.setup_module(model); optimizer = "
                "fabric.setup_optimizers(amp_fx.optim.FusedAdam(model.parameters(), lr=...))"
            )
        if not isinstance(optimizer, ScaledOptimizer):
            raise TypeError(
                f"AmpPrecision steps amp_fx's fused optimizers, got {type(optimizer).__name__}. Under the "
                f"Trainer, return {SUPPORTED} from configure_optimizers; under Fabric, build one after "
                "setting the module up: model = fabric.setup_module(model); optimizer = "
                "fabric.setup_optimizers(amp_fx.optim.FusedAdam(model.parameters(), lr=...))"
            )
        self._checked_optimizers.add(optimizer)
        return optimizer

    def _unscale_once(self, optimizer: Any, true_grads: bool = False) -> None:
        """Unscale once per step and count the step if it will be skipped: ``1 / scale`` handed to the
        optimizer's kernel (``defer_unscale_``), or with ``true_grads`` written into the grads
        (``unscale_``, also after a deferral: the multiplier, any clip folded in, is applied)."""
        if not self.loss_scaler.is_enabled():
            return
        done = self._unscaled.get(id(optimizer))
        if done is not None and (done or not true_grads):
            return
        if done is None:
            if id(optimizer) in self._stepped:
                self._finish_iteration()  # a second step of one optimizer with no backward between
            if not optimizer.grads_by_device():
                return  # no backward ran (a training_step that returned None): nothing to unscale or step
        if true_grads:
            self.loss_scaler.unscale_(optimizer)
        else:
            self.loss_scaler.defer_unscale_(optimizer)
        self._unscaled[id(optimizer)] = true_grads
        if done is None:
            self._count_overflow(optimizer)

    def _count_overflow(self, optimizer: Any) -> None:
        flags = [optimizer.pending_scaling(device)[1] for device in optimizer.grads_by_device()]
        flags = [flag for flag in flags if flag is not None]
        if flags:
            device = flags[0].device
            overflow = (torch.stack([flag.reshape(()).to(device) for flag in flags]).amax() > 0).long()
            previous = self.skipped_steps
            self.skipped_steps = overflow if previous is None else previous.to(device) + overflow

    def optimizer_step(
        self,
        optimizer: Any,
        model: Any = None,
        closure: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (Trainer), unscale, clip, step (skipped on the device on inf/NaN), update."""
        optimizer = self._fused(optimizer)
        if model is None:  # Fabric: the user ran forward and backward, or hands a closure that does
            loss = closure() if closure is not None else None
            result = self._step(optimizer, kwargs)
            return loss if closure is not None else result
        closure_result = closure()
        # A training_step that returned None ran no backward: nothing to step (as under "16-mixed").
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            # User code in the hooks reads the true grads, as under "16-mixed"; else the fast path.
            self._unscale_once(optimizer, true_grads=_reads_grads_in_hooks(model))
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        result = self._step(optimizer, kwargs)
        self._log(model)
        return result

    def _step(self, optimizer: Any, kwargs: dict[str, Any]) -> Any:
        self._unscale_once(optimizer)
        self._unscaled.pop(id(optimizer), None)
        result = self.loss_scaler.step(optimizer, **kwargs)
        if self.loss_scaler.is_enabled():
            self._stepped.add(id(optimizer))  # the scale is updated before the next loss is scaled
        return result

    def _log(self, model: Any) -> None:
        values = {}
        if self.loss_scaler.is_enabled():
            # A copy: the scaler updates its scale in place before the next loss.
            values["amp_fx/loss_scale"] = self.loss_scaler.scale_tensor().clone()
            if self.skipped_steps is not None:
                values["amp_fx/skipped_steps"] = self.skipped_steps.float()
        if self._grad_norm is not None:
            values["amp_fx/grad_norm"] = self._grad_norm
            self._grad_norm = None
        for name, value in values.items():
            model.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> Tensor | None:
        """Clip the unscaled grads' total norm to ``clip_val`` (`amp_fx.clip_grad_norm_`, no host read).

        Returns the norm before clipping (a device tensor); Fabric's users call this themselves.
        Clipping by value needs the true grads: it runs where they are (bf16, or after ``unscale_``,
        as when the module overrides ``configure_gradient_clipping``).
        """
        if clip_val is None or clip_val <= 0:
            return None
        optimizer = self._fused(optimizer)
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            if self.loss_scaler.is_enabled() and not self._unscaled.get(id(optimizer), False):
                raise ValueError(
                    "AmpPrecision clips by norm only while the grads stay scaled until the optimizer's "
                    "kernel: use gradient_clip_algorithm='norm', or clip by value where the grads are "
                    "unscaled first: in your module's configure_gradient_clipping, or with "
                    "fabric.clip_gradients"
                )
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_value_(params, clip_val)
            return None
        if not optimizer.grads_by_device():
            return None
        self._unscale_once(optimizer)
        self._grad_norm = amp_fx.clip_grad_norm_(optimizer, clip_val)
        return self._grad_norm

    def unscale_gradients(self, optimizer: Any) -> None:
        """Fabric's ``clip_gradients``: the grads become the true ones (``LossScaler.unscale_``), for
        torch's clipping, which the step then applies."""
        self._unscale_once(self._fused(optimizer), true_grads=True)

    def teardown(self) -> None:
        """The end of a Trainer run: the last step's scale update."""
        self._finish_iteration()
        super().teardown()

    # ------------------------------------------------------------------------------------------
    # Checkpoints
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse to resume training from a checkpoint saved without AmpPrecision (before any state loads)."""
        if self._fitting and checkpoint.get("optimizer_states") and type(self).__qualname__ not in checkpoint:
            raise ValueError(
                "this checkpoint was saved without AmpPrecision: its optimizer state is a torch optimizer's, "
                "with no FP32 masters, so the fused optimizer cannot continue it. Start from its weights "
                "instead (module = YourModule.load_from_checkpoint(path), then trainer.fit(module) without "
                "ckpt_path), or resume it with the precision it was saved with"
            )

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state and the count of skipped steps (reads the device: checkpoint time only)."""
        self._finish_iteration()
        skipped = 0 if self.skipped_steps is None else int(self.skipped_steps.item())
        return {"loss_scaler": self.loss_scaler.state_dict(), "skipped_steps": skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict` returned."""
        if not isinstance(state_dict, dict) or "loss_scaler" not in state_dict:
            raise ValueError(
                "AmpPrecision.load_state_dict takes the dict AmpPrecision.state_dict() returned (a "
                "checkpoint saved with AmpPrecision); this one has no 'loss_scaler' entry"
            )
        self._finish_iteration()
        if self.loss_scaler.is_enabled():
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = torch.tensor(int(state_dict.get("skipped_steps", 0)))
