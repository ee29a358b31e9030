"""Pure-torch reference for the fused optimizer kernels: the same math as the Triton kernels.

This module is the definition of what the kernels compute, and what the optimizers run on a machine
without CUDA. Every function has the same signature and semantics as its Triton twin in
``amp_fx.kernels.triton_ops``; none of them reads a tensor value on the host (no ``.item()``, no
``if tensor``), so a training step built on them never synchronizes with the device.

The skip rule: when ``found_inf`` is given and > 0, nothing is written. Here that is done with
``torch.where(skip, old, new)`` per tensor, so skipped tensors keep their exact bits; the Triton
kernels do the same by not storing at all.

Adam (torch.optim.Adam / AdamW), for each element, in fp32, with t = step + 1::

    g  = grad * grad_multiplier                      (grad_multiplier = 1 / loss_scale ...)
    g += weight_decay * w                            (L2, adam_w_mode=False)
    w *= 1 - lr * weight_decay                       (decoupled, adam_w_mode=True)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    w -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    param = w.to(param.dtype)                        (round to nearest)

where w is the fp32 master (or the param itself when it has no master). ``1 - beta**t`` is computed
as ``-expm1(t * ln(beta))``, accurate in fp32 even when beta is close to 1 and t is small.

SGD (torch.optim.SGD)::

    g  = grad * grad_multiplier + weight_decay * w
    buf = g                                          (first step, step == 0)
    buf = momentum * buf + (1 - dampening) * g       (later steps)
    g  = g + momentum * buf if nesterov else buf     (when momentum != 0)
    w -= lr * g

Cross-entropy over rows (``cross_entropy_forward`` / ``cross_entropy_backward``; the Triton twins
are in ``amp_fx.kernels.cross_entropy``). For logits x (N, C) in fp16, bf16 or fp32 and int64 class
indices t (N,), in fp32::

    lse_i  = logsumexp(x_i)                              (returned, and saved for the backward)
    loss_i = lse_i - x_i,t_i                             (0 where t_i == ignore_index)
    dx_ij  = g_i * exp(x_ij - lse_i) - g_i * [j == t_i]  (0 where t_i == ignore_index)
    dx     = dx.to(x.dtype)                              (rounded once)

A target outside [0, C) that is not ``ignore_index`` gives that row a NaN loss and NaN gradients
(torch raises instead, which would need a host synchronization).

``cross_entropy_forward_with_grad`` fuses the two for an upstream gradient of 1: it returns the
losses and writes ``dx`` with g_i = 1 (``softmax(x_i) - onehot(t_i)``, unscaled) over the logits,
for `amp_fx.ops.losses.linear_cross_entropy`, whose backward applies the real g_i after its matmuls.

Training-mode BatchNorm + residual add + ReLU (``batch_norm_act_forward`` /
``batch_norm_act_backward``; the Triton twins are in ``amp_fx.kernels.batch_norm``). For an input
x (N, C, ...) in fp16, bf16 or fp32, statistics per channel c over the M = N * H * W values of that
channel, in fp32; w = 1 and b = 0 when weight / bias are None::

    mean_c   = sum(x) / M                  var_c = sum((x - mean_c)^2) / M     (biased)
    invstd_c = 1 / sqrt(var_c + eps)       scale_c = w_c * invstd_c
    y        = (x - mean_c) * scale_c + b_c (+ residual)                       (fp32)
    out      = relu(y).to(x.dtype)                                             (rounded once)

and, with dy the upstream gradient and a kept element one whose output is not <= 0 (torch's ReLU
backward; every element without ReLU), dy' = dy where kept, else 0::

    grad_bias_c   = sum(dy')               grad_weight_c = invstd_c * sum(dy' * (x - mean_c))
    grad_input    = scale_c * (dy' - grad_bias_c / M - (x - mean_c) * invstd_c * grad_weight_c / M)
    grad_residual = dy'

grad_input and grad_residual in x's dtype (rounded once), grad_weight / grad_bias in the
parameters' dtype (float32 when a parameter is None). Without a residual the ReLU mask is
recomputed from x and the statistics, as ``((x - mean_c) * scale_c + b_c).to(x.dtype) <= 0``: the
same test as on the stored output, without reading it. Given ``running_mean`` / ``running_var``,
the forward also updates them in place as F.batch_norm does::

    running_stat = (1 - momentum) * running_stat + momentum * batch_stat   (var: x M / (M - 1))

Example:
    >>> import torch
    >>> from amp_fx.kernels import reference
    >>> p = torch.ones(3, dtype=torch.float16); g = torch.full((3,), 2.0, dtype=torch.float16)
    >>> master = p.float(); m = torch.zeros(3); v = torch.zeros(3); step = torch.zeros(1)
    >>> found_inf = torch.zeros(1)
    >>> reference.check_finite_and_norm_([g], found_inf)
    >>> reference.adam_step_([p], [g], [master], [m], [v], step, lr=0.1, beta1=0.9, beta2=0.999,
    ...                      eps=1e-8, weight_decay=0.0, adam_w_mode=True, found_inf=found_inf)
    >>> reference.advance_step_(step, found_inf)
    >>> p
    tensor([0.8999, 0.8999, 0.8999], dtype=torch.float16)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.arguments import PARAM_DTYPES, check_grads, check_range, check_update, log_beta

__all__ = [
    "check_finite_and_norm_",
    "adam_step_",
    "sgd_step_",
    "advance_step_",
    "update_loss_scale_",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "cross_entropy_forward_with_grad",
    "batch_norm_act_forward",
    "batch_norm_act_backward",
]


def _skip_flag(found_inf: Tensor | None) -> Tensor | None:
    """A 0-dim bool tensor, True when the step must be skipped (broadcasts against any shape)."""
    return None if found_inf is None else found_inf.reshape(()) > 0


def _write(target: Tensor, new_value: Tensor, skip: Tensor | None) -> None:
    """target <- new_value in target's dtype, unless skip is set (then target keeps its bits)."""
    new_value = new_value.to(target.dtype)
    if skip is not None:
        new_value = torch.where(skip, target, new_value)
    target.copy_(new_value)


