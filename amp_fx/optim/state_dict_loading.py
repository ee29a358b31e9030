"""Loading a fused optimizer's state dict: every check first, then the new state as copies.

`StateDictLoading` gives `amp_fx.optim.fused_optimizer.FusedOptimizer` its ``load_state_dict``. It
reads what a fused optimizer defines: ``defaults`` and ``param_groups`` (torch.optim's),
``_check_hyperparameters(group)``, ``_state_keys(group)`` and ``_master_expected(param, group)``
(the state a parameter holds), and ``_reset_pending()`` (pending loss scaling is dropped). A
group's step count is stored under ``STEP_KEY`` and a parameter's step offset (the group steps it
took no part in) under ``STEP_OFFSET_KEY``; checkpoints saved before offsets existed have none.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from amp_fx.optim.model_load_hooks import MASTER_KEY
from amp_fx.training.distributed import is_dtensor

__all__ = ["STEP_KEY", "STEP_OFFSET_KEY", "StateDictLoading", "check_step_count"]

STEP_KEY = "step"
STEP_OFFSET_KEY = "step_offset"


def check_step_count(where: str, step: Any, key: str = STEP_KEY) -> float:
    """Return the count of steps ``step`` holds; raise ValueError unless it is finite and >= 0 (a
    Python number or a float tensor of one element). Reads a tensor's value (a host sync), so it is
    for checkpoints only: a negative, NaN or inf step would make the next update's bias correction
    NaN everywhere."""
    if isinstance(step, Tensor):
        if step.numel() != 1 or not step.is_floating_point():
            raise ValueError(
                f"{where}: '{key}' must be a float tensor of one element, got dtype {step.dtype} with "
                f"{step.numel()} elements"
            )
        value = float(step.detach().reshape(()).item())
    elif isinstance(step, bool) or not isinstance(step, (int, float)):
        raise ValueError(f"{where}: '{key}' must be a count of steps (a number >= 0), got {step!r}")
    else:
        value = float(step)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{where}: '{key}' must be a finite count of steps (>= 0), got {step!r}; the checkpoint is "
            "corrupt (a NaN or negative step would turn every weight NaN at the next step)"
        )
    return value


def _loads_into_param(param: Tensor, group: dict[str, Any], saved_state: dict[str, Any]) -> bool:
    """Whether ``saved_state`` holds a master for ``param``, FP32 here, that loads into the parameter:
    an FP32 parameter is its own master, and the torch.export front end stores some parameters low
    only at the model's first call, so a checkpoint saved after it holds masters for parameters
    still FP32 before it. (Not into FSDP2's shards: a checkpoint with masters is not theirs.)"""
    return (
        MASTER_KEY in saved_state
        and param.dtype == torch.float32
        and bool(group.get("master_weights"))
        and not is_dtensor(param)
    )


# Keys torch's Optimizer.__setstate__ adds to ``defaults`` at every load (``differentiable``): a
# state dict saved before the first load lacks them, and is no less this optimizer's.
_ADDED_BY_TORCH_ON_LOAD = frozenset({"differentiable"})


class StateDictLoading:
    """``load_state_dict`` for the fused optimizers (a base class of `FusedOptimizer`)."""

    def _check_loaded_group(self, index: int, saved: dict[str, Any], current: dict[str, Any]) -> float:
        """Check one loaded param group; returns its step count (read once: a host sync)."""
        name = type(self).__name__
        wanted = (k for k in (*self.defaults, STEP_KEY, "params") if k not in _ADDED_BY_TORCH_ON_LOAD)
        missing = sorted(k for k in wanted if k not in saved)
        if missing:
            raise ValueError(
                f"param group {index} of the loaded state dict lacks {missing}; it was not saved by a {name} "
                f"(load a state dict from {name}.state_dict())"
            )
        if len(saved["params"]) != len(current["params"]):
            raise ValueError(
                f"param group {index} of the loaded state dict has {len(saved['params'])} parameters but "
                f"this optimizer's group has {len(current['params'])}; build it with the same parameters"
            )
        try:
            self._check_hyperparameters(saved)
        except (TypeError, ValueError) as error:
            raise ValueError(f"param group {index} of the loaded state dict: {error}") from error
        return check_step_count(f"param group {index}", saved[STEP_KEY])

    def _check_loaded_state(
        self, index: int, param: Tensor, saved_state: Any, group: dict[str, Any], group_step: float
    ) -> None:
        where = f"state of parameter {index} (shape {tuple(param.shape)}, {param.dtype})"
        if not isinstance(saved_state, dict):
            raise ValueError(f"the loaded {where} must be a dict, got {type(saved_state).__name__}")
        # Moments are all there or, for a parameter that never took a step, all absent.
        moments = set(self._state_keys(group))
        expected = {MASTER_KEY} if self._master_expected(param, group) else set()
        if _loads_into_param(param, group, saved_state):
            expected.add(MASTER_KEY)
        # The step offset comes with the moments; a checkpoint saved before offsets existed has none.
        optional = set()
        if moments & set(saved_state):
            expected |= moments
            optional.add(STEP_OFFSET_KEY)
        missing = sorted(expected - set(saved_state))
        unexpected = sorted(set(saved_state) - expected - optional)
        if missing or unexpected:
            raise ValueError(
                f"the loaded {where} has keys {sorted(saved_state)} but {type(self).__name__} expects "
                f"{sorted(expected)} (missing {missing}, unexpected {unexpected}); was it saved by another "
                "optimizer, another opt level or other hyperparameters (master_weights, momentum)?"
            )
        for key in sorted(expected):
            value = saved_state[key]
            if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.shape != param.shape:
                got = (
                    f"{value.dtype} tensor of shape {tuple(value.shape)}"
                    if isinstance(value, Tensor)
                    else type(value).__name__
                )
                raise ValueError(
                    f"the loaded {where}: '{key}' must be a float32 tensor of shape {tuple(param.shape)}, "
                    f"got {got}; the checkpoint belongs to a different model"
                )
        if STEP_OFFSET_KEY in saved_state:
            offset = check_step_count(f"the loaded {where}", saved_state[STEP_OFFSET_KEY], STEP_OFFSET_KEY)
            if offset > group_step:
                raise ValueError(
                    f"the loaded {where}: '{STEP_OFFSET_KEY}' ({offset:g}) exceeds its param group's "
                    f"'{STEP_KEY}' ({group_step:g}); the parameter would have taken a negative number of "
                    "steps, so the checkpoint is corrupt"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``state_dict()``; everything is checked before anything changes.

        Refused with a ValueError (the optimizer left as it was): a different number of param
        groups or of params in a group, a state tensor of the wrong shape or dtype, missing or
        unexpected state (another optimizer type, master_weights or momentum setting). Loaded
        tensors are copied into the parameters' device and memory layout; the hyperparameters
        come from the state dict, as in torch.optim.

        Example:
            >>> import io, torch
            >>> from amp_fx.optim import FusedAdam
            >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
            >>> opt = FusedAdam([w]); buffer = io.BytesIO(); torch.save(opt.state_dict(), buffer)
            >>> _ = buffer.seek(0); opt.load_state_dict(torch.load(buffer, weights_only=True))
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict from {type(self).__name__}.state_dict()")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(
                "the state dict needs 'state' and 'param_groups' entries (from optimizer.state_dict())"
            )
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the loaded state dict has {len(saved_groups)} param groups but this optimizer has "
                f"{len(self.param_groups)}; build the optimizer with the same param groups"
            )
        group_steps = [
            self._check_loaded_group(index, saved, current)
            for index, (saved, current) in enumerate(zip(saved_groups, self.param_groups, strict=True))
        ]
        position = 0
        for saved, current, group_step in zip(saved_groups, self.param_groups, group_steps, strict=True):
            for saved_id, param in zip(saved["params"], current["params"], strict=True):
                if saved_id not in saved_state:
                    raise ValueError(
                        f"the loaded state dict has no state for parameter {position} (id {saved_id})"
                    )
                self._check_loaded_state(position, param, saved_state[saved_id], saved, group_step)
                position += 1

        # Everything checked: build the new state as copies (never aliasing the given dict).
        new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        new_groups = []
        with torch.no_grad():
            for saved, current in zip(saved_groups, self.param_groups, strict=True):
                group = {k: v for k, v in saved.items() if k not in ("params", STEP_KEY)}
                group["params"] = current["params"]
                if "param_names" in current and "param_names" not in saved:
                    group["param_names"] = current["param_names"]
                step_device = current[STEP_KEY].device
                group[STEP_KEY] = (
                    torch.as_tensor(saved[STEP_KEY]).to(step_device, torch.float32).reshape(1).clone()
                )
                new_groups.append(group)
                for saved_id, param in zip(saved["params"], current["params"], strict=True):
                    into_param = _loads_into_param(param, saved, saved_state[saved_id])
                    for key, value in saved_state[saved_id].items():
                        if into_param and key == MASTER_KEY:
                            param.copy_(value)
                            continue
                        if key == STEP_OFFSET_KEY:
                            offset = torch.as_tensor(value).to(step_device, torch.float32).reshape(())
                            new_state[param][key] = offset.clone()
                            continue
                        local = torch.empty_like(
                            param, dtype=torch.float32, memory_format=torch.preserve_format
                        )
                        new_state[param][key] = local.copy_(value)
        # Also gives a checkpoint saved before per-parameter counts its step offsets.
        self.__setstate__({"state": new_state, "param_groups": new_groups})
        self._reset_pending()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
