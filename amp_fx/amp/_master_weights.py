"""What `amp.initialize` does to an optimizer: FP32 master weights and loss-scale bookkeeping.

Three kinds of optimizer, chosen by `optimizer_kind`:

- FUSED: `amp_fx.optim.FusedAdam` / `FusedSGD` keep the FP32 masters in their own state and take
  the loss scale as a pending grad multiplier (`amp_fx.LossScaler.unscale_`'s protocol): the model
  grads stay scaled, the kernel unscales, checks and skips on the device. The fast path.
- MASTERS: any other torch.optim optimizer when the opt level asks for master weights (O2): its
  param groups are pointed at FP32 copies of the model's low-precision parameters. After each
  backward the fp16/bf16 grads are unscaled into the masters' FP32 grads (so grads of several
  losses with different scales add up exactly, as in Apex); ``step`` updates the masters and
  copies them back into the model.
- DIRECT: any other optimizer without master weights (O0, O1, O3): it updates the model's
  parameters; grads are unscaled in place after each backward, as in Apex.

For the MASTERS and DIRECT kinds a skipped step needs the overflow flag on the host, unless the
optimizer reads ``found_inf`` itself (``_step_supports_amp_scaling``, e.g. torch's
``Adam(fused=True)``): this is the one sync per step that torch.amp.GradScaler also pays for
such optimizers. The FUSED kind never syncs.

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

import enum
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from amp_fx.amp import _grads
from amp_fx.amp._grads import FoundInf
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.optim._fused_base import MASTER_KEY, is_fused_optimizer

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


class AmpOptimizer:
    """The amp state of one optimizer returned by `amp.initialize` (``optimizer._amp_fx``).

    Build it with `install`. ``param_map`` maps a parameter the optimizer was built with (the
    original model's) to the converted model's parameter, or returns it unchanged; ``session``
    is the `AmpSession` whose overflow messages ``step`` flushes.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        kind: OptimizerKind,
        param_map: Callable[[Tensor], Tensor],
        session: Any = None,
    ) -> None:
        self.optimizer = optimizer
        self.kind = kind
        self.param_map = param_map
        self.session = session
        # MASTERS kind: (model parameter, the tensor the optimizer updates) in param-group order;
        # the second is an FP32 master for low-precision parameters and the parameter itself otherwise.
        self.pairs: list[tuple[Tensor, Tensor]] = []
        # Overflow flags of the backwards since the last step (MASTERS and DIRECT kinds).
        self.found: FoundInf = {}
        # Grads taken aside before a backward, added back after it: (param, grad).
        self.stashed: list[tuple[Tensor, Tensor]] = []
        # FUSED kind: the scale the model grads carry (None: unscaled), and that of the stashed ones.
        self.grad_scale: Tensor | None = None
        self.stash_scale: Tensor | None = None
        # FUSED kind: grad multiplier per device used when amp.master_params handed out FP32 grads.
        self.materialized: dict[torch.device, Tensor | None] | None = None
        # A backward with delay_unscale=True left scaled grads to be unscaled by the next one.
        self.delayed = False
        # The scale_loss context whose backward this optimizer has not finished yet.
        self.open_context: Any = None
        self.original_methods: dict[str, Any] = {}
        self._warned_step_inside = False

    # ------------------------------------------------------------------------------------------
    # Installation
    @classmethod
    def install(
        cls,
        optimizer: torch.optim.Optimizer,
        kind: OptimizerKind,
        param_map: Callable[[Tensor], Tensor] = lambda p: p,
        session: Any = None,
        master_weights: bool | None = None,
    ) -> AmpOptimizer:
        """Point `optimizer` at the converted parameters, set up its kind and patch its methods.

        Nothing changes if a check fails (e.g. a parameter appears twice after mapping).
        """
        cls.check_installable(optimizer, param_map)
        amp = cls(optimizer, kind, param_map, session)
        new_groups = []
        for group in optimizer.param_groups:
            originals = list(group["params"])
            new_groups.append((group, originals, [param_map(p) for p in originals]))

        with torch.no_grad():
            for group, originals, mapped in new_groups:
                if kind is OptimizerKind.MASTERS:
                    targets = [
                        _new_master(p, o) if p.dtype in LOW_PRECISION_DTYPES else p
                        for p, o in zip(mapped, originals, strict=True)
                    ]
                    amp.pairs.extend(zip(mapped, targets, strict=True))
                else:
                    targets = mapped
                amp._rekey_state(originals, targets)
                if kind is OptimizerKind.FUSED:
                    amp._init_fused_masters(group, originals, targets, master_weights)
                group["params"] = targets
        if kind is OptimizerKind.FUSED and master_weights is not None:
            optimizer.defaults["master_weights"] = bool(master_weights)

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

    def _rekey_state(self, originals: list[Tensor], targets: list[Tensor]) -> None:
        """Move per-parameter state from the original parameters to the ones now optimized."""
        state = self.optimizer.state
        for original, target in zip(originals, targets, strict=True):
            if original is target or original not in state:
                continue
            entry = state.pop(original)
            if self.kind is OptimizerKind.DIRECT:
                # torch.optim's rule for loaded state: floating tensors follow the parameter's dtype.
                entry = {
                    key: value.to(target.dtype)
                    if key != "step" and isinstance(value, Tensor) and value.is_floating_point()
                    else value
                    for key, value in entry.items()
                }
            state[target] = entry

    def _init_fused_masters(
        self,
        group: dict[str, Any],
        originals: list[Tensor],
        params: list[Tensor],
        master_weights: bool | None,
    ) -> None:
        """FUSED kind: masters from the FP32 originals (exact) for the now low-precision params."""
        if master_weights is not None:
            group["master_weights"] = bool(master_weights)
        state = self.optimizer.state
        for original, param in zip(originals, params, strict=True):
            entry = state[param]
            if param.dtype in LOW_PRECISION_DTYPES and group.get("master_weights", True):
                if MASTER_KEY not in entry:
                    entry[MASTER_KEY] = _new_master(param, original).requires_grad_(False)
            else:
                entry.pop(MASTER_KEY, None)

    # ------------------------------------------------------------------------------------------
    # Parameters
    def params(self) -> list[Tensor]:
        """The model parameters this optimizer updates (through masters or directly)."""
        if self.kind is OptimizerKind.MASTERS:
            return [p for p, _ in self.pairs]
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _direct_params(self) -> list[Tensor]:
        if self.kind is OptimizerKind.MASTERS:
            return [p for p, target in self.pairs if target is p]
        return self.params()

    def _master_pairs(self) -> list[tuple[Tensor, Tensor]]:
        return [(p, target) for p, target in self.pairs if target is not p]

    def _fused_master(self, param: Tensor) -> Tensor:
        return self.optimizer.state.get(param, {}).get(MASTER_KEY, param)

    def master_of(self, param: Tensor) -> Tensor | None:
        """The FP32 master this optimizer keeps for model parameter `param` (None if it keeps none)."""
        if self.kind is OptimizerKind.FUSED:
            master = self._fused_master(param)
            return None if master is param else master
        if self.kind is OptimizerKind.MASTERS:
            for model_param, master in self._master_pairs():
                if model_param is param:
                    return master
        return None

    def masters_by_param(self) -> dict[int, Tensor]:
        """id(model parameter) -> its FP32 master, for every parameter that has one."""
        if self.kind is OptimizerKind.MASTERS:
            return {id(p): master for p, master in self._master_pairs()}
        if self.kind is OptimizerKind.FUSED:
            return {id(p): m for p in self.params() if (m := self._fused_master(p)) is not p}
        return {}

    def master_params(self) -> Iterator[Tensor]:
        """The tensors the optimizer updates, with unscaled grads: FP32 masters where there are some.

        For the FUSED kind this hands out FP32 copies of the unscaled grads as the masters'
        ``.grad`` (so ``torch.nn.utils.clip_grad_norm_(amp.master_params(opt), ...)`` works as in
        Apex); the next ``step`` folds whatever was done to them back into the model grads.
        """
        if self.kind is OptimizerKind.FUSED:
            self._materialize_master_grads()
            for param in self.params():
                yield self._fused_master(param)
            return
        for group in self.optimizer.param_groups:
            yield from group["params"]

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
                    pending = self.optimizer.pending_scaling(device)[0]
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
    # Around a backward (called by amp.scale_loss)
    def prepare_backward(self) -> None:
        """Before a scaled backward: take existing grads aside so that the new ones arrive alone."""
        if self.delayed:
            return  # the previous backward left grads at this same scale: let autograd add to them
        if self.kind is OptimizerKind.FUSED:
            self._write_back_master_grads()
            for param in self.params():
                if param.grad is not None:
                    self.stashed.append((param, param.grad))
                    param.grad = None
            self.stash_scale = self.grad_scale
            return
        for param in self._direct_params():
            if param.grad is not None:
                self.stashed.append((param, param.grad))
                param.grad = None
        for param, _ in self._master_pairs():
            # Its previous grads were unscaled into the master's at the end of their backward.
            param.grad = None

    def finish_backward(self, inv_scale: Tensor, used_scale: Tensor) -> FoundInf:
        """After a backward at scale `used_scale`: check this loss's new grads and unscale them.

        Returns this loss's overflow flags (per device) for its scaler. Device ops only.
        """
        self.delayed = False
        found: FoundInf = {}
        with torch.no_grad():
            if self.kind is OptimizerKind.FUSED:
                self._finish_fused(inv_scale, used_scale, found)
            else:
                self._finish_unscaled(inv_scale, found)
                for device, flag in found.items():
                    current = self.found.get(device)
                    self.found[device] = flag.clone() if current is None else current + flag
        return found

    def _finish_unscaled(self, inv_scale: Tensor, found: FoundInf) -> None:
        direct = [p for p in self._direct_params() if p.grad is not None]
        _grads.unscale_and_check_([p.grad for p in direct], inv_scale, found)
        self._add_back_stashed()
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

    def _add_back_stashed(self) -> None:
        stashed, self.stashed = self.stashed, []
        both = [(p.grad, old) for p, old in stashed if p.grad is not None]
        for param, old in stashed:
            if param.grad is None:
                param.grad = old
        if both:
            _grads.add_([new for new, _ in both], [old for _, old in both])

    def _finish_fused(self, inv_scale: Tensor, used_scale: Tensor, found: FoundInf) -> None:
        stashed, self.stashed = self.stashed, []
        if not stashed:
            self.grad_scale = used_scale
            found.update(self.optimizer.unscale_grads_(inv_scale))
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
        self.optimizer.unscale_grads_(common.double().reciprocal().float())

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
        if closure is not None and self.kind is not OptimizerKind.DIRECT:
            raise RuntimeError(
                "amp_fx.amp does not take closures with master weights or fused optimizers (nor did Apex): "
                "compute the loss, backward it under amp.scale_loss, then call optimizer.step()"
            )
        original_step = self.original_methods["step"]
        if self.kind is OptimizerKind.FUSED:
            self._write_back_master_grads()
            return original_step(closure)
        found, self.found = self.found, {}
        stepped, result = self._guarded_step(original_step, closure, found)
        if self.kind is OptimizerKind.MASTERS:
            pairs = self._master_pairs()
            if stepped and pairs:
                with torch.no_grad():
                    _grads.copy_([p for p, _ in pairs], [master for _, master in pairs])
            for _, master in pairs:
                master.grad = None  # as Apex: a master's grad lives for one step
        return result

    def _guarded_step(self, original_step: Any, closure: Any, found: FoundInf) -> tuple[bool, Any]:
        """Step unless `found` flags an overflow. (stepped or maybe-stepped, result)."""
        if not found:
            return True, original_step(closure)
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):
            params = self.optimizer.param_groups[0]["params"]
            device = params[0].device if params else next(iter(found))
            # torch's fused optimizers take GradScaler's 0-dim flag.
            self.optimizer.found_inf = _grads.total_flag(found, device).reshape(())
            try:
                return True, original_step(closure)
            finally:
                del self.optimizer.found_inf
        if _grads.any_flag_on_host(found):
            if self.session is not None:
                self.session.log_overflows()
            return False, None
        return True, original_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_methods["zero_grad"](set_to_none)
        if self.kind is OptimizerKind.MASTERS:
            for param, _ in self._master_pairs():
                if set_to_none or param.grad is None:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()
        if self.kind is OptimizerKind.FUSED:
            self.optimizer.finish_scaling()
            for param in self.params():
                master = self._fused_master(param)
                if master is not param:
                    master.grad = None
        self.found, self.stashed, self.materialized = {}, [], None
        self.grad_scale = self.stash_scale = None
        self.delayed = False

    def state_dict(self) -> dict[str, Any]:
        state = self.original_methods["state_dict"]()
        if self.kind is OptimizerKind.MASTERS:
            state[MASTERS_KEY] = [master if master is not p else None for p, master in self.pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"state_dict must be a dict from optimizer.state_dict(), got {type(state_dict).__name__}"
            )
        if self.kind is not OptimizerKind.MASTERS:
            state_dict = {k: v for k, v in state_dict.items() if k != MASTERS_KEY}
            self.original_methods["load_state_dict"](state_dict)
            self.zero_pending()
            return
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

    def zero_pending(self) -> None:
        """Forget overflow flags and stashed grads (after a load: the next iteration starts clean)."""
        self.found, self.stashed, self.materialized = {}, [], None
        self.delayed = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        if "params" not in group:
            raise ValueError("param_group has no 'params' entry; pass {'params': [...], ...}")
        originals = _params_of(group["params"])
        mapped = [self.param_map(p) for p in originals]
        add = self.original_methods["add_param_group"]
        if self.kind is OptimizerKind.MASTERS:
            with torch.no_grad():
                targets = [
                    _new_master(p, o) if p.dtype in LOW_PRECISION_DTYPES else p
                    for p, o in zip(mapped, originals, strict=True)
                ]
            add({**group, "params": targets})
            self.pairs.extend(zip(mapped, targets, strict=True))
            return
        if self.kind is OptimizerKind.FUSED:
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
            return
        add({**group, "params": mapped})