def _scaled_grad(grad: Tensor, grad_multiplier: Tensor | None) -> Tensor:
    grad = grad.float()
    return grad if grad_multiplier is None else grad * grad_multiplier.reshape(())


@torch.no_grad()
def check_finite_and_norm_(
    grads: Sequence[Tensor],
    found_inf: Tensor,
    *,
    grad_multiplier: Tensor | None = None,
    sq_norm_out: Tensor | None = None,
) -> None:
    """Set ``found_inf`` to 1.0 if any grad holds an inf or NaN; optionally accumulate the squared norm.

    ``found_inf`` is never cleared (it accumulates over calls, like
    ``torch._amp_foreach_non_finite_check_and_unscale_``). When ``sq_norm_out`` is given,
    ``sq_norm_out += sum_i sum((grads[i].float() * grad_multiplier) ** 2)`` in fp32.

    Example:
        >>> found_inf, sq = torch.zeros(1), torch.zeros(1)
        >>> check_finite_and_norm_([torch.tensor([3.0, 4.0])], found_inf, sq_norm_out=sq)
        >>> found_inf.item(), sq.item()
        (0.0, 25.0)
    """
    check_grads(grads, found_inf, grad_multiplier, sq_norm_out)
    if len(grads) == 0:
        return
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    found_inf.copy_(torch.where(finite, found_inf, torch.ones_like(found_inf)))
    if sq_norm_out is not None:
        sums = [_scaled_grad(g, grad_multiplier).square().sum() for g in grads]
        sq_norm_out.add_(torch.stack(sums).sum())


def _bias_correction(beta: float, t: Tensor) -> Tensor:
    """1 - beta**t, as -expm1(t * ln(beta)): no cancellation when beta**t is close to 1."""
    return -torch.expm1(t * log_beta(beta))


