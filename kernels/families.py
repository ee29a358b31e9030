"""The kernel families, and the names of the kernels their contracts define: the one list that
``amp_fx.kernels.reference`` and ``amp_fx.kernels.triton_ops`` each implement in full.

A family is a subpackage of ``amp_fx.kernels`` whose ``__init__`` states its contract (the math,
the kernels' signatures) and lists its kernels in ``KERNELS``; ``reference.py`` and ``triton.py``
beside it implement them, ``arguments.py`` holds the checks both run. ``advance_step_``, the step
counter every optimizer kernel shares, is one more name of the contract (``optimizer_step``).

Example:
    >>> "adam_step_" in KERNEL_NAMES and "batch_norm_act_backward" in KERNEL_NAMES
    True
"""

from amp_fx.kernels import adam, batch_norm, cross_entropy, loss_scale, max_pool, overflow_check, sgd

__all__ = ["FAMILIES", "KERNEL_NAMES"]

FAMILIES = (overflow_check, adam, sgd, loss_scale, cross_entropy, batch_norm, max_pool)
KERNEL_NAMES = ("advance_step_", *(name for family in FAMILIES for name in family.KERNELS))
