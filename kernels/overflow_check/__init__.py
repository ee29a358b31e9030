"""The overflow check (and optional squared norm) over many gradients in one launch: the kernel
family's contract.

Two implementations take the same arguments and compute the same values: ``reference`` (plain
torch, any device) and ``triton`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``);
``arguments`` holds the checks both run. The optimizers, `amp_fx.LossScaler` and
`amp_fx.clip_grad_norm_` call it before an update.

The kernel (``KERNELS``): ``check_finite_and_norm_(grads, found_inf, *, grad_multiplier=None,
sq_norm_out=None) -> None`` sets ``found_inf`` (float32, one element) to 1.0 if any element of any
grad is inf or NaN, and never clears it (it accumulates over calls, like
``torch._amp_foreach_non_finite_check_and_unscale_``); given ``sq_norm_out`` it adds::

    sum_i sum_k (grads[i][k].float() * grad_multiplier)^2          (fp32)

to it. No tensor value is read on the host.
"""

KERNELS = ("check_finite_and_norm_",)