@torch.no_grad()
def adam_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    grad_multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One Adam (``adam_w_mode=False``) or AdamW (``adam_w_mode=True``) step, in place.

    ``step`` holds the number of steps already taken; this step uses t = step + 1 and does not
    change ``step`` (call ``advance_step_`` afterwards). ``masters[i]`` is the fp32 copy of a
    low-precision ``params[i]``; None (the whole list or one entry) means the param is its own
    master. If ``found_inf`` > 0 nothing is written.

    Example:
        >>> p, g = torch.ones(2), torch.ones(2)
        >>> m, v, step = torch.zeros(2), torch.zeros(2), torch.zeros(1)
        >>> adam_step_([p], [g], None, [m], [v], step, lr=0.5, beta1=0.9, beta2=0.999, eps=0.0,
        ...            weight_decay=0.0, adam_w_mode=False)
        >>> p
        tensor([0.5000, 0.5000])
    """
    check_update(
        params,
        grads,
        masters,
        {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
        step,
        grad_multiplier,
        found_inf,
        {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay},
    )
    check_adam_hyperparameters(lr, beta1, beta2, eps, weight_decay)
    if len(params) == 0:
        return
    skip = _skip_flag(found_inf)
    t = step.reshape(()) + 1
    step_size = lr / _bias_correction(beta1, t)
    bias_correction2_sqrt = _bias_correction(beta2, t).sqrt()
    for i, (param, grad, exp_avg, exp_avg_sq) in enumerate(
        zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    ):
        master = None if masters is None else masters[i]
        weight = (param if master is None else master).float()
        g = _scaled_grad(grad, grad_multiplier)
        if weight_decay != 0.0:
            if adam_w_mode:
                weight = weight * (1.0 - lr * weight_decay)
            else:
                g = g + weight_decay * weight
        new_exp_avg = beta1 * exp_avg + (1.0 - beta1) * g
        new_exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * g * g
        denom = new_exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
        new_weight = weight - step_size * (new_exp_avg / denom)
        _write(exp_avg, new_exp_avg, skip)
        _write(exp_avg_sq, new_exp_avg_sq, skip)
        if master is not None:
            _write(master, new_weight, skip)
        _write(param, new_weight, skip)


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


@torch.no_grad()
def sgd_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    momentum_buffers: Sequence[Tensor] | None,
    step: Tensor,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    grad_multiplier: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """One SGD step (torch.optim.SGD math), in place; same master and skip rules as ``adam_step_``.

    On the first step (``step`` == 0) the momentum buffer is set to the gradient, as torch does
    when it creates the buffer; ``momentum_buffers`` may be None when ``momentum`` == 0.

    Example:
        >>> p, g, buf, step = torch.ones(2), torch.ones(2), torch.zeros(2), torch.zeros(1)
        >>> sgd_step_([p], [g], None, [buf], step, lr=0.1, momentum=0.9, dampening=0.0,
        ...           weight_decay=0.0, nesterov=False)
        >>> p, buf
        (tensor([0.9000, 0.9000]), tensor([1., 1.]))
    """
    check_update(
        params,
        grads,
        masters,
        {"momentum_buffers": momentum_buffers},
        step,
        grad_multiplier,
        found_inf,
        {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay},
    )
    check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov, momentum_buffers)
    if len(params) == 0:
        return
    skip = _skip_flag(found_inf)
    first_step = step.reshape(()) == 0
    for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
        master = None if masters is None else masters[i]
        weight = (param if master is None else master).float()
        g = _scaled_grad(grad, grad_multiplier)
        if weight_decay != 0.0:
            g = g + weight_decay * weight
        if momentum != 0.0:
            buf = momentum_buffers[i]
            new_buf = torch.where(first_step, g, momentum * buf + (1.0 - dampening) * g)
            g = g + momentum * new_buf if nesterov else new_buf
            _write(buf, new_buf, skip)
        new_weight = weight - lr * g
        if master is not None:
            _write(master, new_weight, skip)
        _write(param, new_weight, skip)


@torch.no_grad()
def advance_step_(step: Tensor, found_inf: Tensor | None) -> None:
    """``step += 1`` unless ``found_inf`` > 0, decided on the device.

    Example:
        >>> step = torch.zeros(1)
        >>> advance_step_(step, torch.ones(1)); advance_step_(step, None)
        >>> step
        tensor([1.])
    """
    if found_inf is None:
        step.add_(1.0)
    else:
        step.add_((found_inf.reshape(()) <= 0).to(step.dtype))


# The scale and its bounds are float32: a bound is compared after rounding to float32 (as
# torch.clamp does), so a bound beyond float32's range has no float32 value to round to.
FLOAT32_MAX = torch.finfo(torch.float32).max


def check_scale_bound(name: str, value: float | None) -> None:
    """Raise ValueError for a min/max scale that is not None nor a positive float32-representable number."""
    if value is not None and not 0.0 < value <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be None or in (0, {FLOAT32_MAX:.4e}] (the scale is a float32 tensor), got {value}"
        )


# The growth and hysteresis trackers are int32 tensors: the counts they hold or count to fit in one.
INT32_MAX = 2**31 - 1


def check_tracker_count(name: str, value: int, low: int) -> None:
    """Raise ValueError for a tracker count (or its limit) that is not an int in [low, 2**31 - 1]."""
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


@torch.no_grad()
def update_loss_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    hysteresis_tracker: Tensor,
    found_infs: Sequence[Tensor],
    *,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None = None,
    max_scale: float | None = None,
    inv_scale_out: Tensor | None = None,
    zero_found_infs: bool = False,
) -> None:
    """One step of the dynamic loss-scale rule (`amp_fx.LossScaler`'s), in place on device tensors.

    ``scale`` (float32), ``growth_tracker`` and ``hysteresis_tracker`` (int32) are one-element
    tensors; ``found_infs`` are float32 one-element overflow flags, summed: this step overflowed
    when the sum is > 0. Then::

        overflow:  hysteresis_tracker = max(hysteresis_tracker - 1, 0); growth_tracker = 0
                   if hysteresis_tracker == 0:
                       scale = max(fp32(fp64(scale) * backoff_factor), min_scale)
        clean:     hysteresis_tracker = hysteresis; growth_tracker += 1
                   if growth_tracker >= growth_interval:
                       growth_tracker = 0
                       grown = fp32(fp64(scale) * growth_factor)
                       scale = min(grown, max_scale) if grown is finite else scale

    (torch._amp_update_scale_'s products in fp64 rounded once to fp32; never grown to inf; the
    bounds rounded to fp32, as torch.clamp does.) ``inv_scale_out``, if given, receives
    ``fp32(1 / fp64(new scale))`` (exact for any float32 scale that is a power of two, as
    GradScaler's unscale computes it). ``zero_found_infs=True`` sets every flag to 0 after
    reading it, so persistent flags are ready for the next step without a fill of their own.

    Example:
        >>> scale = torch.tensor(1024.0)
        >>> growth, hyst = torch.tensor(0, dtype=torch.int32), torch.tensor(1, dtype=torch.int32)
        >>> update_loss_scale_(scale, growth, hyst, [torch.ones(1)], growth_factor=2.0, backoff_factor=0.5,
        ...                    growth_interval=2000, hysteresis=1)
        >>> scale
        tensor(512.)
    """
    check_loss_scale_arguments(
        scale,
        growth_tracker,
        hysteresis_tracker,
        found_infs,
        inv_scale_out,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        min_scale,
        max_scale,
    )
    flags = [f.reshape(()) for f in found_infs]
    found_inf = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
    old_scale = scale.reshape(())
    overflow = found_inf > 0
    new_hysteresis = torch.where(overflow, (hysteresis_tracker.reshape(()) - 1).clamp(min=0), hysteresis)
    back_off = overflow & (new_hysteresis == 0)
    successful = growth_tracker.reshape(()) + 1
    grow = ~overflow & (successful >= growth_interval)
    new_growth_tracker = torch.where(overflow | grow, 0, successful)
    # The factor products in fp64, rounded once to fp32: what torch._amp_update_scale_ computes.
    wide = old_scale.double()
    backed_off = (wide * backoff_factor).float()
    if min_scale is not None:
        backed_off = backed_off.clamp(min=min_scale)
    grown = (wide * growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, old_scale)  # as GradScaler: never grow to inf
    if max_scale is not None:
        grown = grown.clamp(max=max_scale)
    scale.copy_(torch.where(back_off, backed_off, torch.where(grow, grown, old_scale)))
    growth_tracker.copy_(new_growth_tracker)
    hysteresis_tracker.copy_(new_hysteresis)
    if inv_scale_out is not None:
        reciprocal_scale_(inv_scale_out, scale)
    if zero_found_infs:
        torch._foreach_zero_(list(found_infs))


@torch.no_grad()
def reciprocal_scale_(out: Tensor, scale: Tensor) -> None:
    """``out = fp32(1 / fp64(scale))``: GradScaler's reciprocal, in fp64 so that it is exact for any
    float32 power of two (a float32 reciprocal of 2^-127 or below would overflow or flush).

    Example:
        >>> out = torch.empty(()); reciprocal_scale_(out, torch.tensor(1024.0)); out
        tensor(0.0010)
    """
    out.copy_(scale.double().reciprocal().float().reshape(out.shape))


def check_cross_entropy_arguments(
    logits: Tensor,
    target: Tensor,
    ignore_index: int,
    *,
    lse: Tensor | None = None,
    grad_losses: Tensor | None = None,
    out: Tensor | None = None,
) -> None:
    """Validate the arguments of ``cross_entropy_forward`` / ``cross_entropy_backward`` (metadata
    only: never reads a value, so it never synchronizes); raise TypeError/ValueError."""
    if not isinstance(logits, Tensor) or not isinstance(target, Tensor):
        raise TypeError("logits and target must be tensors")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be 2-D (rows, classes) with at least one class, got shape {tuple(logits.shape)}; "
            "flatten the leading dimensions with logits.reshape(-1, logits.shape[-1])"
        )
    if logits.dtype not in PARAM_DTYPES:
        allowed = ", ".join(str(d) for d in PARAM_DTYPES)
        raise ValueError(f"logits have dtype {logits.dtype}; supported dtypes are {allowed}")
    num_rows = logits.shape[0]
    if target.dtype != torch.int64 or tuple(target.shape) != (num_rows,):
        raise ValueError(
            f"target must be int64 class indices of shape ({num_rows},), got {target.dtype} of shape "
            f"{tuple(target.shape)}; pass target.long() with one class index per row of logits"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be a Python int, got {ignore_index!r}")
    for name, value in (("target", target), ("lse", lse), ("grad_losses", grad_losses)):
        if value is None:
            continue
        if value.device != logits.device:
            raise ValueError(
                f"{name} is on {value.device} but logits are on {logits.device}; "
                f"move it with .to({logits.device})"
            )
        if name != "target" and (value.dtype != torch.float32 or tuple(value.shape) != (num_rows,)):
            raise ValueError(
                f"{name} must be float32 of shape ({num_rows},), got {value.dtype} of shape "
                f"{tuple(value.shape)}"
            )
    if out is not None and (
        out.dtype != logits.dtype
        or tuple(out.shape) != tuple(logits.shape)
        or out.device != logits.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {logits.dtype} tensor of the logits' shape {tuple(logits.shape)} on "
            f"{logits.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
            f"{'' if out.is_contiguous() else ' (not contiguous)'}; leave out=None to allocate the gradient"
        )
    # out=logits is an in-place update, each element read before it is written by the same program;
    # an out that overlaps the logits elsewhere would have programs overwrite rows others still read.
    if (
        out is not None
        and _byte_ranges_overlap(out, logits)
        and (out.data_ptr() != logits.data_ptr() or out.stride() != logits.stride())
    ):
        raise ValueError(
            "out overlaps the logits without being the logits themselves; pass out=logits to write the "
            "gradient over them, or a tensor of its own"
        )


def _byte_ranges_overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the bytes spanned by ``a`` and by ``b`` (first to last element) intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a_start, a_end), (b_start, b_end) = span(a), span(b)
    return a_start < b_end and b_start < a_end


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy of ``logits`` (N, C; fp16, bf16 or fp32) against class indices
    ``target`` (N,; int64), in fp32 (module docstring for the math).

    Returns ``(losses, lse)``, both float32 (N,): each row's loss (0 where ``target ==
    ignore_index``, NaN where the target is outside [0, C)) and its logsumexp.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]], dtype=torch.float16)
        >>> losses, lse = cross_entropy_forward(logits, torch.tensor([1, -100]), -100)
        >>> losses, lse
        (tensor([0.6931, 0.0000]), tensor([0.6931, 3.1269]))
    """
    check_cross_entropy_arguments(logits, target, ignore_index)
    x = logits.float()
    lse = torch.logsumexp(x, dim=1)
    in_range = (target >= 0) & (target < x.shape[1])
    # Out-of-range targets read column 0 and are replaced by NaN: never an out-of-bounds gather.
    target_logit = x.gather(1, torch.where(in_range, target, 0).unsqueeze(1)).squeeze(1)
    losses = torch.where(in_range, lse - target_logit, float("nan"))
    losses = torch.where(target == ignore_index, 0.0, losses)
    return losses, lse


def cross_entropy_backward(
    grad_losses: Tensor,
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    ignore_index: int,
    out: Tensor | None = None,
) -> Tensor:
    """Gradient of the per-row losses w.r.t. ``logits``: ``grad_losses[i] * (softmax(logits[i]) -
    onehot(target[i]))`` in fp32, rounded once to the logits' dtype; exactly 0 for ignored rows,
    NaN for rows whose target is out of range. ``lse`` is the forward's. Written to ``out`` when
    given (contiguous, the logits' shape and dtype; ``out=logits`` overwrites the logits).

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]], dtype=torch.float16)
        >>> target = torch.tensor([1, -100])
        >>> losses, lse = cross_entropy_forward(logits, target, -100)
        >>> cross_entropy_backward(torch.ones(2), logits, target, lse, -100)
        tensor([[ 0.5000, -0.5000],
                [ 0.0000,  0.0000]], dtype=torch.float16)
    """
    check_cross_entropy_arguments(logits, target, ignore_index, lse=lse, grad_losses=grad_losses, out=out)
    x = logits.float()
    in_range = (target >= 0) & (target < x.shape[1])
    grad_loss = torch.where(in_range, grad_losses, float("nan")).unsqueeze(1)
    is_target = torch.arange(x.shape[1], device=x.device) == target.unsqueeze(1)
    # g * p - g at the target, in the order torch's log_softmax backward computes it.
    grad = grad_loss * torch.exp(x - lse.unsqueeze(1)) - torch.where(is_target, grad_loss, 0.0)
    grad = torch.where((target == ignore_index).unsqueeze(1), 0.0, grad)
    if out is not None:
        return out.copy_(grad)
    # Contiguous whatever the logits' strides, as the Triton kernel and the op's fake allocate it.
    return grad.to(logits.dtype).contiguous()


def check_logits_overwritable(logits: Tensor) -> None:
    """``cross_entropy_forward_with_grad`` writes the gradient over the logits: they must be one
    contiguous block (raise ValueError otherwise)."""
    if not logits.is_contiguous():
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} and strides {logits.stride()} are not contiguous; "
            "cross_entropy_forward_with_grad writes the gradient over them: pass logits.contiguous()"
        )


