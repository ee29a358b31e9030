"""FP32 losses that read low-precision logits: `fp32_cross_entropy`, and `linear_cross_entropy`
(a language model's head and loss as one call).

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
``torch.compile(fullgraph=True)`` without graph breaks; eager calls skip the custom ops' dispatch
(`amp_fx.ops.dispatch.fused_op`). They run the Triton kernels on CUDA tensors and the pure-torch
reference elsewhere (``amp_fx.kernels.implementation_for``).

`linear_cross_entropy` goes one step further for logits made by a linear layer, under
torch.compile: the custom op ``amp_fx::linear_cross_entropy_rows`` (input, weight, bias, target,
ignore_index) -> (losses, grad_rows) computes the loss and writes the unscaled gradient softmax -
onehot over the logits in the same kernel (``cross_entropy_forward_with_grad``), so the backward
is only matmuls on that saved gradient. Plain eager calls run the linear layer and
`fp32_cross_entropy`, which measured faster there.

One difference from torch: a class index outside [0, C) that is not ``ignore_index`` makes that
row's loss (and so a mean or sum) NaN instead of raising, since checking it would need a host
synchronization.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from amp_fx.kernels.arguments import KERNEL_DTYPES
from amp_fx.ops.dispatch import fused_op, is_eager, is_traced_backward
from amp_fx.ops.head_matmuls import (
    mask_padding,
    matmul_fp32,
    padded_class_count,
    padded_classes,
    padded_target,
)

__all__ = [
    "fp32_cross_entropy",
    "cross_entropy_rows",
    "cross_entropy_rows_backward",
    "cross_entropy_rows_backward_",
    "linear_cross_entropy",
    "linear_cross_entropy_rows",
    "linear_cross_entropy_grads",
]

_FUSED_REDUCTIONS = ("mean", "sum", "none")


@fused_op("amp_fx::cross_entropy_rows")
def cross_entropy_rows(
    logits: Tensor, target: Tensor, ignore_index: int, grad_into_logits: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-row FP32 cross-entropy of 2-D ``logits`` (fp16, bf16 or fp32) against int64 class
    indices: ``(losses, lse)``, both float32 (N,) (the kernel contract of
    ``amp_fx.kernels.cross_entropy``). With ``grad_into_logits`` (and contiguous logits) the
    backward writes the gradient over the logits (`cross_entropy_rows_backward_`) instead of into a
    new tensor."""
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


@fused_op("amp_fx::cross_entropy_rows_backward")
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


@fused_op("amp_fx::cross_entropy_rows_backward_", mutates_args=("logits",))
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
        and input.dtype in KERNEL_DTYPES
        and input.shape[1] > 0
        and target.dim() == 1
        and target.dtype == torch.int64
        and target.shape[0] == input.shape[0]
        and target.device == input.device
        and size_average is None
        and reduce is None
        and _loss_options_fused(weight, ignore_index, reduction, label_smoothing)
    )


