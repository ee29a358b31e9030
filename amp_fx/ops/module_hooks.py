"""Whether a module has forward hooks: a pass that replaces a module's call by something else
(a fused module, a function) would silently stop them firing, so it leaves such modules alone."""

from __future__ import annotations

from torch import nn

__all__ = ["has_forward_hooks"]


def has_forward_hooks(module: nn.Module) -> bool:
    """True when ``module`` has forward hooks or forward pre-hooks of its own.

    Example:
        >>> relu = nn.ReLU()
        >>> has_forward_hooks(relu)
        False
        >>> _ = relu.register_forward_hook(lambda m, args, out: None)
        >>> has_forward_hooks(relu)
        True
    """
    return bool(module._forward_hooks or module._forward_pre_hooks)