def cross_entropy_forward_with_grad(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """``cross_entropy_forward``'s losses, with the gradient for an upstream gradient of 1 written
    over ``logits`` (contiguous): ``softmax(logits[i]) - onehot(target[i])`` in fp32, rounded once
    to their dtype; exactly 0 for ignored rows, NaN for rows whose target is out of range.

    Returns the float32 (N,) losses. A caller scales the gradient by the real upstream gradient
    later (a fused linear + loss scales the matmuls' outputs instead of this [N, C] tensor).

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [1.0, 3.0]], dtype=torch.float16)
        >>> cross_entropy_forward_with_grad(logits, torch.tensor([1, -100]), -100)
        tensor([0.6931, 0.0000])
        >>> logits
        tensor([[ 0.5000, -0.5000],
                [ 0.0000,  0.0000]], dtype=torch.float16)
    """
    check_cross_entropy_arguments(logits, target, ignore_index)
    check_logits_overwritable(logits)
    losses, lse = cross_entropy_forward(logits, target, ignore_index)
    unit = torch.ones_like(losses)
    cross_entropy_backward(unit, logits, target, lse, ignore_index, out=logits)
    return losses


def check_batch_norm_act_arguments(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    *,
    grad_out: Tensor | None = None,
    mean: Tensor | None = None,
    invstd: Tensor | None = None,
    out: Tensor | None = None,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
) -> None:
    """Validate the arguments of ``batch_norm_act_forward`` / ``batch_norm_act_backward`` (metadata
    only: never reads a value, so it never synchronizes); raise TypeError/ValueError."""
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a tensor, got {type(input).__name__}")
    if input.dim() < 2 or input.shape[1] == 0:
        raise ValueError(
            f"input must be (N, C, ...) with at least one channel, got shape {tuple(input.shape)}"
        )
    if input.dtype not in PARAM_DTYPES:
        allowed = ", ".join(str(d) for d in PARAM_DTYPES)
        raise ValueError(f"input has dtype {input.dtype}; supported dtypes are {allowed}")
    num_channels = input.shape[1]
    if input.numel() // num_channels == 0:
        raise ValueError(f"input of shape {tuple(input.shape)} has no values per channel")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if not isinstance(param, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(param).__name__}")
        if tuple(param.shape) != (num_channels,) or param.dtype not in PARAM_DTYPES:
            raise ValueError(
                f"{name} must be a 1-D float tensor of {num_channels} channels, got {param.dtype} of "
                f"shape {tuple(param.shape)}"
            )
        if param.device != input.device:
            raise ValueError(f"{name} is on {param.device} but input is on {input.device}; move it")
    for name, value in (("residual", residual), ("grad_out", grad_out), ("out", out)):
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(value).__name__}")
        if value.shape != input.shape or value.dtype != input.dtype or value.device != input.device:
            raise ValueError(
                f"{name} must match input ({input.dtype} {tuple(input.shape)} on {input.device}), got "
                f"{value.dtype} {tuple(value.shape)} on {value.device}"
            )
    _check_running_stats(input, running_mean, running_var)
    for name, value in (("mean", mean), ("invstd", invstd)):
        if value is None:
            continue
        if (
            value.dtype != torch.float32
            or tuple(value.shape) != (num_channels,)
            or value.device != input.device
        ):
            raise ValueError(
                f"{name} must be float32 of shape ({num_channels},) on {input.device}, got {value.dtype} of "
                f"shape {tuple(value.shape)} on {value.device}; pass the forward's statistics"
            )


