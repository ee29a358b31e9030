"""FP32 losses that read low-precision logits: `fp32_cross_entropy`.

Under torch.autocast, and at amp_fx's O2, cross-entropy runs in FP32: the model's fp16/bf16
logits are cast to float32 first, ``F.cross_entropy(logits.float(), target)``. For a language
model that cast is the most expensive part of the loss: GPT-2 at 16 x 1024 tokens writes 3.3 GB
of float32 logits and runs log_softmax and its backward over them in float32.
`fp32_cross_entropy` computes the same float32 math straight from the low-precision logits: the
forward reads them once (online logsumexp, ``amp_fx.kernels.cross_entropy``), the backward writes
the gradient in their dtype, rounded once from float32, as the cast's backward rounds it. The
loss is float32 and equals the cast path's up to float32 summation order.

The kernels are wrapped as the custom ops ``amp_fx::cross_entropy_rows`` (logits, target,
ignore_index) -> (losses, lse) and ``amp_fx::cross_entropy_rows_backward``, with fake
implementations and autograd, so the loss works under autograd and compiles under
``torch.compile(fullgraph=True)`` without graph breaks. They run the Triton kernels on CUDA tensors
and the pure-torch reference elsewhere (``amp_fx.kernels.implementation_for``).

One difference from torch: a class index outside [0, C) that is not ``ignore_index`` makes that
row's loss (and so a mean or sum) NaN instead of raising, since checking it would need a host
synchronization.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from amp_fx.dispatch import is_traced_backward

__all__ = [
    "fp32_cross_entropy",
    "cross_entropy_rows",
    "cross_entropy_rows_backward",
    "cross_entropy_rows_backward_",
]

_FUSED_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FUSED_REDUCTIONS = ("mean", "sum", "none")


@torch.library.custom_op("amp_fx::cross_entropy_rows", mutates_args=())
def cross_entropy_rows(
    logits: Tensor, target: Tensor, ignore_index: int, grad_into_logits: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-row FP32 cross-entropy of 2-D ``logits`` (fp16, bf16 or fp32) against int64 class
    indices: ``(losses, lse)``, both float32 (N,); see ``amp_fx.kernels.reference``. With
    ``grad_into_logits`` (and contiguous logits) the backward writes the gradient over the logits
    (`cross_entropy_rows_backward_`) instead of into a new tensor."""
    # Imported on first use: convert imports this module, and Triton need not load until a loss runs.
    from amp_fx.kernels import implementation_for

    return implementation_for([logits]).cross_entropy_forward(logits, target, ignore_index)


@cross_entropy_rows.register_fake
def _cross_entropy_rows_fake(
    logits: Tensor, target: Tensor, ignore_index: int, grad_into_logits: bool = False
) -> tuple[Tensor, Tensor]:
    num_rows = logits.shape[0]
    return (
        logits.new_empty((num_rows,), dtype=torch.float32),
        logits.new_empty((num_rows,), dtype=torch.float32),
    )


@torch.library.custom_op("amp_fx::cross_entropy_rows_backward", mutates_args=())
def cross_entropy_rows_backward(
    grad_losses: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int
) -> Tensor:
    """Gradient of `cross_entropy_rows`' losses w.r.t. the logits, in the logits' dtype."""
    from amp_fx.kernels import implementation_for

    return implementation_for([logits]).cross_entropy_backward(grad_losses, logits, target, lse, ignore_index)


@cross_entropy_rows_backward.register_fake
def _cross_entropy_rows_backward_fake(
    grad_losses: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int
) -> Tensor:
    # The kernels allocate the gradient contiguous, whatever the logits' row stride.
    return logits.new_empty(logits.shape)


@torch.library.custom_op("amp_fx::cross_entropy_rows_backward_", mutates_args=("logits",))
def cross_entropy_rows_backward_(
    grad_losses: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int
) -> None:
    """`cross_entropy_rows_backward` written over the (contiguous) logits: no logits-sized buffer."""
    from amp_fx.kernels import implementation_for

    implementation_for([logits]).cross_entropy_backward(
        grad_losses, logits, target, lse, ignore_index, out=logits
    )


@cross_entropy_rows_backward_.register_fake
def _cross_entropy_rows_backward_fake_(
    grad_losses: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int
) -> None:
    return None


