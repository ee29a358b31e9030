"""What a fused optimizer's param group may hold, checked before anything is created.

Its ``params`` are an ordered collection (or one tensor) of dense fp16, bf16 or fp32 tensors on one
device, each listed once (one kernel launch updates them all, and one step counter on that device
counts their steps); its hyperparameters are Python numbers (a tensor would need a host sync to
read). Each refusal names the fix.

    >>> import torch
    >>> check_params("FusedSGD", [torch.zeros(2, dtype=torch.float64)])
    Traceback (most recent call last):
    ...
    ValueError: FusedSGD updates fp16, bf16 and fp32 parameters; parameter 0 has dtype torch.float64. ...
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor

from amp_fx.kernels.arguments import KERNEL_DTYPES, is_dense

__all__ = ["as_float", "check_params", "group_with_param_list", "param_tensors"]


def as_float(name: str, value: Any) -> float:
    """``value`` as a float, where it is a finite Python number (not a bool, not a tensor).

    >>> as_float("lr", 1)
    1.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(
            f"{name} must be a finite Python float, got {value!r}; the fused kernels take hyperparameters "
            "as Python numbers (a tensor would need a host sync to read)"
        )
    return float(value)


def group_with_param_list(param_group: Any) -> dict[str, Any]:
    """A copy of ``param_group`` whose ``params`` is a list, as torch.optim takes them (one tensor
    alone, or an ordered collection, not a set).

    >>> import torch
    >>> group_with_param_list({"params": torch.zeros(1), "lr": 0.1})["params"]
    [tensor([0.])]
    """
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    param_group = dict(param_group)
    params = param_group.get("params")
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, not a set")
    elif params is None:
        raise ValueError("param_group has no 'params' entry; pass {'params': [...], ...}")
    param_group["params"] = list(params)
    return param_group


def param_tensors(params: Iterable[Any]) -> list[Tensor]:
    """The tensors of a param list that may hold (name, tensor) pairs, as torch.optim allows.

    >>> import torch
    >>> param_tensors([("w", torch.zeros(1))])
    [tensor([0.])]
    """
    return [p[1] if isinstance(p, tuple) else p for p in params]


def check_params(optimizer_name: str, params: Sequence[Tensor]) -> None:
    """Raise TypeError/ValueError, naming the fix, where ``params`` (one param group of the
    optimizer ``optimizer_name``) are not dense fp16/bf16/fp32 tensors on one device, each once."""
    name = optimizer_name
    for i, param in enumerate(params):
        if not isinstance(param, Tensor):
            raise TypeError(f"{name} can only optimize tensors, but parameter {i} is {type(param).__name__}")
        if param.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"{name} updates fp16, bf16 and fp32 parameters; parameter {i} has dtype {param.dtype}. "
                "Keep it out of this optimizer or convert it with .float()"
            )
        if param.is_sparse or not is_dense(param):
            raise ValueError(
                f"{name} needs dense parameters; parameter {i} (shape {tuple(param.shape)}, strides "
                f"{param.stride()}) is not. Make it contiguous before creating the optimizer"
            )
    first_index: dict[int, int] = {}
    for i, param in enumerate(params):
        earlier = first_index.setdefault(id(param), i)
        if earlier != i:
            # torch.optim only warns; here two programs of one launch would update the same
            # elements at once and one update would be lost.
            raise ValueError(
                f"parameter {i} of a param group of {name} is parameter {earlier} again; the fused "
                "step would update it twice at once. List each parameter once"
            )
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"a param group of {name} holds parameters on several devices ({sorted(map(str, devices))}); "
            "its step counter lives on one device, so put each device's parameters in their own group"
        )
