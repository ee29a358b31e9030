"""Calls of a ``torch.autograd.Function`` while a model is captured. A Function's backward is its
own (a clipped or straight-through gradient), not the derivative of its forward's ops, so a
capture must not record those ops in its place: torch.fx records the call itself
(`apply_autograd_function`, an opaque node) and torch.export refuses it (the module becomes an
autocast island). torch's own Functions (a custom op's registered backward) are torch's business.

>>> class Twice(torch.autograd.Function):
...     @staticmethod
...     def forward(ctx, x):
...         return x * 2
...     @staticmethod
...     def backward(ctx, grad):
...         return grad
>>> with intercepted_applies(lambda cls, apply, args, kwargs: "intercepted"):
...     Twice.apply(torch.ones(1))
'intercepted'
>>> apply_autograd_function(Twice, torch.ones(1))
tensor([2.])
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from amp_fx.core.node_info import FX_WRAPPED_KEY

__all__ = ["apply_autograd_function", "intercepted_applies", "is_torch_function", "recorded_in"]

# (the Function class, its original apply bound to it, args, kwargs) -> what the call returns.
Handler = Callable[[type, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def apply_autograd_function(function: type, *args: Any, **kwargs: Any) -> Any:
    """What a traced graph calls for a ``torch.autograd.Function``: the Function, backward and all."""
    return function.apply(*args, **kwargs)


def is_torch_function(cls: type) -> bool:
    """A Function of torch itself (``GeneratedBackwardFor_*`` of a custom op, checkpointing)."""
    return cls.__module__ == "torch" or cls.__module__.startswith("torch.")


@contextlib.contextmanager
def intercepted_applies(handler: Handler) -> Iterator[None]:
    """Inside the block, ``SomeFunction.apply(...)`` of a Function that is not torch's own returns
    ``handler(SomeFunction, original_apply, args, kwargs)``."""
    function = torch.autograd.Function
    apply = function.__dict__["apply"]  # a classmethod, or a C classmethod descriptor (torch 2.14)

    def intercepting(cls: type, *args: Any, **kwargs: Any) -> Any:
        original = apply.__get__(None, cls)
        if is_torch_function(cls):
            return original(*args, **kwargs)
        return handler(cls, original, args, kwargs)

    function.apply = classmethod(intercepting)
    try:
        yield
    finally:
        function.apply = apply


def recorded_in(tracer: torch.fx.Tracer) -> Callable[..., Any]:
    """The handler torch.fx tracing uses: a Function called on traced values becomes one node
    calling it (`apply_autograd_function`; `trace` makes it opaque), so its own backward runs."""

    def record(cls: type, apply: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        values = [*args, *kwargs.values()]
        if not any(isinstance(v, torch.fx.Proxy) for v in pytree.tree_leaves(values)):
            return apply(*args, **kwargs)
        # The class is an attribute of the traced root (fx takes no class as an argument).
        name = "_amp_fx_autograd_function_" + re.sub(r"\W", "_", f"{cls.__module__}.{cls.__qualname__}")
        setattr(tracer.root, name, cls)
        function = tracer.create_proxy("get_attr", name, (), {})
        proxy = tracer.create_proxy("call_function", apply_autograd_function, (function, *args), kwargs)
        proxy.node.meta[FX_WRAPPED_KEY] = True
        return proxy

    return record