def _setup_context(ctx, inputs: tuple[Tensor, Tensor, int, bool], output: tuple[Tensor, Tensor]) -> None:
    logits, target, ignore_index, grad_into_logits = inputs
    _, lse = output
    ctx.save_for_backward(logits, target, lse)
    ctx.ignore_index = ignore_index
    ctx.grad_into_logits = grad_into_logits
    # lse is saved for the backward, not a loss: nothing differentiates through it.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_losses: Tensor, grad_lse: Tensor | None) -> tuple[Tensor | None, None, None, None]:
    logits, target, lse = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None
    # torch.compile traces this backward with functional tensors (is_compiling() is False then on
    # torch 2.11): there it is plain torch math, which Inductor fuses into one pass over the logits
    # and writes over their buffer when nothing else reads them (a donated saved tensor). A
    # mutating op here would make Inductor copy the logits first.
    if is_traced_backward(logits):
        from amp_fx.kernels import reference

        grad_logits = reference.cross_entropy_backward(grad_losses, logits, target, lse, ctx.ignore_index)
        return grad_logits, None, None, None
    if ctx.grad_into_logits and logits.is_contiguous():
        # Safe only because the caller promised nothing reads the logits after the loss; a second
        # backward through this graph (retain_graph) fails autograd's version check in eager mode.
        cross_entropy_rows_backward_(grad_losses, logits, target, lse, ctx.ignore_index)
        return logits, None, None, None
    grad_logits = cross_entropy_rows_backward(grad_losses, logits, target, lse, ctx.ignore_index)
    return grad_logits, None, None, None


cross_entropy_rows.register_autograd(_backward, setup_context=_setup_context)


def _runs_fused(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None,
    size_average: bool | None,
    ignore_index: int,
    reduce: bool | None,
    reduction: str,
    label_smoothing: float,
) -> bool:
    """Whether the fused op computes this call. Reads dtypes, ranks, devices and Python values only,
    so torch.compile decides it while tracing (no graph break, no data-dependent branch)."""
    return (
        isinstance(input, Tensor)
        and isinstance(target, Tensor)
        and input.dim() == 2
        and input.dtype in _FUSED_INPUT_DTYPES
        and input.shape[1] > 0
        and target.dim() == 1
        and target.dtype == torch.int64
        and target.shape[0] == input.shape[0]
        and target.device == input.device
        and weight is None
        and size_average is None
        and reduce is None
        and isinstance(reduction, str)
        and reduction in _FUSED_REDUCTIONS
        and isinstance(label_smoothing, (int, float))
        and label_smoothing == 0.0
        and isinstance(ignore_index, int)
        and not isinstance(ignore_index, bool)
    )


def fp32_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    grad_into_input: bool = False,
) -> Tensor:
    """``F.cross_entropy(input.float(), target, ...)`` (what torch.autocast computes), without the
    float32 copy of ``input``: same signature as ``F.cross_entropy``, a float32 loss.

    ``grad_into_input=True`` lets a fused backward write the gradient over ``input``'s memory,
    saving a logits-sized buffer at the memory peak of a language model's step. Only for logits
    that nothing reads after the loss (not returned, not saved by the op that made them, as a
    linear layer's output is not); `amp_fx.convert` sets it where the graph shows that. Under
    torch.compile the flag is not needed: the backward is traced as torch math and Inductor reuses
    the logits' buffer by itself when they are dead.

    Fused (one read of the logits, float32 math, the gradient written in ``input``'s dtype) when
    ``input`` is 2-D (rows, classes) fp16, bf16 or fp32, ``target`` holds int64 class indices (N,),
    and there is no ``weight``, no ``label_smoothing``, no legacy ``size_average``/``reduce`` and
    ``reduction`` is "mean", "sum" or "none". Any other call returns exactly
    ``F.cross_entropy(input.float(), target, ...)`` with the same arguments (and its errors).

    A "mean" over rows that are all ``ignore_index`` is NaN, as in torch. Unlike torch, a fused
    call does not raise for a target outside [0, C) that is not ``ignore_index``: that row's loss
    is NaN (raising would need a host synchronization).

    Example:
        >>> logits = torch.randn(8, 50, dtype=torch.bfloat16, requires_grad=True)
        >>> target = torch.randint(0, 50, (8,))
        >>> loss = fp32_cross_entropy(logits, target)
        >>> loss.dtype
        torch.float32
        >>> loss.backward(); logits.grad.dtype
        torch.bfloat16
        >>> expected = F.cross_entropy(logits.detach().float(), target)
        >>> torch.allclose(loss, expected)
        True
    """
    if not _runs_fused(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing):
        return F.cross_entropy(
            input.float() if isinstance(input, Tensor) else input,
            target,
            weight=weight,
            size_average=size_average,
            ignore_index=ignore_index,
            reduce=reduce,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )
    losses, _ = cross_entropy_rows(input, target, ignore_index, grad_into_input)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    # torch's mean divides by the number of rows not ignored: 0 / 0 = NaN when all are.
    return losses.sum() / (target != ignore_index).sum()
