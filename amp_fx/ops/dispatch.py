"""Which implementation a fused op's call takes, from how it is being run.

amp_fx's fused ops (`amp_fx.ops.cross_entropy`, `amp_fx.ops.batch_norm`, `amp_fx.ops.max_pool`) have three
paths: plain eager tensors call the kernels through a ``torch.autograd.Function`` (the least host time);
tracers (dispatch modes, fake or functional tensors) get the ``torch.library`` custom ops, which
have fake implementations; and a backward that torch.compile traces is plain torch math, which
Inductor fuses with its neighbours.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["compiler_fuses", "is_eager", "is_traced_backward"]


def is_eager(tensor: Tensor) -> bool:
    """A plain tensor with no dispatch mode active (no FunctionalTensor, fake tensor or tracing
    mode, which need the custom ops' fake implementations).

    Example:
        >>> is_eager(torch.ones(2))
        True
    """
    return type(tensor) is Tensor and _get_current_dispatch_mode() is None


def compiler_fuses() -> bool:
    """Whether torch.compile's Dynamo is tracing this call. The fused norm, activation and rotary
    ops then give their torch expression: Inductor fuses it with its neighbours (the bias add,
    dropout and residual add before a norm), which it cannot do across an opaque kernel call.

    Example:
        >>> compiler_fuses()
        False
    """
    return torch.compiler.is_dynamo_compiling()


def is_traced_backward(saved: Tensor) -> bool:
    """Whether a custom op's backward, given one of its saved tensors, is being traced by
    torch.compile: AOT autograd traces it with functional tensors, and ``is_compiling()`` is False
    there on torch 2.11.

    Example:
        >>> is_traced_backward(torch.ones(2))
        False
    """
    return torch.compiler.is_compiling() or isinstance(saved, FunctionalTensor)
