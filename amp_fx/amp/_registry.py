"""Apex's function registries: ``amp.register_half_function(module, "name")`` and friends.

Apex patched the named function so that O1 cast its inputs. amp_fx instead records the function's
canonical op name with a rule; every later `amp.initialize` adds it to the policy it converts the
models with (``policy.set_op(op, rule)``), so the op is classified LOWER (half), FP32 (float) or
PROMOTE (promote) in the graph and the report says why. As in Apex, register before calling
``amp.initialize``; registrations apply at O1, O2 and O3 (O0 stays the identity)::

    >>> import torch
    >>> register_float_function(torch, "einsum")
    >>> registered_functions()["einsum"]
    <Rule.FP32: 'fp32'>
    >>> clear_registered_functions()

The tracer keeps calls of builtin and extension functions as single nodes, so a registered C/CUDA
extension function is cast as a unit; a Python function is traced through unless it is made a
leaf with ``torch.fx.wrap``, and then its inner ops follow their own rules.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from amp_fx.core.op_lists import canonical_op_name, is_known_op, register_op
from amp_fx.core.policy import Policy, Rule

logger = logging.getLogger("amp_fx.amp")

# canonical op name -> rule, in registration order (a later registration of the same op wins).
_REGISTERED: dict[str, Rule] = {}


def _register(module: ModuleType | Any, name: str, rule: Rule) -> None:
    if not isinstance(name, str):
        raise TypeError(f"the function name must be a str such as 'einsum', got {name!r}")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}: pass the module that defines it")
    op = canonical_op_name(name)
    if not is_known_op(op):
        register_op(op)
    _REGISTERED.pop(op, None)
    _REGISTERED[op] = rule
    logger.debug(
        "registered %s.%s as op %r with rule %s", getattr(module, "__name__", module), name, op, rule.name
    )


def register_half_function(module: ModuleType | Any, function_name: str) -> None:
    """Run ``module.function_name`` in low precision (fp16/bf16) in models converted afterwards.

    >>> import torch
    >>> register_half_function(torch, "einsum"); clear_registered_functions()
    """
    _register(module, function_name, Rule.LOWER)


def register_float_function(module: ModuleType | Any, function_name: str) -> None:
    """Run ``module.function_name`` in FP32 in models converted afterwards.

    >>> import torch
    >>> register_float_function(torch.nn.functional, "gelu"); clear_registered_functions()
    """
    _register(module, function_name, Rule.FP32)


def register_promote_function(module: ModuleType | Any, function_name: str) -> None:
    """Run ``module.function_name`` in the widest dtype of its inputs in models converted afterwards.

    >>> import torch
    >>> register_promote_function(torch, "cat"); clear_registered_functions()
    """
    _register(module, function_name, Rule.PROMOTE)


def registered_functions() -> dict[str, Rule]:
    """The registrations so far: canonical op name -> rule."""
    return dict(_REGISTERED)


def clear_registered_functions() -> None:
    """Forget every registration (Apex had no way back; useful in tests and notebooks)."""
    _REGISTERED.clear()


def apply_registered_functions(policy: Policy) -> Policy:
    """Add the registrations to `policy` as op overrides (in place; returned for chaining)."""
    if not policy.level.lowers_precision:
        return policy  # a level that lowers nothing stays the identity
    for op, rule in _REGISTERED.items():
        policy.set_op(op, rule)
    return policy
