"""The dynamic loss-scale update as one single-program launch over the scaler's 0-dim state.

What: the family's contract, ``amp_fx.kernels.loss_scale`` (the rule is written out there): from the
summed overflow flags, back off the scale (after ``hysteresis`` consecutive overflows, never below
``min_scale``) or grow it (after ``growth_interval`` clean steps, never to inf nor above
``max_scale``), and move the growth and hysteresis trackers; optionally write ``1 / scale`` for the
next unscale and zero the flags for the next step.

Why a kernel: the rule is about 25 elementwise torch ops on one-element tensors (compare, where,
clamp, the fp64 products, three copies back), each a launch of about a microsecond of GPU time
and 5-20 microseconds of host time, once per training step. Here the state is read into registers
and written back once: one launch, no host sync, capturable in a CUDA graph (every number the
rule needs is a launch argument or a load).

Numerics, bit for bit the reference's: the factor products are taken in fp64 and rounded once to
fp32. Triton passes a Python float as an fp32 argument, which would round a factor like 0.3 before
the product, so the factors travel as the int64 bits of their fp64 value and are bitcast back.
The bounds are compared in fp32 (the reference's ``clamp`` rounds them to fp32 too), so they are
rounded on the host; ``1 / scale`` is an fp64 division rounded once to fp32, as GradScaler's
``scale.double().reciprocal().float()``.

Layout: no tables. Up to ``MAX_FOUND_INFS`` flags are separate pointer arguments (one per
optimizer and device; usually one); more are summed into one by torch first.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.devices import on_device
from amp_fx.kernels.loss_scale.arguments import check_loss_scale_arguments

MAX_FOUND_INFS = 4


@triton.jit(
    # Values, not shapes: specializing on them (== 1, divisible by 16) would only add compilations.
    do_not_specialize=["growth_factor_bits", "backoff_factor_bits", "growth_interval", "hysteresis"]
)
def _update_loss_scale_kernel(
    scale_ptr,  # float32 [1]: the loss scale, read and rewritten
    growth_tracker_ptr,  # int32 [1]: clean steps since the last growth or overflow
    hysteresis_tracker_ptr,  # int32 [1]: overflows still allowed before the next backoff
    inv_scale_ptr,  # float32 [1]: receives fp32(1 / fp64(new scale)) (written only if WRITE_INV_SCALE)
    found_inf_0_ptr,  # float32 [1]: overflow flags; the first NUM_FOUND_INFS are summed (and zeroed
    found_inf_1_ptr,  #   when ZERO_FOUND_INFS), the others are never touched
    found_inf_2_ptr,
    found_inf_3_ptr,
    growth_factor_bits,  # int64: the bits of growth_factor as an fp64
    backoff_factor_bits,  # int64: the bits of backoff_factor as an fp64
    growth_interval,  # int: clean steps before the scale grows
    hysteresis,  # int: what the hysteresis tracker refills to after a clean step
    min_scale,  # float32: lower bound of a backed-off scale (used only if HAS_MIN_SCALE)
    max_scale,  # float32: upper bound of a grown scale (used only if HAS_MAX_SCALE)
    NUM_FOUND_INFS: tl.constexpr,
    HAS_MIN_SCALE: tl.constexpr,
    HAS_MAX_SCALE: tl.constexpr,
    WRITE_INV_SCALE: tl.constexpr,
    ZERO_FOUND_INFS: tl.constexpr,
):
    found_inf = tl.load(found_inf_0_ptr)
    if NUM_FOUND_INFS > 1:
        found_inf += tl.load(found_inf_1_ptr)
    if NUM_FOUND_INFS > 2:
        found_inf += tl.load(found_inf_2_ptr)
    if NUM_FOUND_INFS > 3:
        found_inf += tl.load(found_inf_3_ptr)
    scale = tl.load(scale_ptr)
    growth_tracker = tl.load(growth_tracker_ptr)
    hysteresis_tracker = tl.load(hysteresis_tracker_ptr)
    # Every thread runs this scalar code; the barrier keeps one thread's stores below from
    # overtaking another thread's loads of the same addresses.
    tl.debug_barrier()

    overflow = found_inf > 0
    new_hysteresis = tl.where(overflow, tl.maximum(hysteresis_tracker - 1, 0), hysteresis)
    back_off = overflow & (new_hysteresis == 0)
    successful = growth_tracker + 1
    grow = ~overflow & (successful >= growth_interval)
    new_growth_tracker = tl.where(overflow | grow, 0, successful)

    wide = scale.to(tl.float64)
    backed_off = (wide * backoff_factor_bits.to(tl.int64).to(tl.float64, bitcast=True)).to(tl.float32)
    # torch.clamp keeps a NaN scale NaN where Triton's maximum/minimum return the bound: NaN is
    # passed through explicitly.
    if HAS_MIN_SCALE:
        backed_off = tl.where(backed_off != backed_off, backed_off, tl.maximum(backed_off, min_scale))
    grown = (wide * growth_factor_bits.to(tl.int64).to(tl.float64, bitcast=True)).to(tl.float32)
    grown = tl.where(tl.abs(grown) < float("inf"), grown, scale)  # never grow to inf
    if HAS_MAX_SCALE:
        grown = tl.where(grown != grown, grown, tl.minimum(grown, max_scale))
    new_scale = tl.where(back_off, backed_off, tl.where(grow, grown, scale)).to(tl.float32)

    tl.store(scale_ptr, new_scale)
    tl.store(growth_tracker_ptr, new_growth_tracker.to(tl.int32))
    tl.store(hysteresis_tracker_ptr, new_hysteresis.to(tl.int32))
    if WRITE_INV_SCALE:
        tl.store(inv_scale_ptr, (1.0 / new_scale.to(tl.float64)).to(tl.float32))
    if ZERO_FOUND_INFS:
        tl.store(found_inf_0_ptr, 0.0)
        if NUM_FOUND_INFS > 1:
            tl.store(found_inf_1_ptr, 0.0)
        if NUM_FOUND_INFS > 2:
            tl.store(found_inf_2_ptr, 0.0)
        if NUM_FOUND_INFS > 3:
            tl.store(found_inf_3_ptr, 0.0)


def float64_bits(value: float) -> int:
    """The IEEE-754 bits of ``value`` as an fp64, as a signed int64 (how the factors reach the kernel)."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def round_to_float32(value: float) -> float:
    """``value`` rounded to nearest float32 (as torch.clamp rounds its bound for a float32 tensor)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


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
    """One loss-scale update in one launch; the contract of
    ``amp_fx.kernels.loss_scale``.

    Example:
        >>> scale = torch.full((), 1024.0, device="cuda")  # doctest: +SKIP
        >>> growth = torch.zeros((), dtype=torch.int32, device="cuda")  # doctest: +SKIP
        >>> hyst = torch.ones_like(growth)  # doctest: +SKIP
        >>> update_loss_scale_(scale, growth, hyst, [torch.ones(1, device="cuda")], growth_factor=2.0,
        ...                    backoff_factor=0.5, growth_interval=2000, hysteresis=1)  # doctest: +SKIP
        >>> scale  # doctest: +SKIP
        tensor(512., device='cuda:0')
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
    flags = list(found_infs)
    folded: list[Tensor] = []
    if len(flags) > MAX_FOUND_INFS:
        # More optimizer/device flags than pointer arguments: sum the rest first (a rare setup).
        folded = flags[MAX_FOUND_INFS - 1 :]
        flags = flags[: MAX_FOUND_INFS - 1] + [torch.stack([f.reshape(()) for f in folded]).sum()]
    unused = [flags[0]] * (MAX_FOUND_INFS - len(flags))
    with on_device(scale.device):
        _update_loss_scale_kernel[(1,)](
            scale,
            growth_tracker,
            hysteresis_tracker,
            scale if inv_scale_out is None else inv_scale_out,
            *flags,
            *unused,
            float64_bits(float(growth_factor)),
            float64_bits(float(backoff_factor)),
            growth_interval,
            hysteresis,
            0.0 if min_scale is None else round_to_float32(min_scale),
            0.0 if max_scale is None else round_to_float32(max_scale),
            NUM_FOUND_INFS=len(flags),
            HAS_MIN_SCALE=min_scale is not None,
            HAS_MAX_SCALE=max_scale is not None,
            WRITE_INV_SCALE=inv_scale_out is not None,
            ZERO_FOUND_INFS=zero_found_infs,
            num_warps=1,
        )
    if zero_found_infs and folded:
        torch._foreach_zero_(folded)
