"""Which implementation a fused op's call takes, from how it is being run.

amp_fx's fused ops have three paths: plain eager tensors call the implementation directly (through
a ``torch.autograd.Function`` when autograd records the call); tracers (torch.compile, torch.export,
dispatch modes, fake or functional tensors) get the ``torch.library`` custom op, which has a fake
implementation and shows in their graphs as one op; and a backward that torch.compile traces is
plain torch math, which Inductor fuses with its neighbours.

The custom op's own Python dispatch (schema checks, the autograd wrapper, a redispatch below
autograd, Dynamo's disable wrapper) costs tens of microseconds a call: on a small model, more than
the kernels. `fused_op` defines an op once, its implementation, fake and autograd, and gives a
callable that takes the direct path where it can (`is_eager`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from amp_fx.kernels import kernels_run_for

__all__ = ["FusedOp", "fused_op", "gives_expression", "is_eager", "is_traced_backward"]

# What an eager call's tensors are: a Parameter is a Tensor to the dispatcher. Subclasses with a
# dispatch of their own (fake, functional, DTensor) are not, and take the custom op.
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def is_eager(*tensors: object) -> bool:
    """Whether a call on these arguments runs eagerly: not traced by torch.compile or torch.export,
    no dispatch mode active (FunctionalTensor, fake tensor or tracing modes need the custom ops'
    fake implementations), and every tensor among them a plain Tensor or Parameter (arguments that
    are not tensors are ignored).

    Example:
        >>> is_eager(torch.ones(2), torch.nn.Parameter(torch.ones(2)), None, 1e-6)
        True
    """
    return _eager_and_recorded(tensors)[0]


def _eager_and_recorded(arguments: Iterable[object]) -> tuple[bool, bool]:
    """(`is_eager`, whether autograd records the call) in one pass over a call's arguments: every
    call of a fused op pays for it."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False, False
    requires_grad = False
    for argument in arguments:
        if isinstance(argument, Tensor):
            if type(argument) not in _PLAIN_TENSOR_TYPES:
                return False, False
            requires_grad = requires_grad or argument.requires_grad
    return True, requires_grad and torch.is_grad_enabled()


def gives_expression(tensor: Tensor) -> bool:
    """Whether a fused norm, activation or rotary call on ``tensor`` computes its torch expression
    rather than its kernels: while torch.compile's Dynamo traces it (Inductor fuses the expression
    with its neighbours, the bias add, dropout and residual add before a norm, which it cannot do
    across an opaque kernel call), and in an eager call where the kernels would be their pure-torch
    reference (a CPU: `amp_fx.kernels.kernels_run_for`). Other tracers (torch.export, fake
    tensors) get the custom op.

    Example:
        >>> gives_expression(torch.ones(2))  # eager, on a CPU
        True
    """
    if torch.compiler.is_dynamo_compiling():
        return True
    return not kernels_run_for(tensor) and is_eager(tensor)


def is_traced_backward(saved: Tensor) -> bool:
    """Whether a custom op's backward, given one of its saved tensors, is being traced by
    torch.compile: AOT autograd traces it with functional tensors, and ``is_compiling()`` is False
    there on torch 2.11.

    Example:
        >>> is_traced_backward(torch.ones(2))
        False
    """
    return torch.compiler.is_compiling() or isinstance(saved, FunctionalTensor)


class FusedOp:
    """A fused op: the ``torch.library`` custom op ``op`` for tracers, and for eager calls its
    implementation called directly, through a ``torch.autograd.Function`` made of the op's
    ``setup_context`` and ``backward`` when autograd records the call. Both paths compute the same
    thing with the same autograd; the direct one skips the custom op's dispatch. Made by `fused_op`.
    """

    def __init__(self, name: str, implementation: Callable[..., Any], mutates_args: Sequence[str]) -> None:
        self.name = name
        self.op = torch.library.custom_op(name, implementation, mutates_args=tuple(mutates_args))
        self.implementation = implementation
        self._signature = inspect.signature(implementation)
        self._arity = len(self._signature.parameters)
        # The positions of the arguments the op writes, whose version counters a direct call
        # bumps as the custom op does (a Triton kernel's write does not).
        self._mutated = tuple(i for i, arg in enumerate(self._signature.parameters) if arg in mutates_args)
        self._function: type[torch.autograd.Function] | None = None

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """The op's fake implementation (``CustomOpDef.register_fake``); usable as a decorator."""
        self.op.register_fake(fake)
        return fake

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        """The op's autograd (``CustomOpDef.register_autograd``), and the eager path's Function.
        Only for ops that write none of their arguments."""
        if self._mutated:
            raise ValueError(f"{self.name} writes its arguments; fused_op gives autograd to functional ops")
        self.op.register_autograd(backward, setup_context=setup_context)
        implementation = self.implementation

        # A forward that takes ctx, rather than a separate setup_context: Function.apply binds
        # the arguments to forward's signature with inspect on every call of the latter kind.
        def forward(ctx, *args: Any) -> Any:
            output = implementation(*args)
            setup_context(ctx, args, output)
            return output

        self._function = type(
            f"Eager_{self.name.replace('::', '_')}",
            (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(backward)},
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        eager, records_autograd = _eager_and_recorded((*args, *kwargs.values()) if kwargs else args)
        # An op without autograd called where autograd records (a double backward) takes the
        # custom op too, which raises as it always did rather than give no gradient.
        if not eager or (records_autograd and self._function is None):
            return self.op(*args, **kwargs)
        if not records_autograd:
            output = self.implementation(*args, **kwargs)
            if self._mutated:
                self._mark_written(args, kwargs)
            return output
        if kwargs or len(args) != self._arity:
            # setup_context reads every argument positionally, as the custom op passes them.
            bound = self._signature.bind(*args, **kwargs)
            bound.apply_defaults()
            args = bound.args
        return self._function.apply(*args)

    def _mark_written(self, args: tuple, kwargs: dict[str, Any]) -> None:
        names = list(self._signature.parameters)
        for i in self._mutated:
            tensor = args[i] if i < len(args) else kwargs[names[i]]
            torch.autograd.graph.increment_version(tensor)

    def __repr__(self) -> str:
        return f"FusedOp({self.name})"


def fused_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable[[Callable[..., Any]], FusedOp]:
    """Decorator: the function as the implementation of the custom op ``name`` (its schema from
    the type hints, as ``torch.library.custom_op`` infers it), returned as a `FusedOp` whose eager
    calls skip the custom op's dispatch. Register the fake implementation and autograd on it as on
    the custom op; ``.op`` is the custom op itself (``torch.library.opcheck(f.op, ...)``).

    Example:
        >>> @fused_op("amp_fx_doc::scaled")
        ... def scaled(x: Tensor, factor: float) -> Tensor:
        ...     return x * factor
        >>> _ = scaled.register_fake(lambda x, factor: torch.empty_like(x))
        >>> scaled.register_autograd(
        ...     lambda ctx, grad: (grad * ctx.factor, None),
        ...     setup_context=lambda ctx, inputs, output: setattr(ctx, "factor", inputs[1]),
        ... )
        >>> x = torch.ones(2, requires_grad=True)
        >>> scaled(x, 3.0).sum().backward(); x.grad
        tensor([3., 3.])
        >>> torch.ops.amp_fx_doc.scaled(x, 2.0)  # the custom op, as tracers see it
        tensor([2., 2.], grad_fn=<...>)
    """

    def wrap(implementation: Callable[..., Any]) -> FusedOp:
        return FusedOp(name, implementation, mutates_args)

    return wrap
