"""What `amp.initialize` does to an optimizer: FP32 master weights and loss-scale bookkeeping.

Three kinds of optimizer, chosen by `optimizer_kind`, each handled by its own `AmpOptimizer`
subclass (`AmpOptimizer.install` is the factory that picks it):

- FUSED (`FusedAmpOptimizer`): `amp_fx.optim.FusedAdam` / `FusedSGD` keep the FP32 masters in
  their own state and take the loss scale as a pending grad multiplier (the `ScaledOptimizer`
  handshake, `amp_fx.optim.scaled_optimizer`, as under `amp_fx.LossScaler`): the model grads stay
  scaled, the kernel unscales, checks and skips on the device. The fast path.
- MASTERS (`MasterWeightsAmpOptimizer`): any other torch.optim optimizer when the opt level asks
  for master weights (O2): its param groups are pointed at FP32 copies of the model's
  low-precision parameters. After each backward the fp16/bf16 grads are unscaled into the
  masters' FP32 grads (so grads of several losses with different scales add up exactly, as in
  Apex); ``step`` updates the masters and copies them back into the model.
- DIRECT (`DirectAmpOptimizer`): any other optimizer without master weights (O0, O1, O3): it
  updates the model's parameters; grads are unscaled in place after each backward, as in Apex.

For the MASTERS and DIRECT kinds a skipped step needs the overflow flag on the host, unless the
optimizer reads ``found_inf`` itself (``_step_supports_amp_scaling``, e.g. torch's
``Adam(fused=True)``): this is the one sync per step that torch.amp.GradScaler also pays for
such optimizers. The FUSED kind never syncs. Unscaling and skipping are `amp_fx.LossScaler`'s own code
(`amp_fx.optim.torch_optimizer_scaling`).

The optimizer object stays what it was (an LR scheduler, ``isinstance`` checks and ``param_groups``
keep working); ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict`` and ``add_param_group``
are replaced on the instance by bound methods that go through its `AmpOptimizer`
(``optimizer._amp_fx``). The MASTERS kind's state dict carries the masters (key
``"amp_fx_master_params"``), so a resumed run continues bit for bit::

    >>> import torch
    >>> model = torch.nn.Linear(2, 2).half()
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> amp_opt = AmpOptimizer.install(opt, OptimizerKind.MASTERS)
    >>> [p.dtype for p in opt.param_groups[0]["params"]]
    [torch.float32, torch.float32]
"""

from __future__ import annotations

import abc
import enum
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from amp_fx.amp import _grads
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.optim._fused_base import MASTER_KEY, is_fused_optimizer
from amp_fx.optim.scaled_optimizer import ScaledOptimizer
from amp_fx.optim.torch_optimizer_scaling import (
    FoundInf,
    any_overflow_on_host,
    reads_found_inf,
    step_reading_found_inf,
    total_found_inf,
)

logger = logging.getLogger("amp_fx.amp")

MASTERS_KEY = "amp_fx_master_params"
PATCHED_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")


class OptimizerKind(enum.Enum):
    FUSED = "fused"
    MASTERS = "masters"
    DIRECT = "direct"


def optimizer_kind(optimizer: torch.optim.Optimizer, master_weights: bool | None) -> OptimizerKind:
    """The kind for `optimizer` under the opt level's ``master_weights`` property."""
    if is_fused_optimizer(optimizer):
        return OptimizerKind.FUSED
    return OptimizerKind.MASTERS if master_weights else OptimizerKind.DIRECT


