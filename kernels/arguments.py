"""Every argument check of the kernels, shared by the pure-torch reference and the Triton kernels.

Both implementations take the same arguments and must refuse the same bad input with the same
message, before anything is written; the optimizers, the loss scaler and the ops call the same
checks to refuse bad configuration up front. The checks run on the host and read only metadata
(dtype, shape, strides, device) and Python numbers, never tensor values, so they never
synchronize with the device. A few checks are the Triton kernels' own (layouts and index widths
they need, named ``check_triton_...``); the reference accepts more.

The layout rule: for each parameter ``i``, ``params[i]``, ``grads[i]``, ``masters[i]`` and its
optimizer states have the same shape and strides and are dense (no gaps, no overlap), so an
update can walk all of them in storage order, element ``k`` of one matching element ``k`` of the
others. Contiguous and channels-last tensors both qualify; ``torch.zeros_like(p)`` and
``p.detach().clone().float()`` produce matching states.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT32_MAX = 2**31 - 1


# Optimizer updates (check_finite_and_norm_, adam_step_, sgd_step_) and their hyperparameters.


def is_dense(tensor: Tensor) -> bool:
    """True when the tensor's elements fill one gap-free, non-overlapping span of its storage."""
    if tensor.is_contiguous():
        return True
    expected_stride = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n != 1):
        if stride != expected_stride:
            return False
        expected_stride *= size
    return True


def byte_ranges_overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the bytes spanned by ``a`` and by ``b`` (first to last element) intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a_start, a_end), (b_start, b_end) = span(a), span(b)
    return a_start < b_end and b_start < a_end


def check_dtype(subject: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...] = PARAM_DTYPES) -> None:
    """Raise ValueError ``"<subject> dtype <dtype>; supported dtypes are ..."`` unless dtype is allowed."""
    if dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{subject} dtype {dtype}; supported dtypes are {names}")


def _check_scalar_tensor(name: str, value: Tensor | None, device: torch.device) -> None:
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a float32 tensor of one element, got {type(value).__name__}")
    if value.dtype != torch.float32 or value.numel() != 1:
        raise ValueError(
            f"{name} must be a float32 tensor of one element, got dtype {value.dtype} with "
            f"{value.numel()} elements; create it with torch.zeros(1, dtype=torch.float32, device=...)"
        )
    if value.device != device:
        raise ValueError(
            f"{name} is on {value.device} but the tensors are on {device}; move it with .to({device})"
        )


def _check_tensor_list(
    name: str, tensors: Sequence[Tensor], allowed_dtypes: tuple[torch.dtype, ...], check_dense: bool = True
) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(tensor).__name__}")
        check_dtype(f"{name}[{i}] has", tensor.dtype, allowed_dtypes)
        if check_dense and not is_dense(tensor):
            raise ValueError(
                f"{name}[{i}] is not dense (strides {tensor.stride()} for shape {tuple(tensor.shape)}); "
                "pass a contiguous tensor (.contiguous())"
            )


def _raise_mismatch(name: str, i: int, tensor: Tensor, param: Tensor) -> None:
    if tensor.device != param.device:
        raise ValueError(f"{name}[{i}] is on {tensor.device} but params[{i}] is on {param.device}")
    raise ValueError(
        f"{name}[{i}] has shape {tuple(tensor.shape)} and strides {tensor.stride()} but params[{i}] has "
        f"shape {tuple(param.shape)} and strides {param.stride()}; "
        "create it with torch.zeros_like(param) or param.detach().clone()"
    )


def check_grads(
    grads: Sequence[Tensor], found_inf: Tensor, grad_multiplier: Tensor | None, sq_norm_out: Tensor | None
) -> None:
    """Validate the arguments of ``check_finite_and_norm_``; raise TypeError/ValueError."""
    _check_tensor_list("grads", grads, PARAM_DTYPES)
    if not isinstance(found_inf, Tensor):
        raise TypeError("found_inf must be a float32 tensor of one element")
    device = found_inf.device
    for name, value in (
        ("found_inf", found_inf),
        ("grad_multiplier", grad_multiplier),
        ("sq_norm_out", sq_norm_out),
    ):
        _check_scalar_tensor(name, value, device)
    for i, grad in enumerate(grads):
        if grad.device != device:
            raise ValueError(
                f"grads[{i}] is on {grad.device} but found_inf is on {device}; keep them on one device"
            )


