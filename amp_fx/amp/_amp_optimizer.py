"""`AmpOptimizer`: what every strategy of `amp.initialize` for an optimizer shares.

A strategy's `install` points the optimizer's param groups at the tensors the strategy optimizes
and replaces ``step``, ``zero_grad``, ``state_dict``, ``load_state_dict`` and ``add_param_group``
on the instance by bound methods that go through it (`amp_optimizer_of` finds it again);
`amp_fx.amp._master_weights.install_amp_optimizer` picks the strategy for an `OptimizerKind`.
The base holds the bookkeeping around ``amp.scale_loss``'s backwards (grads taken aside,
``delay_unscale``, a step inside the block); a subclass says how grads are unscaled and stepped.

    >>> import torch
    >>> from amp_fx.amp._direct_optimizer import DirectAmpOptimizer
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).half().parameters(), lr=0.1)
    >>> amp_opt = DirectAmpOptimizer.install(opt)
    >>> amp_optimizer_of(opt) is amp_opt, opt.step.__self__ is opt
    (True, True)
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

from amp_fx.optim.fused_optimizer import is_fused_optimizer
from amp_fx.optim.torch_optimizer_scaling import FoundInf

logger = logging.getLogger("amp_fx.amp")

MASTERS_KEY = "amp_fx_master_params"
# The optimizer attribute that holds its `AmpOptimizer`; read it with `amp_optimizer_of`.
AMP_OPTIMIZER_ATTR = "_amp_fx"


class OptimizerKind(enum.Enum):
    FUSED = "fused"
    MASTERS = "masters"
    DIRECT = "direct"


def optimizer_kind(optimizer: torch.optim.Optimizer, master_weights: bool | None) -> OptimizerKind:
    """The kind for `optimizer` under the opt level's ``master_weights`` property."""
    if is_fused_optimizer(optimizer):
        return OptimizerKind.FUSED
    return OptimizerKind.MASTERS if master_weights else OptimizerKind.DIRECT


def amp_optimizer_of(optimizer: torch.optim.Optimizer) -> AmpOptimizer | None:
    """The `AmpOptimizer` that `amp.initialize` installed on `optimizer`; None if it installed none.

    >>> amp_optimizer_of(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)) is None
    True
    """
    return getattr(optimizer, AMP_OPTIMIZER_ATTR, None)


def _params_of(group_params: Any) -> list[Tensor]:
    if isinstance(group_params, Tensor):
        return [group_params]
    if isinstance(group_params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set")
    return list(group_params)


def new_master(model_param: Tensor, source: Tensor | None) -> Tensor:
    """An FP32 leaf copy of a parameter: from its FP32 original when there is one (no rounding)."""
    exact = source is not None and source.dtype == torch.float32 and source.shape == model_param.shape
    value = source if exact else model_param
    master = value.detach().to(device=model_param.device, dtype=torch.float32, copy=True)
    return master.requires_grad_(model_param.requires_grad)


# Bound to the optimizer instance, so that `optimizer.step.__func__` exists (LR schedulers wrap it).
def _amp_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    return amp_optimizer_of(self).step(closure)


def _amp_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    amp_optimizer_of(self).zero_grad(set_to_none)


def _amp_state_dict(self: torch.optim.Optimizer) -> dict[str, Any]:
    return amp_optimizer_of(self).state_dict()


def _amp_load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    amp_optimizer_of(self).load_state_dict(state_dict)


def _amp_add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
    amp_optimizer_of(self).add_param_group(param_group)


_PATCHES = {
    "step": _amp_step,
    "zero_grad": _amp_zero_grad,
    "state_dict": _amp_state_dict,
    "load_state_dict": _amp_load_state_dict,
    "add_param_group": _amp_add_param_group,
}
# The optimizer methods `AmpOptimizer.install` replaces, in the order it patches them.
PATCHED_METHODS = tuple(_PATCHES)


class AmpOptimizer(abc.ABC):
    """The amp state of one optimizer returned by `amp.initialize` (see `amp_optimizer_of`).

    One subclass per strategy (`FusedAmpOptimizer`, `MasterWeightsAmpOptimizer`,
    `DirectAmpOptimizer`); `install_amp_optimizer` picks it from the `OptimizerKind`. ``param_map`` maps a
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
    @classmethod
    def install(
        cls,
        optimizer: torch.optim.Optimizer,
        param_map: Callable[[Tensor], Tensor] = lambda p: p,
        session: Any = None,
        master_weights: bool | None = None,
    ) -> AmpOptimizer:
        """Build this strategy for `optimizer`, point it at the converted parameters and patch its
        methods.

        Nothing changes if a check fails (e.g. a parameter appears twice after mapping).
        """
        cls.check_installable(optimizer, param_map)
        amp = cls(optimizer, param_map, session)
        groups = [(group, list(group["params"])) for group in optimizer.param_groups]
        mapped = [[param_map(p) for p in originals] for _, originals in groups]
        with torch.no_grad():
            for (group, originals), params in zip(groups, mapped, strict=True):
                group["params"] = amp._adopt_group(group, originals, params, master_weights)

        for name in PATCHED_METHODS:
            amp.original_methods[name] = getattr(optimizer, name)
            setattr(optimizer, name, types.MethodType(_PATCHES[name], optimizer))
        setattr(optimizer, AMP_OPTIMIZER_ATTR, amp)
        return amp

    @staticmethod
    def check_installable(optimizer: torch.optim.Optimizer, param_map: Callable[[Tensor], Tensor]) -> None:
        """Raise if `install` would fail: a parameter twice after mapping, or an optimizer patched already."""
        if amp_optimizer_of(optimizer) is not None:
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

    def _take_grads_aside(self, params: list[Tensor]) -> None:
        """Move the grads of `params` into ``stashed`` (their ``.grad`` becomes None)."""
        for param in params:
            if param.grad is not None:
                self.stashed.append((param, param.grad))
                param.grad = None

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
        self._load_wrapped_state_dict(state_dict)
        self.zero_pending()

    def _load_wrapped_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's own ``load_state_dict``, undone if it raises.

        torch.optim checks a state dict only partly before it changes anything: torch's AdamW given
        a FusedAdam state dict raises KeyError: 'step' in ``__setstate__``, after its param groups
        (lr included) and state were replaced. It replaces ``state`` and ``param_groups`` whole (it
        does not write into the tensors it holds), so putting the old attributes back restores it.
        """
        optimizer = self.optimizer
        before = dict(optimizer.__dict__)
        try:
            self.original_methods["load_state_dict"](state_dict)
        except Exception:
            optimizer.__dict__.clear()
            optimizer.__dict__.update(before)
            raise

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
