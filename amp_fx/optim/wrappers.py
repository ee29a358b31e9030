"""`unwrap_optimizer`: the optimizer inside the wrappers users hold.

accelerate hands a Trainer user an ``AcceleratedOptimizer``, Lightning a ``LightningOptimizer``,
Fabric a ``_FabricOptimizer``; each keeps the optimizer it wraps at ``.optimizer``. Every amp_fx
function that takes an optimizer (`amp_fx.LossScaler`, `amp_fx.clip_grad_norm_`,
`amp_fx.optim.master_params`, ...) unwraps it with this one function, so a wrapper and the optimizer
inside it are the same optimizer to amp_fx (one loss-scaling state, one set of masters).

Example:
    >>> import torch
    >>> class Wrapper:  # any object with the wrapped optimizer at .optimizer
    ...     def __init__(self, optimizer):
    ...         self.optimizer = optimizer
    >>> inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> unwrap_optimizer(Wrapper(Wrapper(inner))) is inner
    True
"""

from __future__ import annotations

from typing import Any

__all__ = ["unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> Any:
    """Follow ``.optimizer`` as far as it goes; return the innermost object with ``param_groups``.

    An object with no such chain (a torch or amp_fx optimizer, or anything else) comes back as it
    is, so callers keep their own checks of what they were given.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> unwrap_optimizer(opt) is opt
        True
    """
    found, current, seen = optimizer, optimizer, {id(optimizer)}
    while (current := getattr(current, "optimizer", None)) is not None and id(current) not in seen:
        seen.add(id(current))
        if hasattr(current, "param_groups"):
            found = current
    return found