def check_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    states: dict[str, Sequence[Tensor] | None],
    step: Tensor,
    grad_multiplier: Tensor | None,
    found_inf: Tensor | None,
    hyperparameters: dict[str, float],
    step_offsets: Sequence[Tensor] | None = None,
) -> None:
    """Validate the arguments of an optimizer update (``adam_step_``, ``sgd_step_``).

    ``masters`` may be None (every param is its own master) or a list whose entries are float32
    tensors or None (that param is updated in place, in its own dtype, with fp32 arithmetic).
    ``states`` maps a name (``"exp_avgs"``) to a list of float32 tensors, or None when unused.
    ``step_offsets`` (None: all 0) holds one float32 tensor of one element per param.
    """
    if step is None:
        raise TypeError("step must be a float32 tensor of one element (steps already taken)")
    # Only the params are checked for density: every other tensor must have its param's shape and
    # strides, hence its layout. This runs every step, so it reads each tensor's metadata once.
    _check_tensor_list("params", params, PARAM_DTYPES)
    _check_tensor_list("grads", grads, PARAM_DTYPES, check_dense=False)
    if len(grads) != len(params):
        raise ValueError(f"got {len(params)} params but {len(grads)} grads; pass one grad per param")
    matched = {"grads": grads}
    if masters is not None:
        if len(masters) != len(params):
            raise ValueError(
                f"got {len(params)} params but {len(masters)} masters; pass one per param (or None)"
            )
        _check_tensor_list(
            "masters", [m for m in masters if m is not None], (torch.float32,), check_dense=False
        )
        matched["masters"] = masters
    for name, tensors in states.items():
        if tensors is None:
            continue
        _check_tensor_list(name, tensors, (torch.float32,), check_dense=False)
        if len(tensors) != len(params):
            raise ValueError(f"got {len(params)} params but {len(tensors)} {name}; pass one per param")
        matched[name] = tensors
    for i, param in enumerate(params):
        layout = (param.shape, param.stride(), param.device)
        for name, tensors in matched.items():
            tensor = tensors[i]
            if tensor is not None and (tensor.shape, tensor.stride(), tensor.device) != layout:
                _raise_mismatch(name, i, tensor, param)
    device = params[0].device if params else step.device
    for name, value in (("step", step), ("grad_multiplier", grad_multiplier), ("found_inf", found_inf)):
        _check_scalar_tensor(name, value, device)
    if step_offsets is not None:
        if not isinstance(step_offsets, (list, tuple)) or len(step_offsets) != len(params):
            raise ValueError(
                f"step_offsets must be a list with one float32 tensor of one element per param "
                f"({len(params)}), or None; got {type(step_offsets).__name__}"
            )
        for i, offset in enumerate(step_offsets):
            _check_scalar_tensor(f"step_offsets[{i}]", offset, device)
    for name, value in hyperparameters.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite Python float, got {value!r}")


def check_range(name: str, value: float, low: float, high: float, high_inclusive: bool = False) -> None:
    """Raise ValueError unless low <= value < high (or <= high when high_inclusive)."""
    ok = low <= value <= high if high_inclusive else low <= value < high
    if not ok:
        bracket = "]" if high_inclusive else ")"
        raise ValueError(f"invalid {name}: {value} (expected a value in [{low}, {high}{bracket})")


def log_beta(beta: float) -> float:
    """ln(beta), with beta = 0 mapped to -inf so that 1 - beta**t = -expm1(t * ln(beta)) = 1."""
    return math.log(beta) if beta > 0 else -math.inf


