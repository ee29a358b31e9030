"""The references a converted model is measured against: `with_autocast` (what O1 must match bit
for bit, and whose error against FP32 O2's may not exceed by much), `low_precision_copy` (Apex's
O3, ``model.half()``), and `reference_for`, which picks one for a converted model.

autocast lists no grouped matrix product (``aten._grouped_mm``, the experts of a
mixture-of-experts layer), so it runs a model's experts in FP32, while O2 runs them low as MoE
training stacks do. O2's reference for them is autocast with those ops also run in the low dtype
(``lowered_ops``, `running_low`): the experts computed in bf16/fp16 the way O2 computes them, with
everything else as autocast runs it.

    >>> import amp_fx
    >>> model = torch.nn.Linear(4, 2)
    >>> o3 = amp_fx.convert(model, "O3", dtype=torch.bfloat16, device_type="cpu")
    >>> reference_for(model, o3, torch.bfloat16)[1]
    'the model cast to torch.bfloat16 (O3)'
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

import amp_fx
from amp_fx.capture.state import attached_state
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.core.node_info import POLICY_KEY
from amp_fx.core.op_lists import UNLISTED_MATMUL_OPS, autocast_op_lists
from amp_fx.core.policy import Policy, Rule, preset

__all__ = [
    "conversion_policy",
    "infer_dtype",
    "low_precision_copy",
    "lowered_unlisted_ops",
    "reference_for",
    "running_low",
    "with_autocast",
]

# The dispatch key of autocast's kernels, per device type `running_low` supports.
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


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


def lowered_unlisted_ops(policy: Policy | None) -> tuple[str, ...]:
    """The matrix products on no autocast list (`UNLISTED_MATMUL_OPS`) that ``policy`` runs low:
    what the reference of a conversion with ``policy`` runs low too (none for O1, or for no policy).

    >>> lowered_unlisted_ops(preset("O2", torch.bfloat16, "cpu"))
    ('_grouped_mm',)
    >>> lowered_unlisted_ops(preset("O2", torch.bfloat16, "cpu").set_op("_grouped_mm", "fp32"))
    ()
    """
    if policy is None:
        return ()
    return tuple(sorted(op for op in UNLISTED_MATMUL_OPS if policy.decide(op).rule is Rule.LOWER))


def _check_lowered_ops(ops: tuple[str, ...], device_type: str) -> None:
    if device_type not in _AUTOCAST_KEYS:
        raise ValueError(
            f"lowered_ops runs ops low under torch.autocast on {sorted(_AUTOCAST_KEYS)}, not "
            f"{device_type!r}; pass lowered_ops=() for a plain autocast reference"
        )
    listed = autocast_op_lists(device_type).all_ops()
    for op in ops:
        if not isinstance(op, str) or not hasattr(torch.ops.aten, op) or op in listed:
            raise ValueError(
                f"lowered_ops names ATen ops on no autocast {device_type} list (such as "
                f"'_grouped_mm'), got {op!r}; autocast already decides the listed ones"
            )


@contextlib.contextmanager
def running_low(ops: tuple[str, ...], device_type: str) -> Iterator[None]:
    """While inside, ``torch.autocast(device_type)`` also runs the ATen ``ops`` (on no autocast
    list) in its low dtype: their FP32 floating inputs are cast down, as autocast casts a listed
    op's, so autograd records the casts; the kernels keep their own accumulation (FP32 for
    ``_grouped_mm``). Outside autocast, and after the block, the ops run as before.

        >>> x, w = torch.randn(4, 8), torch.randn(2, 8, 16)
        >>> offs = torch.tensor([2, 4], dtype=torch.int32)
        >>> with running_low(("_grouped_mm",), "cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
        ...     torch._grouped_mm(x, w, offs).dtype
        torch.bfloat16
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     torch._grouped_mm(x, w, offs).dtype
        torch.float32
    """
    _check_lowered_ops(ops, device_type)
    if not ops:
        yield
        return
    library = torch.library.Library("aten", "IMPL")  # noqa: TOR901  (removed again below)

    def cast(value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
            return value.to(dtype)
        return value

    def lowering(op: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            dtype = torch.get_autocast_dtype(device_type)
            args, kwargs = pytree.tree_map(lambda v: cast(v, dtype), (args, kwargs))
            with torch.autocast(device_type, enabled=False):  # below autocast: the op's own kernel
                return op(*args, **kwargs)

        return kernel

    try:
        for name in ops:
            library.impl(name, lowering(getattr(torch.ops.aten, name).default), _AUTOCAST_KEYS[device_type])
        yield
    finally:
        library._destroy()


def with_autocast(
    model: torch.nn.Module, device_type: str, dtype: torch.dtype, lowered_ops: tuple[str, ...] = ()
) -> torch.nn.Module:
    """A deep copy of ``model`` whose forward runs under ``torch.autocast(device_type, dtype)``.

    Parameter names are the model's own, so it is a reference for `assert_equivalent`: an O1
    conversion on CPU must match it bit for bit. ``lowered_ops`` (ATen ops on no autocast list,
    such as ``"_grouped_mm"``) also run in ``dtype`` (`running_low`): O2's reference for the
    experts of a mixture-of-experts layer.

        >>> reference = with_autocast(torch.nn.Linear(4, 2), "cpu", torch.bfloat16)
        >>> reference(torch.randn(3, 4)).dtype
        torch.bfloat16
    """
    lowered_ops = tuple(lowered_ops)
    _check_lowered_ops(lowered_ops, device_type)
    copied = copy.deepcopy(model)
    forward = copied.forward

    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with running_low(lowered_ops, device_type), torch.autocast(device_type, dtype=dtype):
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
    original: torch.nn.Module, converted: Any, dtype: torch.dtype, lowered_ops: tuple[str, ...] | None = None
) -> tuple[torch.nn.Module, str]:
    """The reference whose error against FP32 ``converted``'s is measured by, and its description.

    - ``dtype`` float32 (O0, or a model that computes in FP32): the original itself.
    - O3 (a policy that stores weights low and keeps no FP32 islands): `low_precision_copy`,
      Apex's ``model.half()``.
    - Otherwise (O1, O2, a model of unknown origin): `with_autocast` on the device type of the
      policy (else of the original's parameters). Where the policy's op lists are another device's
      than the model's (CUDA's lists checked on a CPU, where ``torch.autocast("cuda")`` does
      nothing), amp_fx's O1 with those lists stands in: on CPU it matches torch.autocast bit for bit.
      ``lowered_ops`` (default: `lowered_unlisted_ops` of the policy, so ``("_grouped_mm",)`` for
      O2, none for O1) run in ``dtype`` too: O2's mixture-of-experts experts are judged against
      experts run low the same way. ``lowered_ops=()`` measures against plain autocast.

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
    lowered_ops = lowered_unlisted_ops(policy) if lowered_ops is None else tuple(lowered_ops)
    low = f" with {', '.join(lowered_ops)} in {dtype}" if lowered_ops else ""
    if device_type != device:
        o1_policy = preset("O1", dtype, device_type)
        for op in lowered_ops:
            o1_policy.set_op(op, Rule.LOWER)
        o1 = amp_fx.convert(original, policy=o1_policy, device_type=device_type)
        return o1, f"autocast's {device_type} op lists ({dtype}){low} applied by amp_fx O1 on {device}"
    reference = with_autocast(original, device_type, dtype, lowered_ops)
    return reference, f"torch.autocast({device_type}, {dtype}){low}"