def _loss_options_fused(
    class_weight: Tensor | None, ignore_index: int, reduction: str, label_smoothing: float
) -> bool:
    """The loss options the kernels compute (shared by both fused losses): no class weights, no
    label smoothing, a mean, sum or no reduction, an int ignore_index."""
    return (
        class_weight is None
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
    return _reduce(losses, target, ignore_index, reduction)


def _reduce(losses: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """Per-row losses reduced as F.cross_entropy reduces them ("none" keeps the target's shape)."""
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    # torch's mean divides by the number of rows not ignored: 0 / 0 = NaN when all are.
    return losses.sum() / (target != ignore_index).sum()


# ---------------------------------------------------------------------------------------------
# Linear layer + cross-entropy as one call: `linear_cross_entropy` (one op under torch.compile).
# ---------------------------------------------------------------------------------------------


def linear_cross_entropy_grads(
    grad_losses: Tensor,
    grad_rows: Tensor,
    input: Tensor,
    weight: Tensor,
    bias_dtype: torch.dtype | None,
    needs_input_grad: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of ``losses = cross_entropy_rows(input @ weight.T + bias)`` w.r.t. (input, weight,
    bias), from the unscaled gradient ``grad_rows = softmax - onehot`` (N, V') that
    `cross_entropy_forward_with_grad` left in the logits' buffer and the upstream per-row gradient
    ``grad_losses`` = r (N,), float32 (an expanded scalar for a sum or a mean). V' is the weight's
    V classes padded as `linear_cross_entropy_rows` pads them (`padded_classes`; the padding's
    columns are 0), so the matmuls run on aligned rows. The [N, V'] tensor is only read by
    matmuls; r is applied to their smaller outputs, in float32, rounded once::

        grad_input  = r[:, None] * (G @ W)
        grad_weight = s * (G.T @ round(h * (r / s)[:, None]))      s = max |r|
        grad_bias   = s * (G.T @ round(r / s))

    Why the scale s for grad_weight: ``G.T @ h`` unscaled can exceed fp16's range (65504) when a
    frequent class sums thousands of rows of h, although r * (G.T @ h) is small (r = 1/N for a mean
    without loss scaling): that overflow would not depend on the loss scale, so a dynamic scaler
    would skip every step. Scaling h by r first overflows instead when r is large (a loss scale of
    65536 over one row). With r / s in [-1, 1] the rounded matrix is never larger than h, the
    matmul's output is float32, and s is applied before the one rounding to the weight's dtype; for
    a sum or a mean r / s is exactly 1 and ``round(h * 1)`` is h. (A row whose r is below
    ~1e-5 of the largest may lose precision to fp16's subnormals: its share of the product is as
    small.) An all-zero r gives zero gradients, not 0 / 0.
    """
    grad_input = grad_weight = grad_bias = None
    num_classes = weight.shape[0]
    if needs_input_grad[0]:
        padded_weight, _ = padded_classes(weight, None)
        grad_input = (matmul_fp32(grad_rows, padded_weight) * grad_losses[:, None]).to(input.dtype)
    if needs_input_grad[1] or (needs_input_grad[2] and bias_dtype is not None):
        # amax of no rows raises; with no rows the gradients are zeros whatever the scale.
        largest = grad_losses.abs().amax() if grad_losses.numel() > 0 else grad_losses.new_zeros(())
        scale = torch.where(largest > 0, largest, torch.ones_like(largest))
        unit = grad_losses / scale
        if needs_input_grad[1]:
            scaled_input = (input * unit[:, None]).to(input.dtype)
            product = matmul_fp32(grad_rows.t(), scaled_input)[:num_classes]
            grad_weight = (product * scale).to(weight.dtype)
        if needs_input_grad[2] and bias_dtype is not None:
            unit_column = unit.to(grad_rows.dtype)[:, None]
            grad_bias = (matmul_fp32(grad_rows.t(), unit_column)[:num_classes, 0] * scale).to(bias_dtype)
    return grad_input, grad_weight, grad_bias


@fused_op("amp_fx::linear_cross_entropy_rows")
def linear_cross_entropy_rows(
    input: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Per-row FP32 cross-entropy of ``F.linear(input, weight, bias)`` (input (N, d), weight
    (V, d)) against int64 class indices: ``(losses, grad_rows)``, losses float32 (N,) and
    grad_rows the unscaled gradient softmax - onehot (N, V') in the input's dtype, computed in the
    forward into the logits' buffer (`cross_entropy_forward_with_grad`). Functional from outside:
    the logits are allocated here and come back as grad_rows.

    The classes are padded to 16 bytes a row (V' = `padded_class_count`, zero columns of
    grad_rows past V), as Inductor pads the matmuls it compiles: this op is opaque to it, and
    cuBLAS runs unaligned products (GPT-2's 50257 classes) several times slower."""
    from amp_fx.kernels import implementation_for

    num_classes = weight.shape[0]
    weight, bias = padded_classes(weight, bias)
    target = padded_target(target, num_classes, weight.shape[0], ignore_index)
    logits = F.linear(input, weight, bias).contiguous()
    mask_padding(logits, num_classes)
    losses = implementation_for([logits]).cross_entropy_forward_with_grad(logits, target, ignore_index)
    return losses, logits


@linear_cross_entropy_rows.register_fake
def _linear_cross_entropy_rows_fake(
    input: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor]:
    num_rows, num_classes = input.shape[0], padded_class_count(weight.shape[0], weight.dtype)
    return input.new_empty((num_rows,), dtype=torch.float32), input.new_empty((num_rows, num_classes))


def _linear_setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    input, weight, bias, _target, _ignore_index = inputs
    _, grad_rows = output
    ctx.save_for_backward(input, weight, grad_rows)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(grad_rows)


@once_differentiable  # grad_rows is a constant of the backward: a second derivative would be wrong
def _linear_backward(ctx, grad_losses: Tensor, grad_grad_rows: Tensor | None) -> tuple:
    input, weight, grad_rows = ctx.saved_tensors
    # Plain torch math on every path: under torch.compile Inductor fuses the scalings into the
    # matmuls' neighbours; run eagerly (the op called directly) it is two or three cuBLAS calls and
    # small elementwise passes.
    grads = linear_cross_entropy_grads(
        grad_losses, grad_rows, input, weight, ctx.bias_dtype, tuple(ctx.needs_input_grad[:3])
    )
    return (*grads, None, None)


linear_cross_entropy_rows.register_autograd(_linear_backward, setup_context=_linear_setup_context)


def _linear_runs_fused(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    class_weight: Tensor | None,
) -> bool:
    """Whether the fused op computes this call: dtypes, ranks, shapes, devices and Python values
    only, so torch.compile decides it while tracing."""
    # Imported on first use, as the kernels are.
    from amp_fx.kernels.cross_entropy.arguments import linear_head_fits

    return (
        linear_head_fits(input, weight, bias, target)
        and input.dim() >= 2
        and target.shape == input.shape[:-1]
        and _loss_options_fused(class_weight, ignore_index, reduction, label_smoothing)
    )


def linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Tensor | None = None,
) -> Tensor:
    """A language model's head and loss in one: ``F.cross_entropy(F.linear(input, weight,
    bias).float(), target, weight=class_weight, ignore_index=ignore_index, reduction=reduction,
    label_smoothing=label_smoothing)`` in value, a float32 loss. Leading dimensions are rows:
    input (*, d) with target (*) is computed as input.reshape(-1, d), target.reshape(-1), and
    reduction="none" returns the target's shape.

    Fused when input, weight (V, d) and bias (V,) share one dtype (fp16, bf16 or fp32) and device,
    target holds int64 class indices of shape input.shape[:-1], with no class_weight, no
    label_smoothing and reduction "mean", "sum" or "none". Under torch.compile (or another tracer)
    a fused call is one op, `linear_cross_entropy_rows`: the matmul (torch's) and one kernel that
    computes each row's loss and writes the gradient for an upstream gradient of 1, softmax -
    onehot, rounded once to the input's dtype, over the logits
    (`amp_fx.kernels.reference.cross_entropy_forward_with_grad`). Its backward never reads the
    (rows, V) tensor elementwise: it multiplies it into the matmuls' gradients and applies the
    real upstream gradient to their outputs (`linear_cross_entropy_grads` says how, and why
    grad_weight cannot overflow where the unfused path does not). Against the unfused path the
    [rows, V] backward pass (a read of the logits and a write of their gradient) is gone, and no
    second logits-sized buffer is ever allocated. The gradients differ from it by the rounding of
    G instead of r * G: the same number of roundings. Eagerly, a fused call is the linear layer and
    `fp32_cross_entropy` with ``grad_into_input=True`` (one loss kernel each way, the gradient
    written over the logits), which measured faster than the op there.

    Any other call returns exactly the torch expression above (and its errors). Unlike torch, a
    fused call does not raise for a target outside [0, C) that is not ignore_index: that row's loss
    is NaN, and so are the weight's and bias' gradients.

    Example:
        >>> h = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
        >>> head = torch.randn(50, 16, dtype=torch.bfloat16, requires_grad=True)
        >>> target = torch.randint(0, 50, (6,))
        >>> loss = linear_cross_entropy(h, head, None, target)
        >>> loss.dtype
        torch.float32
        >>> loss.backward(); head.grad.dtype
        torch.bfloat16
        >>> expected = F.cross_entropy(F.linear(h, head).float(), target)
        >>> torch.allclose(loss, expected)
        True
    """
    if not _linear_runs_fused(
        input, weight, bias, target, ignore_index, reduction, label_smoothing, class_weight
    ):
        rows = (
            isinstance(input, Tensor)
            and isinstance(target, Tensor)
            and input.dim() > 2
            and target.dim() == input.dim() - 1
        )
        logits = F.linear(input, weight, bias)
        if rows:
            logits, flat_target = logits.flatten(0, -2), target.flatten()
        else:
            flat_target = target
        loss = F.cross_entropy(
            logits.float(),
            flat_target,
            weight=class_weight,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
        )
        return loss.reshape(target.shape) if rows and reduction == "none" else loss
    rows_input = input.reshape(-1, input.shape[-1])
    rows_target = target.reshape(-1)
    if not is_eager(input):
        losses, _ = linear_cross_entropy_rows(rows_input, weight, bias, rows_target, ignore_index)
        return _reduce(losses, target, ignore_index, reduction)
    # Eagerly: the linear layer, then the fused loss whose backward writes the gradient over the
    # logits (nothing else reads them). On an H200 that is 0.2 ms faster per GPT-2 step than the
    # op above, whose backward matmuls have float32 outputs to scale (BENCHMARKS.md, linear head).
    loss = fp32_cross_entropy(
        F.linear(rows_input, weight, bias),
        rows_target,
        ignore_index=ignore_index,
        reduction=reduction,
        grad_into_input=True,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