def check_adam_hyperparameters(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float
) -> None:
    """Raise ValueError for hyperparameters torch.optim.Adam would refuse."""
    check_range("lr", lr, 0.0, float("inf"))
    check_range("beta1", beta1, 0.0, 1.0)
    check_range("beta2", beta2, 0.0, 1.0)
    check_range("eps", eps, 0.0, float("inf"))
    check_range("weight_decay", weight_decay, 0.0, float("inf"))


def check_sgd_hyperparameters(
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    momentum_buffers: Sequence[Tensor] | None,
) -> None:
    """Raise ValueError for hyperparameters torch.optim.SGD would refuse, or missing momentum buffers."""
    check_range("lr", lr, 0.0, float("inf"))
    check_range("momentum", momentum, 0.0, float("inf"))
    check_range("weight_decay", weight_decay, 0.0, float("inf"))
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov momentum requires momentum > 0 and dampening == 0")
    if momentum != 0.0 and momentum_buffers is None:
        raise ValueError(
            "momentum != 0 needs momentum_buffers (fp32, torch.zeros_like(param, dtype=torch.float32))"
        )


# Loss scale (update_loss_scale_, LossScaler).

# The scale and its bounds are float32: a bound is compared after rounding to float32 (as
# torch.clamp does), so a bound beyond float32's range has no float32 value to round to.
FLOAT32_MAX = torch.finfo(torch.float32).max


def check_scale_bound(name: str, value: float | None) -> None:
    """Raise ValueError for a min/max scale that is not None nor a positive float32-representable number."""
    if value is not None and not 0.0 < value <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be None or in (0, {FLOAT32_MAX:.4e}] (the scale is a float32 tensor), got {value}"
        )


def check_tracker_count(name: str, value: int, low: int) -> None:
    """Raise ValueError for a tracker count (or its limit) that is not an int in [low, 2**31 - 1]:
    the growth and hysteresis trackers are int32 tensors, so the counts they hold or count to must
    fit in one."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT32_MAX:
        raise ValueError(
            f"{name} must be an int in [{low}, 2**31 - 1] (the trackers are int32), got {value!r}"
        )


def check_loss_scale_arguments(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_infs: Sequence[Tensor],
    inv_scale_out: Tensor | None,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
) -> None:
    """Validate the arguments of ``update_loss_scale_`` (metadata and Python numbers only, no host sync)."""
    if not isinstance(scale, Tensor):
        raise TypeError(f"scale must be a float32 tensor of one element, got {type(scale).__name__}")
    device = scale.device
    state = [("scale", scale, torch.float32), ("inv_scale_out", inv_scale_out, torch.float32)]
    state += [
        ("growth_tracker", growth_tracker, torch.int32),
        ("hysteresis_tracker", hysteresis_tracker, torch.int32),
    ]
    if not isinstance(found_infs, (list, tuple)) or len(found_infs) == 0:
        raise TypeError(
            "found_infs must be a non-empty list of float32 one-element tensors (the overflow flags)"
        )
    state += [(f"found_infs[{i}]", f, torch.float32) for i, f in enumerate(found_infs)]
    for name, tensor, dtype in state:
        if tensor is None and name == "inv_scale_out":
            continue
        if not isinstance(tensor, Tensor) or tensor.dtype != dtype or tensor.numel() != 1:
            got = f"{tensor.dtype} with {tensor.numel()} elements" if isinstance(tensor, Tensor) else tensor
            raise ValueError(f"{name} must be a {dtype} tensor of one element, got {got}")
        if tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device} but scale is on {device}; move it with .to({device})"
            )
    for name, value in (("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a Python float, got {value!r}")
    check_range("growth_factor", growth_factor, 1.0, float("inf"))
    check_range("backoff_factor", backoff_factor, 0.0, 1.0)
    check_tracker_count("growth_interval", growth_interval, 1)
    check_tracker_count("hysteresis", hysteresis, 1)
    check_scale_bound("min_scale", min_scale)
    check_scale_bound("max_scale", max_scale)
