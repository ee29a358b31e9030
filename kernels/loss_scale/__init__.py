"""The dynamic loss-scale update in one launch: the kernel family's contract.

Two implementations take the same arguments and compute the same bits: ``reference`` (plain torch,
any device; also ``reciprocal_scale_``, which `amp_fx.LossScaler` calls on any device) and
``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``); ``arguments`` holds the checks
both run, and that `amp_fx.LossScaler` runs on its configuration up front.

The kernel (``KERNELS``): ``update_loss_scale_(scale, growth_tracker, hysteresis_tracker,
found_infs, *, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale=None,
max_scale=None, inv_scale_out=None, zero_found_infs=False) -> None``, in place. ``scale``
(float32), ``growth_tracker`` and ``hysteresis_tracker`` (int32) are one-element tensors;
``found_infs`` are float32 one-element overflow flags, summed: this step overflowed when the sum
is > 0. Then::

    overflow:  hysteresis_tracker = max(hysteresis_tracker - 1, 0); growth_tracker = 0
               if hysteresis_tracker == 0:
                   scale = max(fp32(fp64(scale) * backoff_factor), min_scale)
    clean:     hysteresis_tracker = hysteresis; growth_tracker += 1
               if growth_tracker >= growth_interval:
                   growth_tracker = 0
                   grown = fp32(fp64(scale) * growth_factor)
                   scale = min(grown, max_scale) if grown is finite else scale

(torch._amp_update_scale_'s products in fp64 rounded once to fp32; never grown to inf; the bounds
rounded to fp32, as torch.clamp does.) ``inv_scale_out``, if given, receives
``fp32(1 / fp64(new scale))`` (exact for any float32 power of two, as GradScaler's unscale
computes it). ``zero_found_infs=True`` sets every flag to 0 after reading it, so persistent flags
are ready for the next step without a fill of their own. No tensor value is read on the host.
"""

KERNELS = ("update_loss_scale_",)