def _check_running_stats(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None) -> None:
    """Both running statistics or neither; contiguous (C,) float buffers of one dtype on input's
    device (the kernels update them in place), and more than one value per channel (the unbiased
    variance divides by M - 1)."""
    if running_mean is None and running_var is None:
        return
    if running_mean is None or running_var is None:
        raise ValueError("pass both running_mean and running_var, or neither")
    num_channels = input.shape[1]
    for name, value in (("running_mean", running_mean), ("running_var", running_var)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(value).__name__}")
        if (
            tuple(value.shape) != (num_channels,)
            or value.dtype not in PARAM_DTYPES
            or value.device != input.device
            or not value.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be a contiguous 1-D float tensor of {num_channels} channels on "
                f"{input.device}, got {value.dtype} of shape {tuple(value.shape)} on {value.device}"
            )
    if running_mean.dtype != running_var.dtype:
        raise ValueError(
            f"running_mean ({running_mean.dtype}) and running_var ({running_var.dtype}) must have one "
            f"dtype; convert one of them"
        )
    if _byte_ranges_overlap(running_mean, running_var):
        # Both are read and then written per channel: one would overwrite the other's old value.
        raise ValueError("running_mean and running_var share memory; give each a buffer of its own")
    if input.numel() // num_channels < 2:
        raise ValueError(
            f"updating the running statistics needs more than 1 value per channel, got input of shape "
            f"{tuple(input.shape)}"
        )


@torch.no_grad()
def update_batch_norm_running_stats_(
    running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, momentum: float, num_values: int
) -> None:
    """F.batch_norm's training update of the running statistics, in place, computed in fp32 and
    rounded once to the buffers' dtype: stat = (1 - momentum) * stat + momentum * batch stat, with
    the biased batch variance ``var`` made unbiased (x M / (M - 1), M = ``num_values``).

    Example:
        >>> running_mean, running_var = torch.zeros(1), torch.ones(1)
        >>> update_batch_norm_running_stats_(running_mean, running_var, torch.tensor([2.0]),
        ...                                  torch.tensor([1.0]), 0.5, 2)
        >>> running_mean, running_var
        (tensor([1.]), tensor([1.5000]))
    """
    unbiased_var = var * (num_values / (num_values - 1))
    running_mean.copy_(momentum * mean + (1.0 - momentum) * running_mean.float())
    running_var.copy_(momentum * unbiased_var + (1.0 - momentum) * running_var.float())


