"""The references a converted model is measured against: `with_autocast` (what O1 must match bit
for bit, and whose error against FP32 O2's may not exceed by much), `low_precision_copy` (Apex's
O3, ``model.half()``), and `reference_for`, which picks one for a converted model.

    >>> import amp_fx
    >>> model = torch.nn.Linear(4, 2)
    >>> o3 = amp_fx.convert(model, "O3", dtype=torch.bfloat16, device_type="cpu")
    >>> reference_for(model, o3, torch.bfloat16)[1]
    'the model cast to torch.bfloat16 (O3)'
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

import amp_fx
from amp_fx.capture.state import attached_state
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.node_info import POLICY_KEY
from amp_fx.core.policy import Policy

__all__ = ["conversion_policy", "infer_dtype", "low_precision_copy", "reference_for", "with_autocast"]


def conversion_policy(converted: Any) -> Policy | None:
    """The policy ``converted`` was made with by `amp_fx.convert` (either front end), else None.

    >>> conversion_policy(torch.nn.Linear(2, 2)) is None
    True
    """
    if isinstance(converted, torch.fx.GraphModule):
        return converted.meta.get(POLICY_KEY)
    if isinstance(converted, torch.nn.Module):
        state = attached_state(converted)
        return None if state is None else state.policy
    return None


def infer_dtype(converted: torch.nn.Module) -> torch.dtype:
    """The precision a converted model computes in: the policy's dtype (FP32 for O0), else the
    lowest-precision floating dtype among its parameters and buffers, else torch.float32.

    >>> infer_dtype(torch.nn.Linear(2, 2).half())
    torch.float16
    """
    policy = conversion_policy(converted)
    if policy is not None:
        return policy.dtype if policy.level.lowers_precision else torch.float32
    for tensor in [*converted.parameters(), *converted.buffers()]:
        if tensor.dtype in LOW_PRECISION_DTYPES:
            return tensor.dtype
    return torch.float32


def with_autocast(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of ``model`` whose forward runs under ``torch.autocast(device_type, dtype)``.

    Parameter names are the model's own, so it is a reference for `assert_equivalent`: an O1
    conversion on CPU must match it bit for bit.

        >>> reference = with_autocast(torch.nn.Linear(4, 2), "cpu", torch.bfloat16)
        >>> reference(torch.randn(3, 4)).dtype
        torch.bfloat16
    """
    copied = copy.deepcopy(model)
    forward = copied.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    copied.forward = autocast_forward
    return copied


def low_precision_copy(
    model: torch.nn.Module, dtype: torch.dtype, output_dtype: torch.dtype | None = torch.float32
) -> torch.nn.Module:
    """A deep copy of ``model`` in pure ``dtype``: parameters, buffers and floating inputs cast.

    Floating outputs are cast to ``output_dtype`` (None: left in ``dtype``). This is Apex's O3
    (``model.half()``), so an O3 conversion must match it bit for bit; parameter names are the
    model's own, for `assert_equivalent`.

        >>> low = low_precision_copy(torch.nn.Linear(4, 2), torch.float16)
        >>> low.weight.dtype, low(torch.randn(3, 4)).dtype
        (torch.float16, torch.float32)
    """
    copied = copy.deepcopy(model).to(dtype)
    forward = copied.forward

    def cast(value: Any, to: torch.dtype | None) -> Any:
        if to is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(to)
        return value

    def low_precision_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map(lambda v: cast(v, dtype), (args, kwargs))
        return pytree.tree_map(lambda v: cast(v, output_dtype), forward(*args, **kwargs))

    copied.forward = low_precision_forward
    return copied


def reference_for(
    original: torch.nn.Module, converted: Any, dtype: torch.dtype
) -> tuple[torch.nn.Module, str]:
    """The reference whose error against FP32 ``converted``'s is measured by, and its description.

    - ``dtype`` float32 (O0, or a model that computes in FP32): the original itself.
    - O3 (a policy that stores weights low and keeps no FP32 islands): `low_precision_copy`,
      Apex's ``model.half()``.
    - Otherwise (O1, O2, a model of unknown origin): `with_autocast` on the device type of the
      policy (else of the original's parameters). Where the policy's op lists are another device's
      than the model's (CUDA's lists checked on a CPU, where ``torch.autocast("cuda")`` does
      nothing), amp_fx's O1 with those lists stands in: on CPU it matches torch.autocast bit for bit.

    >>> reference_for(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).half(), torch.float16)[1]
    'torch.autocast(cpu, torch.float16)'
    """
    if dtype == torch.float32:
        return original, "the FP32 original"
    policy = conversion_policy(converted)
    if policy is not None and policy.level.stores_weights_low and not policy.level.keeps_fp32_islands:
        return low_precision_copy(original, dtype), f"the model cast to {dtype} ({policy.opt_level})"
    device = next((t.device.type for t in [*original.parameters(), *original.buffers()]), "cpu")
    device_type = policy.device_type if policy is not None and policy.device_type else device
    if device_type != device:
        o1 = amp_fx.convert(original, "O1", dtype=dtype, device_type=device_type)
        return o1, f"autocast's {device_type} op lists ({dtype}) applied by amp_fx O1 on {device}"
    return with_autocast(original, device_type, dtype), f"torch.autocast({device_type}, {dtype})"