def _params_of(group_params: Any) -> list[Tensor]:
    if isinstance(group_params, Tensor):
        return [group_params]
    if isinstance(group_params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set")
    return list(group_params)


def _new_master(model_param: Tensor, source: Tensor | None) -> Tensor:
    """An FP32 leaf copy of a parameter: from its FP32 original when there is one (no rounding)."""
    exact = source is not None and source.dtype == torch.float32 and source.shape == model_param.shape
    value = source if exact else model_param
    master = value.detach().to(device=model_param.device, dtype=torch.float32, copy=True)
    return master.requires_grad_(model_param.requires_grad)


# Bound to the optimizer instance, so that `optimizer.step.__func__` exists (LR schedulers wrap it).
def _amp_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    return self._amp_fx.step(closure)


def _amp_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    self._amp_fx.zero_grad(set_to_none)


def _amp_state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    return self._amp_fx.state_dict()


def _amp_load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    self._amp_fx.load_state_dict(state_dict)


def _amp_add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    self._amp_fx.add_param_group(param_group)


_PATCHES = {
    "step": _amp_step,
    "zero_grad": _amp_zero_grad,
    "state_dict": _amp_state_dict,
    "load_state_dict": _amp_load_state_dict,
    "add_param_group": _amp_add_param_group,
}


class AmpOptimizer(abc.ABC):
    """The amp state of one optimizer returned by `amp.initialize` (``optimizer._amp_fx``).

    One subclass per strategy (`FusedAmpOptimizer`, `MasterWeightsAmpOptimizer`,
    `DirectAmpOptimizer`); `install` picks it from the `OptimizerKind`. ``param_map`` maps a
    parameter the optimizer was built with (the original model's) to the converted model's
    parameter, or returns it unchanged; ``session`` is the `AmpSession` whose overflow messages
    ``step`` flushes.
    """

    kind: ClassVar[OptimizerKind]
    # Whether optimizer.step(closure) is allowed (Apex refused closures with master weights too).
    accepts_closure: ClassVar[bool] = False

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor], session: Any = None
    ) -> None:
        self.optimizer = optimizer
        self.param_map = param_map
        self.session = session
        # Grads taken aside before a backward, added back after it: (param, grad).
        self.stashed: list[tuple[Tensor, Tensor]] = []
        # A backward with delay_unscale=True left scaled grads to be unscaled by the next one.
        self.delayed = False
        # The scale_loss context whose backward this optimizer has not finished yet.
        self.open_context: Any = None
        self.original_methods: dict[str, Any] = {}
        self._warned_step_inside = False

    # ------------------------------------------------------------------------------------------
    # Installation
    @staticmethod
    def install(
        optimizer: torch.optim.Optimizer,
        kind: OptimizerKind,
        param_map: Callable[[Tensor], Tensor] = lambda p: p,
        session: Any = None,
        master_weights: bool | None = None,
    ) -> AmpOptimizer:
        """The factory: build `kind`'s strategy, point `optimizer` at the converted parameters and
        patch its methods.

        Nothing changes if a check fails (e.g. a parameter appears twice after mapping).
        """
        AmpOptimizer.check_installable(optimizer, param_map)
        amp = _STRATEGIES[kind](optimizer, param_map, session)
        groups = [(group, list(group["params"])) for group in optimizer.param_groups]
        mapped = [[param_map(p) for p in originals] for _, originals in groups]
        with torch.no_grad():
            for (group, originals), params in zip(groups, mapped, strict=True):
                group["params"] = amp._adopt_group(group, originals, params, master_weights)

        for name in PATCHED_METHODS:
            amp.original_methods[name] = getattr(optimizer, name)
            setattr(optimizer, name, types.MethodType(_PATCHES[name], optimizer))
        optimizer._amp_fx = amp
        return amp

    @staticmethod
    def check_installable(optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor]) -> None:
        """Raise if `install` would fail: a parameter twice after mapping, or an optimizer patched already."""
        if getattr(optimizer, "_amp_fx", None) is not None:
            raise ValueError(f"this {type(optimizer).__name__} was already prepared by amp.initialize")
        seen: set[int] = set()
        for group in optimizer.param_groups:
            for param in group["params"]:
                mapped = param_map(param)
                if id(mapped) in seen:
                    raise ValueError(
                        "a parameter appears twice in the optimizer after amp.initialize mapped the model's "
                        "parameters to the converted model's; build the optimizer from one model's parameters"
                    )
                seen.add(id(mapped))

    @abc.abstractmethod
    def _adopt_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        master_weights: bool | None,
    ) -> list[Tensor]:
        """The tensors `group` optimizes from now on (its state moved to them), for `install`."""

    def _rekey_state(
        self, originals: list[Tensor], targets: list[Tensor], follow_dtype: bool = False
    ) -> None:
        """Move per-parameter state from the original parameters to the ones now optimized.

        ``follow_dtype``: torch.optim's rule for loaded state, floating tensors take the parameter's dtype.
        """
        state = self.optimizer.state
        for original, target in zip(originals, targets, strict=True):
            if original is target or original not in state:
                continue
            entry = state.pop(original)
            if follow_dtype:
                entry = {
                    key: value.to(target.dtype)
                    if key != "step" and isinstance(value, Tensor) and value.is_floating_point()
                    else value
                    for key, value in entry.items()
                }
            state[target] = entry

    # ------------------------------------------------------------------------------------------
    # Parameters
    def params(self) -> list[Tensor]:
        """The model parameters this optimizer updates (through masters or directly)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def master_of(self, param: Tensor) -> Tensor | None:
        """The FP32 master this optimizer keeps for model parameter `param` (None if it keeps none)."""
        return self.masters_by_param().get(id(param))

    def masters_by_param(self) -> dict[int, Tensor]:
        """id(model parameter) -> its FP32 master, for every parameter that has one."""
        return {}

    def master_params(self) -> Iterator[Tensor]:
        """The tensors the optimizer updates, with unscaled grads: FP32 masters where there are some."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    # ------------------------------------------------------------------------------------------
    # Around a backward (called by amp.scale_loss)
    def prepare_backward(self) -> None:
        """Before a scaled backward: take existing grads aside so that the new ones arrive alone."""
        if self.delayed:
            return  # the previous backward left grads at this same scale: let autograd add to them
        self._stash_grads()

    @abc.abstractmethod
    def _stash_grads(self) -> None:
        """Take aside (or drop) the grads that the next backward must not add to."""

    def finish_backward(self, inv_scale: Tensor, used_scale: Tensor) -> FoundInf:
        """After a backward at scale `used_scale`: check this loss's new grads and unscale them.

        Returns this loss's overflow flags (per device) for its scaler. Device ops only.
        """
        self.delayed = False
        found: FoundInf = {}
        with torch.no_grad():
            self._finish_backward(inv_scale, used_scale, found)
        return found

    @abc.abstractmethod
    def _finish_backward(self, inv_scale: Tensor, used_scale: Tensor, found: FoundInf) -> None:
        """Unscale and check the new grads, set this loss's flags in `found`."""

    def _add_back_stashed(self) -> None:
        stashed, self.stashed = self.stashed, []
        both = [(p.grad, old) for p, old in stashed if p.grad is not None]
        for param, old in stashed:
            if param.grad is None:
                param.grad = old
        if both:
            _grads.add_([new for new, _ in both], [old for _, old in both])

    def mark_delayed(self) -> None:
        """After a backward with delay_unscale=True: its grads wait, scaled, for the next backward."""
        self.delayed = True

    # ------------------------------------------------------------------------------------------
    # The patched methods
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.delayed:
            raise RuntimeError(
                "optimizer.step() was called after amp.scale_loss(..., delay_unscale=True): those grads are "
                "still scaled. Run one more backward under amp.scale_loss with delay_unscale=False, then step"
            )
        if self.open_context is not None:
            # The seeds' programs step inside `with amp.scale_loss(...)`: finish that backward first.
            if not self._warned_step_inside:
                logger.info("optimizer.step() inside amp.scale_loss: unscaling that loss's gradients first")
                self._warned_step_inside = True
            self.open_context.finish()
        if self.session is not None:
            self.session.log_overflows()
        if closure is not None and not self.accepts_closure:
            raise RuntimeError(
                "amp_fx.amp does not take closures with master weights or fused optimizers (nor did Apex): "
                "compute the loss, backward it under amp.scale_loss, then call optimizer.step()"
            )
        return self._step(self.original_methods["step"], closure)

    @abc.abstractmethod
    def _step(self, original_step: Callable[..., Any], closure: Callable[[], Any] | None) -> Any:
        """Run the wrapped optimizer's step (or skip it) for this strategy."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_methods["zero_grad"](set_to_none)
        self.zero_pending()

    def state_dict(self) -> dict[str, Any]:
        return self.original_methods["state_dict"]()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict_type(state_dict)
        state_dict = {k: v for k, v in state_dict.items() if k != MASTERS_KEY}
        self.original_methods["load_state_dict"](state_dict)
        self.zero_pending()

    @staticmethod
    def _check_state_dict_type(state_dict: Any) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"state_dict must be a dict from optimizer.state_dict(), got {type(state_dict).__name__}"
            )

    def zero_pending(self) -> None:
        """Forget overflow flags and stashed grads (after a load: the next iteration starts clean)."""
        self.stashed = []
        self.delayed = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        if "params" not in group:
            raise ValueError("param_group has no 'params' entry; pass {'params': [...], ...}")
        originals = _params_of(group["params"])
        mapped = [self.param_map(p) for p in originals]
        self._add_param_group(group, originals, mapped, self.original_methods["add_param_group"])

    def _add_param_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        add: Callable[[dict[str, Any]], None],
    ) -> None:
        add({**group, "params": mapped})


class DirectAmpOptimizer(AmpOptimizer):
    """DIRECT: a torch.optim optimizer without master weights (O0, O1, O3) updates the model's params.

    After each backward the new grads are unscaled in place and added to the earlier ones; the
    step is skipped on the overflow flags of all backwards since the last step (on the device for
    optimizers that read ``found_inf``, else on the host).
    """

    kind = OptimizerKind.DIRECT
    accepts_closure = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor], session: Any = None
    ) -> None:
        super().__init__(optimizer, param_map, session)
        # Overflow flags of the backwards since the last step.
        self.found: FoundInf = {}

    def _adopt_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        master_weights: bool | None,
    ) -> list[Tensor]:
        self._rekey_state(originals, mapped, follow_dtype=True)
        return mapped

    def _direct_params(self) -> list[Tensor]:
        """The model parameters the wrapped optimizer updates itself."""
        return self.params()

    def _stash_grads(self) -> None:
        for param in self._direct_params():
            if param.grad is not None:
                self.stashed.append((param, param.grad))
                param.grad = None

    def _finish_backward(self, inv_scale: Tensor, used_scale: Tensor, found: FoundInf) -> None:
        self._unscale_new_grads(inv_scale, found)
        for device, flag in found.items():
            current = self.found.get(device)
            self.found[device] = flag.clone() if current is None else current + flag

    def _unscale_new_grads(self, inv_scale: Tensor, found: FoundInf) -> None:
        direct = [p for p in self._direct_params() if p.grad is not None]
        _grads.unscale_and_check_([p.grad for p in direct], inv_scale, found)
        self._add_back_stashed()

    def _step(self, original_step: Callable[..., Any], closure: Callable[[], Any] | None) -> Any:
        found, self.found = self.found, {}
        stepped, result = self._guarded_step(original_step, closure, found)
        self._stepped(stepped)
        return result

    def _stepped(self, stepped: bool) -> None:
        """After the wrapped step (`stepped`: it ran, or may have, on the device)."""

    def _guarded_step(self, original_step: Any, closure: Any, found: FoundInf) -> tuple[bool, Any]:
        """Step unless `found` flags an overflow. (stepped or maybe-stepped, result)."""
        if not found:
            return True, original_step(closure)
        if reads_found_inf(self.optimizer):
            params = self.optimizer.param_groups[0]["params"]
            device = params[0].device if params else next(iter(found))
            # torch's fused optimizers take GradScaler's 0-dim flag.
            found_inf = total_found_inf(found, device).reshape(())
            return True, step_reading_found_inf(self.optimizer, lambda: original_step(closure), found_inf)
        if any_overflow_on_host(found):
            if self.session is not None:
                self.session.log_overflows()
            return False, None
        return True, original_step(closure)

    def zero_pending(self) -> None:
        super().zero_pending()
        self.found = {}


class MasterWeightsAmpOptimizer(DirectAmpOptimizer):
    """MASTERS: any other torch.optim optimizer when the opt level asks for master weights (O2).

    Its param groups hold FP32 masters in place of the model's low-precision params (FP32 params
    stay themselves and are handled as by `DirectAmpOptimizer`). After each backward the
    low-precision grads are unscaled into the masters' FP32 grads (so grads of several losses with
    different scales add up exactly, as in Apex); ``step`` updates the masters and copies them
    back into the model. Its state dict carries the masters under ``MASTERS_KEY``.
    """

    kind = OptimizerKind.MASTERS
    accepts_closure = False

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor], session: Any = None
    ) -> None:
        super().__init__(optimizer, param_map, session)
        # (model parameter, the tensor the optimizer updates) in param-group order; the second is an
        # FP32 master for low-precision parameters and the parameter itself otherwise.
        self.pairs: list[tuple[Tensor, Tensor]] = []

    def _targets(self, originals: list[Tensor], mapped: list[Tensor]) -> list[Tensor]:
        """FP32 masters for the low-precision params (from their FP32 originals), the others as they are."""
        return [
            _new_master(p, o) if p.dtype in LOW_PRECISION_DTYPES else p
            for p, o in zip(mapped, originals, strict=True)
        ]

    def _adopt_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        master_weights: bool | None,
    ) -> list[Tensor]:
        targets = self._targets(originals, mapped)
        self.pairs.extend(zip(mapped, targets, strict=True))
        self._rekey_state(originals, targets)
        return targets

    def _master_pairs(self) -> list[tuple[Tensor, Tensor]]:
        return [(p, target) for p, target in self.pairs if target is not p]

    def params(self) -> list[Tensor]:
        return [p for p, _ in self.pairs]

    def _direct_params(self) -> list[Tensor]:
        return [p for p, target in self.pairs if target is p]

    def masters_by_param(self) -> dict[int, Tensor]:
        return {id(p): master for p, master in self._master_pairs()}

    def _stash_grads(self) -> None:
        super()._stash_grads()
        for param, _ in self._master_pairs():
            # Its previous grads were unscaled into the master's at the end of their backward.
            param.grad = None

    def _unscale_new_grads(self, inv_scale: Tensor, found: FoundInf) -> None:
        super()._unscale_new_grads(inv_scale, found)
        pairs = [(p, master) for p, master in self._master_pairs() if p.grad is not None]
        if not pairs:
            return
        new_grads = [p.grad.to(torch.float32) for p, _ in pairs]
        _grads.unscale_and_check_(new_grads, inv_scale, found)
        existing = [
            (master.grad, grad)
            for (_, master), grad in zip(pairs, new_grads, strict=True)
            if master.grad is not None
        ]
        for (_, master), grad in zip(pairs, new_grads, strict=True):
            if master.grad is None:
                master.grad = grad
        if existing:
            _grads.add_([target for target, _ in existing], [source for _, source in existing])

    def _stepped(self, stepped: bool) -> None:
        pairs = self._master_pairs()
        if stepped and pairs:
            with torch.no_grad():
                _grads.copy_([p for p, _ in pairs], [master for _, master in pairs])
        for _, master in pairs:
            master.grad = None  # as Apex: a master's grad lives for one step

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        # The model's low-precision params, whose grads the wrapped optimizer (on the masters) never sees.
        for param, _ in self._master_pairs():
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                param.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state[MASTERS_KEY] = [master if master is not p else None for p, master in self.pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict_type(state_dict)
        state_dict = dict(state_dict)
        saved = state_dict.pop(MASTERS_KEY, None)
        if saved is not None:
            self._check_saved_masters(saved)
        self.original_methods["load_state_dict"](state_dict)
        if saved is None:
            logger.info(
                "the optimizer state dict has no FP32 master weights (not saved by amp_fx): the masters keep "
                "their current values, copied from the model"
            )
        else:
            with torch.no_grad():
                for (param, master), value in zip(self.pairs, saved, strict=True):
                    if master is not param:
                        master.copy_(value)
        self.zero_pending()

    def _check_saved_masters(self, saved: Any) -> None:
        if not isinstance(saved, (list, tuple)) or len(saved) != len(self.pairs):
            count = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
            raise ValueError(
                f"the state dict's {MASTERS_KEY!r} holds {count} entries but the optimizer has "
                f"{len(self.pairs)} parameters; load a state dict saved from this model and optimizer"
            )
        for index, ((param, master), value) in enumerate(zip(self.pairs, saved, strict=True)):
            if master is param:
                if value is not None:
                    raise ValueError(
                        f"the state dict has an FP32 master for parameter {index}, which has none here "
                        f"({param.dtype}); was it saved at another opt level?"
                    )
                continue
            if not isinstance(value, Tensor) or value.shape != master.shape or not value.is_floating_point():
                got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"the state dict's master weight {index} must be a floating tensor of shape "
                    f"{tuple(master.shape)}, got {got}; was it saved from another model or opt level?"
                )

    def _add_param_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        add: Callable[[dict[str, Any]], None],
    ) -> None:
        with torch.no_grad():
            targets = self._targets(originals, mapped)
        add({**group, "params": targets})
        self.pairs.extend(zip(mapped, targets, strict=True))


class FusedAmpOptimizer(AmpOptimizer):
    """FUSED: `amp_fx.optim.FusedAdam` / `FusedSGD`, the fast path, through the `ScaledOptimizer` handshake.

    The optimizer keeps the FP32 masters in its own state and takes the loss scale as a pending
    grad multiplier: the model grads stay scaled, its kernel unscales, checks and skips on the
    device, and no step syncs.
    """

    kind = OptimizerKind.FUSED

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor], session: Any = None
    ) -> None:
        super().__init__(optimizer, param_map, session)
        self.scaled: ScaledOptimizer = optimizer
        # The scale the model grads carry (None: unscaled), and that of the stashed ones.
        self.grad_scale: Tensor | None = None
        self.stash_scale: Tensor | None = None
        # Grad multiplier per device used when amp.master_params handed out FP32 grads.
        self.materialized: dict[torch.device, Tensor | None] | None = None

    def _adopt_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        master_weights: bool | None,
    ) -> list[Tensor]:
        """Masters from the FP32 originals (exact) for the now low-precision params."""
        self._rekey_state(originals, mapped)
        if master_weights is not None:
            group["master_weights"] = bool(master_weights)
            self.optimizer.defaults["master_weights"] = bool(master_weights)
        state = self.optimizer.state
        for original, param in zip(originals, mapped, strict=True):
            entry = state[param]
            if param.dtype in LOW_PRECISION_DTYPES and group.get("master_weights", True):
                if MASTER_KEY not in entry:
                    entry[MASTER_KEY] = _new_master(param, original).requires_grad_(False)
            else:
                entry.pop(MASTER_KEY, None)
        return mapped

    # ------------------------------------------------------------------------------------------
    # Masters and their FP32 grads
    def _fused_master(self, param: Tensor) -> Tensor:
        return self.optimizer.state.get(param, {}).get(MASTER_KEY, param)

    def masters_by_param(self) -> dict[int, Tensor]:
        return {id(p): m for p in self.params() if (m := self._fused_master(p)) is not p}

    def master_of(self, param: Tensor) -> Tensor | None:
        master = self._fused_master(param)
        return None if master is param else master

    def master_params(self) -> Iterator[Tensor]:
        """The FP32 masters (the params without one themselves), with unscaled grads.

        Hands out FP32 copies of the unscaled grads as the masters' ``.grad`` (so
        ``torch.nn.utils.clip_grad_norm_(amp.master_params(opt), ...)`` works as in Apex); the
        next ``step`` folds whatever was done to them back into the model grads.
        """
        self._materialize_master_grads()
        for param in self.params():
            yield self._fused_master(param)

    def _materialize_master_grads(self) -> None:
        if self.materialized is not None:
            return
        multipliers: dict[torch.device, Tensor | None] = {}
        with torch.no_grad():
            for param in self.params():
                if param.grad is None:
                    continue
                device = param.grad.device
                if device not in multipliers:
                    pending = self.scaled.pending_scaling(device)[0]
                    # 0-dim, so that it scales 0-dim grads (scalar parameters) in place too.
                    multipliers[device] = None if pending is None else pending.reshape(())
                multiplier = multipliers[device]
                master = self._fused_master(param)
                if master is param:
                    if multiplier is not None:
                        param.grad.mul_(multiplier.to(param.grad.dtype))
                else:
                    grad = param.grad.to(torch.float32)
                    master.grad = grad if multiplier is None else grad.mul_(multiplier)
        self.materialized = multipliers

    def _write_back_master_grads(self) -> None:
        """Undo `_materialize_master_grads`: the (maybe clipped) FP32 grads, scaled, into the model grads."""
        multipliers, self.materialized = self.materialized, None
        if multipliers is None:
            return
        with torch.no_grad():
            for param in self.params():
                if param.grad is None:
                    continue
                multiplier = multipliers.get(param.grad.device)
                master = self._fused_master(param)
                if master is param:
                    if multiplier is not None:
                        param.grad.div_(multiplier.to(param.grad.dtype))
                elif master.grad is not None:
                    value = master.grad if multiplier is None else master.grad / multiplier
                    param.grad.copy_(value)
                    master.grad = None

    # ------------------------------------------------------------------------------------------
    # Around a backward
    def _stash_grads(self) -> None:
        self._write_back_master_grads()
        for param in self.params():
            if param.grad is not None:
                self.stashed.append((param, param.grad))
                param.grad = None
        self.stash_scale = self.grad_scale

    def _finish_backward(self, inv_scale: Tensor, used_scale: Tensor, found: FoundInf) -> None:
        stashed, self.stashed = self.stashed, []
        if not stashed:
            self.grad_scale = used_scale
            found.update(self.scaled.unscale_grads_(inv_scale))
            return
        # Grads of an earlier backward at another scale: bring both to the smaller scale, in FP32,
        # so neither overflows. This loss's flags come from its own grads only.
        _grads.check_finite([p.grad for p in self.params() if p.grad is not None], found)
        carried = self.stash_scale if self.stash_scale is not None else torch.ones_like(used_scale)
        common = torch.minimum(used_scale, carried.to(used_scale.device))
        new_factor, old_factor = common / used_scale, common / carried.to(used_scale.device)
        for param, old in stashed:
            combined = old.to(torch.float32) * old_factor.to(old.device)
            if param.grad is not None:
                combined += param.grad.to(torch.float32) * new_factor.to(old.device)
            param.grad = combined.to(param.dtype)
        stashed_ids = {id(p) for p, _ in stashed}
        for param in self.params():
            if param.grad is not None and id(param) not in stashed_ids:
                param.grad.mul_(new_factor.to(param.grad.device, param.grad.dtype))
        self.grad_scale = common
        self.stash_scale = None
        # Checks the combined grads (an overflowed earlier loss is still inf in them) for the step.
        self.scaled.unscale_grads_(common.double().reciprocal().float())

    # ------------------------------------------------------------------------------------------
    # The patched methods
    def _step(self, original_step: Callable[..., Any], closure: Callable[[], Any] | None) -> Any:
        self._write_back_master_grads()
        return original_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.scaled.finish_scaling()
        for param in self.params():
            master = self._fused_master(param)
            if master is not param:
                master.grad = None
        self.grad_scale = self.stash_scale = None

    def zero_pending(self) -> None:
        super().zero_pending()
        self.materialized = None

    def _add_param_group(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        mapped: list[Tensor],
        add: Callable[[dict[str, Any]], None],
    ) -> None:
        # Masters from the FP32 originals where the caller passed those, before the optimizer
        # would make them from the rounded parameters.
        master_weights = group.get("master_weights", self.optimizer.defaults.get("master_weights", True))
        state = self.optimizer.state
        added = [
            (original, param)
            for original, param in zip(originals, mapped, strict=True)
            if param.dtype in LOW_PRECISION_DTYPES and master_weights and param not in state
        ]
        with torch.no_grad():
            for original, param in added:
                state[param][MASTER_KEY] = _new_master(param, original).requires_grad_(False)
        try:
            add({**group, "params": mapped})
        except Exception:
            for _, param in added:  # a refused group leaves the optimizer as it was
                state.pop(param, None)
            raise


_STRATEGIES: dict[OptimizerKind, type[AmpOptimizer]] = {
    OptimizerKind.FUSED: FusedAmpOptimizer,
    OptimizerKind.MASTERS: MasterWeightsAmpOptimizer,
    OptimizerKind.DIRECT: DirectAmpOptimizer,
}