def _per_channel(values: Tensor, input: Tensor) -> Tensor:
    """A (C,) vector shaped to broadcast along dim 1 of ``input``."""
    return values.reshape((1, -1) + (1,) * (input.dim() - 2))


def _batch_norm_scale_and_bias(
    weight: Tensor | None, bias: Tensor | None, invstd: Tensor
) -> tuple[Tensor, Tensor]:
    """fp32 (C,) scale = weight * invstd and bias (zeros when None)."""
    scale = invstd if weight is None else weight.float() * invstd
    shift = torch.zeros_like(invstd) if bias is None else bias.float()
    return scale, shift


def _like_input(values: Tensor, input: Tensor) -> Tensor:
    """``values`` in input's dtype and strides (channels_last stays channels_last), rounded once."""
    return torch.empty_like(input).copy_(values)


def batch_norm_act_forward(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    relu: bool,
    *,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    momentum: float = 0.1,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm over dim 1 of ``input`` (N, C, ...), then ``+ residual``, then ReLU
    (module docstring for the math).

    Returns ``(out, mean, invstd, var)``: ``out`` in input's dtype and strides; the batch mean,
    ``1 / sqrt(var + eps)`` and the biased variance, float32 (C,). When ``running_mean`` and
    ``running_var`` are given they are updated in place as F.batch_norm updates them
    (`update_batch_norm_running_stats_`, with ``momentum``). ``validate=False`` skips the argument
    checks, for callers that made them (amp_fx.ops.norms).

    Example:
        >>> x = torch.tensor([[1.0], [3.0]], dtype=torch.float16)
        >>> out, mean, invstd, var = batch_norm_act_forward(x, None, None, None, 0.0, relu=True)
        >>> out.flatten(), mean, var
        (tensor([0., 1.], dtype=torch.float16), tensor([2.]), tensor([1.]))
    """
    if validate:
        check_batch_norm_act_arguments(
            input, weight, bias, residual, running_mean=running_mean, running_var=running_var
        )
    x = input.float()
    dims = [d for d in range(input.dim()) if d != 1]
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    invstd = torch.rsqrt(var + eps)
    if running_mean is not None:
        num_values = input.numel() // input.shape[1]
        update_batch_norm_running_stats_(running_mean, running_var, mean, var, momentum, num_values)
    scale, shift = _batch_norm_scale_and_bias(weight, bias, invstd)
    y = (x - _per_channel(mean, input)) * _per_channel(scale, input) + _per_channel(shift, input)
    if residual is not None:
        y = y + residual.float()
    if relu:
        # Not torch.clamp_min(y, 0): NaN stays NaN, as torch.relu keeps it.
        y = torch.where(y < 0, 0.0, y)
    return _like_input(y, input), mean, invstd, var


def batch_norm_act_backward(
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    out: Tensor | None,
    has_residual: bool,
    relu: bool,
    *,
    validate: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``batch_norm_act_forward`` (module docstring for the math).

    ``mean`` and ``invstd`` are the forward's. ``out`` is the forward's output, needed only with a
    residual and ReLU (the mask then depends on the residual); else None and the mask is
    recomputed. Returns ``(grad_input, grad_weight, grad_bias, grad_residual)``: grad_input in
    input's dtype and strides, grad_weight / grad_bias in weight's / bias's dtype (float32 when
    None), grad_residual like grad_input when ``has_residual``, else an empty tensor.
    ``validate=False`` skips the argument checks.

    Example:
        >>> x = torch.tensor([[1.0], [3.0]])
        >>> out, mean, invstd, _ = batch_norm_act_forward(x, None, None, None, 0.0, relu=False)
        >>> grads = batch_norm_act_backward(torch.tensor([[1.0], [2.0]]), x, None, None, mean, invstd,
        ...                                 None, has_residual=False, relu=False)
        >>> grads[0].flatten(), grads[1], grads[2]
        (tensor([0., 0.]), tensor([1.]), tensor([3.]))
    """
    if validate:
        check_batch_norm_act_arguments(
            input, weight, bias, None, grad_out=grad_out, mean=mean, invstd=invstd, out=out
        )
        if relu and has_residual and out is None:
            raise ValueError("with a residual and relu=True the backward needs the forward's output (out)")
    x = input.float()
    dims = [d for d in range(input.dim()) if d != 1]
    num_values = input.numel() // input.shape[1]
    scale, shift = _batch_norm_scale_and_bias(weight, bias, invstd)
    centered = x - _per_channel(mean, input)
    dy = grad_out.float()
    if relu:
        if out is None:
            out = (centered * _per_channel(scale, input) + _per_channel(shift, input)).to(input.dtype)
        dy = torch.where(out <= 0, 0.0, dy)
    sum_dy = dy.sum(dims)
    sum_dy_centered = (dy * centered).sum(dims)
    grad_weight = invstd * sum_dy_centered
    correction = centered * _per_channel(invstd * grad_weight / num_values, input)
    grad_input = (dy - _per_channel(sum_dy / num_values, input) - correction) * _per_channel(scale, input)
    grad_residual = _like_input(dy, input) if has_residual else input.new_empty((0,))
    return (
        _like_input(grad_input, input),
        grad_weight.to(torch.float32 if weight is None else weight.dtype),
        sum_dy.to(torch.float32 if bias is None else bias.dtype),
        grad_residual,
    )


# Max pooling (``max_pool2d_forward`` / ``max_pool2d_backward``; the Triton twins are in
# ``amp_fx.kernels.max_pool``). For a 4-D channels_last input x (N, C, H, W) in fp16, bf16 or fp32
# and a window of KH x KW taps (kernel size, stride, padding, dilation: pairs of ints, as
# F.max_pool2d normalizes them), output (oh, ow) looks at the taps (kh, kw) at
#
#     ih = oh * SH - PH + kh * DH        iw = ow * SW - PW + kw * DW
#
# scanning kh outer, kw inner. Padding taps never win. torch's rule picks the tap: the first
# in-range tap is taken, then a later tap replaces it when ``val > best or isnan(val)`` (so the
# first maximum wins, and the last NaN when there are NaNs). The forward writes the value and the
# tap's offset ``kh * KW + kw`` as uint8 (1 byte where torch stores an int64 flat index; windows
# of at most 256 taps). The backward gathers: each input element sums, in fp32, the gradients of
# the windows whose winning tap it is, in the order of those windows (oh, then ow, ascending), and
# is rounded once to x's dtype.

MAX_POOL_MAX_TAPS = 256  # the offsets are uint8
MAX_POOL_MAX_PIXELS = 2**31 - 1  # N * H * W: the Triton kernels index pixels with int32


def max_pool2d_output_size(
    size: int, kernel_size: int, stride: int, padding: int, dilation: int, ceil_mode: bool
) -> int:
    """One output dimension, by torch's formula (``pooling_output_shape``): with ceil_mode the last
    window may hang over the end, but it must start inside the input or its left padding.

    Example:
        >>> max_pool2d_output_size(112, 3, 2, 1, 1, False), max_pool2d_output_size(5, 2, 2, 0, 1, True)
        (56, 3)
    """
    numerator = size + 2 * padding - dilation * (kernel_size - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = numerator // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _check_pair(name: str, value: object, minimum: int) -> tuple[int, int]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(
            f"{name} must be a pair of ints (height, width), got {value!r}; "
            "amp_fx.ops.pooling.max_pool2d accepts F.max_pool2d's forms and normalizes them"
        )
    if min(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum} in both dimensions, got {tuple(value)}")
    return value[0], value[1]


def check_max_pool2d_arguments(
    input_size: Sequence[int],
    dtype: torch.dtype,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> tuple[int, int]:
    """Validate a max-pool window for an input of ``input_size`` (N, C, H, W) and ``dtype`` (metadata
    only); returns the output's (OH, OW). Raises TypeError/ValueError with torch's rules: padding at
    most half the kernel size, an output of at least one element per dimension, and (for the 1-byte
    offsets) at most 256 taps per window."""
    if len(input_size) != 4:
        raise ValueError(
            f"max_pool2d kernels take a 4-D (N, C, H, W) input, got {len(input_size)} dimensions; "
            "add a batch dimension with x.unsqueeze(0)"
        )
    if dtype not in PARAM_DTYPES:
        allowed = ", ".join(str(d) for d in PARAM_DTYPES)
        raise ValueError(f"max_pool2d input has dtype {dtype}; supported dtypes are {allowed}")
    kernel = _check_pair("kernel_size", kernel_size, 1)
    strides = _check_pair("stride", stride, 1)
    pads = _check_pair("padding", padding, 0)
    dilations = _check_pair("dilation", dilation, 1)
    if not isinstance(ceil_mode, bool):
        raise TypeError(f"ceil_mode must be True or False, got {ceil_mode!r}")
    if kernel[0] * kernel[1] > MAX_POOL_MAX_TAPS:
        raise ValueError(
            f"a {kernel[0]}x{kernel[1]} window has more than {MAX_POOL_MAX_TAPS} taps, too many for "
            "1-byte offsets; use F.max_pool2d for such windows"
        )
    if pads[0] > kernel[0] // 2 or pads[1] > kernel[1] // 2:
        raise ValueError(f"padding {pads} is more than half the kernel size {kernel}; use a smaller padding")
    out_size = tuple(
        max_pool2d_output_size(input_size[2 + i], kernel[i], strides[i], pads[i], dilations[i], ceil_mode)
        for i in range(2)
    )
    if min(out_size) < 1:
        raise ValueError(
            f"max_pool2d of an input of spatial size {tuple(input_size[2:])} with kernel {kernel}, "
            f"dilation {dilations} and padding {pads} has output size {out_size}; "
            "use a smaller kernel or a larger input"
        )
    return out_size


def _check_channels_last(name: str, tensor: Tensor) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dim() != 4 or not tensor.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(
            f"{name} must be a 4-D tensor contiguous in channels_last (strides {tensor.stride()} for "
            f"shape {tuple(tensor.shape)}); convert it with .contiguous(memory_format=torch.channels_last)"
        )


def check_max_pool2d_backward_arguments(
    grad_out: Tensor,
    offsets: Tensor,
    input_size: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> None:
    """Validate the arguments of ``max_pool2d_backward`` (metadata only)."""
    if not isinstance(grad_out, Tensor):
        raise TypeError(f"grad_out must be a tensor, got {type(grad_out).__name__}")
    _check_channels_last("offsets", offsets)
    if offsets.dtype != torch.uint8:
        raise ValueError(f"offsets must be the forward's uint8 offsets, got dtype {offsets.dtype}")
    if not isinstance(input_size, (tuple, list)) or len(input_size) != 4:
        raise ValueError(f"input_size must be the forward input's (N, C, H, W), got {input_size!r}")
    check_max_pool2d_arguments(
        input_size, grad_out.dtype, kernel_size, stride, padding, dilation, ceil_mode=False
    )
    if grad_out.shape != offsets.shape or grad_out.device != offsets.device:
        raise ValueError(
            f"grad_out ({tuple(grad_out.shape)} on {grad_out.device}) must have the shape and device "
            f"of the offsets ({tuple(offsets.shape)} on {offsets.device})"
        )
    if tuple(offsets.shape[:2]) != tuple(input_size[:2]):
        raise ValueError(
            f"offsets of shape {tuple(offsets.shape)} do not belong to an input of size {tuple(input_size)}"
        )


def max_pool2d_forward(
    input: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    *,
    validate: bool = True,
) -> tuple[Tensor, Tensor]:
    """2-D max pooling of a channels_last ``input`` (N, C, H, W): ``(out, offsets)``, out in the
    input's dtype, offsets uint8 (``kh * KW + kw`` of each window's winning tap), both
    channels_last (N, C, OH, OW). Values and ties as F.max_pool2d (section comment above).
    ``validate=False`` skips the argument checks (for callers that made them).

    Example:
        >>> x = torch.tensor([[[[1.0, 3.0], [3.0, float("nan")]]]]).to(memory_format=torch.channels_last)
        >>> out, offsets = max_pool2d_forward(x, (2, 2), (2, 2), (0, 0), (1, 1), False)
        >>> out.flatten().tolist(), offsets.flatten().tolist()
        ([nan], [3])
    """
    if validate:
        _check_channels_last("input", input)
        check_max_pool2d_arguments(
            input.shape, input.dtype, kernel_size, stride, padding, dilation, ceil_mode
        )
    out_h, out_w = (
        max_pool2d_output_size(
            input.shape[2 + i], kernel_size[i], stride[i], padding[i], dilation[i], ceil_mode
        )
        for i in range(2)
    )
    (kernel_h, kernel_w), (stride_h, stride_w) = kernel_size, stride
    (pad_h, pad_w), (dilation_h, dilation_w) = padding, dilation
    height, width = input.shape[2:]
    device = input.device
    oh = torch.arange(out_h, device=device)
    ow = torch.arange(out_w, device=device)
    best = input.new_full((*input.shape[:2], out_h, out_w), float("-inf"))
    best_tap = torch.full(best.shape, -1, dtype=torch.int64, device=device)
    for kh in range(kernel_h):
        ih = oh * stride_h - pad_h + kh * dilation_h
        valid_h = (ih >= 0) & (ih < height)
        for kw in range(kernel_w):
            iw = ow * stride_w - pad_w + kw * dilation_w
            valid_w = (iw >= 0) & (iw < width)
            # Out-of-range taps read row/column 0 and are masked out: never an out-of-bounds index.
            rows = input.index_select(2, torch.where(valid_h, ih, 0))
            value = rows.index_select(3, torch.where(valid_w, iw, 0))
            valid = valid_h[:, None] & valid_w[None, :]
            take = valid & ((value > best) | torch.isnan(value) | (best_tap < 0))
            best = torch.where(take, value, best)
            best_tap = torch.where(take, kh * kernel_w + kw, best_tap)
    out = best.contiguous(memory_format=torch.channels_last)
    offsets = best_tap.to(torch.uint8).contiguous(memory_format=torch.channels_last)
    return out, offsets


def max_pool2d_backward(
    grad_out: Tensor,
    offsets: Tensor,
    input_size: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    *,
    validate: bool = True,
) -> Tensor:
    """Gradient of `max_pool2d_forward` w.r.t. its input (of size ``input_size``), from ``grad_out``
    (any strides) and the forward's ``offsets``: each input element sums, in fp32, the gradients
    of the windows it won, and is rounded once to grad_out's dtype; channels_last.

    Example:
        >>> x = torch.tensor([[[[1.0, 3.0, 2.0]]]]).to(memory_format=torch.channels_last)
        >>> _, offsets = max_pool2d_forward(x, (1, 2), (1, 1), (0, 0), (1, 1), False)
        >>> max_pool2d_backward(torch.ones(1, 1, 1, 2), offsets, x.shape, (1, 2), (1, 1), (0, 0), (1, 1))
        tensor([[[[0., 2., 0.]]]])
    """
    if validate:
        check_max_pool2d_backward_arguments(
            grad_out, offsets, input_size, kernel_size, stride, padding, dilation
        )
    (kernel_h, kernel_w), (stride_h, stride_w) = kernel_size, stride
    (pad_h, pad_w), (dilation_h, dilation_w) = padding, dilation
    height, width = input_size[2:]
    out_h, out_w = offsets.shape[2:]
    grad = torch.zeros(tuple(input_size), dtype=torch.float32, device=grad_out.device)
    grad_of_out = grad_out.float()
    # Taps in reverse: for one input element, windows further down/right reach it through smaller
    # taps, so this adds each element's windows in (oh, ow) order, as the Triton kernel does.
    for kh in reversed(range(kernel_h)):
        first_h, last_h = _windows_in_range(out_h, height, stride_h, kh * dilation_h - pad_h)
        for kw in reversed(range(kernel_w)):
            first_w, last_w = _windows_in_range(out_w, width, stride_w, kw * dilation_w - pad_w)
            if first_h > last_h or first_w > last_w:
                continue
            windows = (slice(None), slice(None), slice(first_h, last_h + 1), slice(first_w, last_w + 1))
            # One tap of distinct windows reaches distinct input elements: a strided slice of them.
            start_h = first_h * stride_h + kh * dilation_h - pad_h
            start_w = first_w * stride_w + kw * dilation_w - pad_w
            reached = (
                slice(None),
                slice(None),
                slice(start_h, start_h + (last_h - first_h) * stride_h + 1, stride_h),
                slice(start_w, start_w + (last_w - first_w) * stride_w + 1, stride_w),
            )
            won = offsets[windows] == kh * kernel_w + kw
            grad[reached] += torch.where(won, grad_of_out[windows], 0.0)
    return grad.to(grad_out.dtype).contiguous(memory_format=torch.channels_last)


def _windows_in_range(num_windows: int, size: int, stride: int, shift: int) -> tuple[int, int]:
    """First and last window index o in [0, num_windows) whose tap at ``o * stride + shift`` lies in
    [0, size) (first > last when none does)."""
    first = max(0, -(shift // stride)) if shift < 0 else 0
    last = min(num_windows - 1, (size - 1 - shift) // stride)
    return first, last
