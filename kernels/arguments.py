"""The argument checks every kernel family shares (dtypes, dense layouts, one-element tensors,
ranges) and the optimizer updates' (``check_update``); each family's own checks are in its
``arguments`` module (``amp_fx.kernels.<family>.arguments``).

Both implementations of a kernel take the same arguments and must refuse the same bad input with
the same message, before anything is written; the optimizers, the loss scaler and the ops call the
same checks to refuse bad configuration up front. The checks run on the host and read only
metadata (dtype, shape, strides, device) and Python numbers, never tensor values, so they never
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

# The dtypes every kernel reads and writes (parameters, gradients, activations, logits): the ops
# and passes fuse only these.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT32_MAX = 2**31 - 1


# Layouts, dtypes and one-element tensors, and the optimizer updates' shared arguments.


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


def check_dtype(subject: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> None:
    """Raise ValueError ``"<subject> dtype <dtype>; supported dtypes are ..."`` unless dtype is allowed."""
    if dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{subject} dtype {dtype}; supported dtypes are {names}")


def check_scalar_tensor(name: str, value: Tensor | None, device: torch.device) -> None:
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


def check_tensor_list(
    name: str, tensors: Sequence[Tensor], allowed_dtypes: tuple[torch.dtype, ...], check_dense: bool = True
) -> None:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(tensor).__name__}")
        if tensor.dtype not in allowed_dtypes:  # checked inline: every step runs this per tensor
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
    check_tensor_list("params", params, KERNEL_DTYPES)
    check_tensor_list("grads", grads, KERNEL_DTYPES, check_dense=False)
    if len(grads) != len(params):
        raise ValueError(f"got {len(params)} params but {len(grads)} grads; pass one grad per param")
    matched = {"grads": grads}
    if masters is not None:
        if len(masters) != len(params):
            raise ValueError(
                f"got {len(params)} params but {len(masters)} masters; pass one per param (or None)"
            )
        check_tensor_list(
            "masters", [m for m in masters if m is not None], (torch.float32,), check_dense=False
        )
        matched["masters"] = masters
    for name, tensors in states.items():
        if tensors is None:
            continue
        check_tensor_list(name, tensors, (torch.float32,), check_dense=False)
        if len(tensors) != len(params):
            raise ValueError(f"got {len(params)} params but {len(tensors)} {name}; pass one per param")
        matched[name] = tensors
    # One list comparison per name (the error path finds the index).
    layouts = [(param.shape, param.stride(), param.device) for param in params]
    for name, tensors in matched.items():
        theirs = [
            layout if tensor is None else (tensor.shape, tensor.stride(), tensor.device)
            for tensor, layout in zip(tensors, layouts, strict=True)
        ]
        if theirs != layouts:
            i = next(i for i, layout in enumerate(layouts) if theirs[i] != layout)
            _raise_mismatch(name, i, tensors[i], params[i])
    device = params[0].device if params else step.device
    for name, value in (("step", step), ("grad_multiplier", grad_multiplier), ("found_inf", found_inf)):
        check_scalar_tensor(name, value, device)
    if step_offsets is not None:
        if not isinstance(step_offsets, (list, tuple)) or len(step_offsets) != len(params):
            raise ValueError(
                f"step_offsets must be a list with one float32 tensor of one element per param "
                f"({len(params)}), or None; got {type(step_offsets).__name__}"
            )
        for i, offset in enumerate(step_offsets):
            check_scalar_tensor(f"step_offsets[{i}]", offset, device)
    for name, value in hyperparameters.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite Python float, got {value!r}")


def check_range(name: str, value: float, low: float, high: float, high_inclusive: bool = False) -> None:
    """Raise ValueError unless low <= value < high (or <= high when high_inclusive)."""
    ok = low <= value <= high if high_inclusive else low <= value < high
    if not ok:
        bracket = "]" if high_inclusive else ")"
        raise ValueError(f"invalid {name}: {value} (expected a value in [{low}, {high}{bracket})")
