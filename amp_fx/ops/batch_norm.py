"""Fused training-mode BatchNorm + residual add + ReLU: the op `batch_norm_act` and the module
`FusedBatchNormAct` that converted graphs call.

A ResNet block ends in ``relu(bn(conv(x)) + identity)``; from torch parts that is cuDNN's BatchNorm,
an add and a ReLU, each a pass over the activations, forward and backward (on an H200 at batch 256,
58% of an eager ResNet-50 step at O2 before this fusion; BENCHMARKS.md). `batch_norm_act` computes
the same value with two passes forward and two backward (``amp_fx.kernels.batch_norm``): the
statistics are read from x once, and the output, the normalization's input gradient and the
residual's gradient are each written once, in the input's dtype, rounded once from fp32 math.

Eager calls go through a ``torch.autograd.Function`` that calls the kernel functions directly
(``amp_fx.kernels.implementation_for``: the Triton kernels on CUDA tensors, the pure-torch
reference elsewhere), which also update the running statistics in place: per call, the host does
one metadata check, one autograd node and three kernel launches each way.

The same kernels are also wrapped as the custom ops ``amp_fx::batch_norm_act_forward`` (input,
weight, bias, residual, eps, relu) -> (out, mean, invstd, var) and
``amp_fx::batch_norm_act_backward``, with fake implementations and autograd, for callers that trace
with functional or fake tensors (torch.export, make_fx, dispatch modes): the ops are functional,
so on that path `batch_norm_act` updates the running statistics with torch ops from the (mean,
var) the forward returns.

Under torch.compile `batch_norm_act` is plain torch (``F.batch_norm`` + add + ``F.relu``):
Inductor fuses those itself, and an opaque op would stop it.

`FusedBatchNormAct` is what `amp_fx.passes.fuse_batch_norm` puts in place of ``relu(bn(x))`` or
``relu(bn(x) + identity)`` (ResNet's pattern). It owns no parameters: it calls the BatchNorm module
it replaces, which stays where it was in the model (same state_dict keys, same train/eval switch,
same buffers). In training mode, on an input of at least `MIN_FUSED_ELEMENTS` elements, it runs
`batch_norm_act`; otherwise, and for everything `batch_norm_act` does not fuse, exactly what the
three calls computed. The pass leaves BatchNorms and ReLU modules with hooks unfused, and a
BatchNorm given hooks later runs as a module (so they fire). It keeps calling the BatchNorm2d
object it was built with: replace modules (``nn.SyncBatchNorm.convert_sync_batchnorm``, conv-BN
folding) before ``amp_fx.convert``, not after.

    >>> bn = torch.nn.BatchNorm2d(8)
    >>> fused = FusedBatchNormAct(bn, "bn")
    >>> x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    >>> torch.allclose(fused(x), torch.relu(torch.nn.BatchNorm2d(8)(x)), atol=1e-6)
    True
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from amp_fx.kernels.arguments import KERNEL_DTYPES
from amp_fx.ops.dispatch import is_eager, is_traced_backward
from amp_fx.ops.module_hooks import has_forward_hooks

__all__ = [
    "MIN_FUSED_ELEMENTS",
    "FusedBatchNormAct",
    "batch_norm_act",
    "batch_norm_act_backward",
    "batch_norm_act_forward",
    "is_fusable_batch_norm",
]


@torch.library.custom_op("amp_fx::batch_norm_act_forward", mutates_args=())
def batch_norm_act_forward(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    relu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training-mode BatchNorm of ``input`` (+ ``residual``) (+ ReLU): ``(out, mean, invstd,
    var)``: the kernel contract of ``amp_fx.kernels.batch_norm``."""
    # Imported on first use: importing amp_fx must not load Triton.
    from amp_fx.kernels import implementation_for

    return implementation_for([input]).batch_norm_act_forward(input, weight, bias, residual, eps, relu)


@batch_norm_act_forward.register_fake
def _batch_norm_act_forward_fake(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    relu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    num_channels = input.shape[1]
    stats = [input.new_empty((num_channels,), dtype=torch.float32) for _ in range(3)]
    return (torch.empty_like(input), *stats)


@torch.library.custom_op("amp_fx::batch_norm_act_backward", mutates_args=())
def batch_norm_act_backward(
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    out: Tensor | None,
    has_residual: bool,
    relu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of `batch_norm_act_forward`: ``(grad_input, grad_weight, grad_bias,
    grad_residual)``, the kernel contract of ``amp_fx.kernels.batch_norm``."""
    from amp_fx.kernels import implementation_for

    return implementation_for([input]).batch_norm_act_backward(
        grad_out, input, weight, bias, mean, invstd, out, has_residual, relu
    )


@batch_norm_act_backward.register_fake
def _batch_norm_act_backward_fake(
    grad_out: Tensor,
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    invstd: Tensor,
    out: Tensor | None,
    has_residual: bool,
    relu: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    num_channels = input.shape[1]
    return (
        torch.empty_like(input),
        input.new_empty((num_channels,), dtype=torch.float32 if weight is None else weight.dtype),
        input.new_empty((num_channels,), dtype=torch.float32 if bias is None else bias.dtype),
        torch.empty_like(input) if has_residual else input.new_empty((0,)),
    )


def _output_for_backward(out: Tensor, residual: Tensor | None, relu: bool) -> Tensor | None:
    """The forward's output if the backward needs it, else None: the mask of a ReLU after a residual
    depends on the residual, so it is read from the output; without a residual the backward
    recomputes it from x and the statistics, and the output is not kept alive."""
    return out if relu and residual is not None else None


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    input, weight, bias, residual, _eps, relu = inputs
    out, mean, invstd, var = output
    ctx.has_residual = residual is not None
    ctx.relu = relu
    ctx.save_for_backward(input, weight, bias, mean, invstd, _output_for_backward(out, residual, relu))
    ctx.mark_non_differentiable(mean, invstd, var)


def _backward(
    ctx, grad_out: Tensor, grad_mean: Tensor | None, grad_invstd: Tensor | None, grad_var: Tensor | None
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, None, None]:
    input, weight, bias, mean, invstd, out = ctx.saved_tensors
    if not any(ctx.needs_input_grad[:4]):
        return None, None, None, None, None, None
    arguments = (grad_out, input, weight, bias, mean, invstd, out, ctx.has_residual, ctx.relu)
    # AOT autograd traces this backward with functional tensors (is_compiling() is False then on
    # torch 2.11): plain torch math there, which the compiler can fuse and see through.
    if is_traced_backward(input):
        from amp_fx.kernels import reference

        grads = reference.batch_norm_act_backward(*arguments)
    else:
        grads = batch_norm_act_backward(*arguments)
    grad_input, grad_weight, grad_bias, grad_residual = grads
    return (
        grad_input,
        grad_weight if weight is not None else None,
        grad_bias if bias is not None else None,
        grad_residual if ctx.has_residual else None,
        None,
        None,
    )


batch_norm_act_forward.register_autograd(_backward, setup_context=_setup_context)


def _is_channel_vector(tensor: Tensor | None, input: Tensor) -> bool:
    """A (C,) vector on the input's device, float32 or of the input's dtype (torch raises for other
    mixes, so those calls go to the torch expression and get its error)."""
    return (
        isinstance(tensor, Tensor)
        and tensor.dim() == 1
        and tensor.shape[0] == input.shape[1]
        and tensor.dtype in (input.dtype, torch.float32)
        and tensor.device == input.device
        and tensor.is_contiguous()
    )


def _runs_fused(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
    residual: Tensor | None,
    relu: bool,
) -> bool:
    """Whether the fused op computes this call. Reads dtypes, shapes, strides and Python values
    only (no tensor values, so no host synchronization); every call pays for it, so each property
    is read once."""
    if not (
        isinstance(input, Tensor)
        and input.dim() == 4
        and input.dtype in KERNEL_DTYPES
        and isinstance(momentum, (int, float))
        and isinstance(eps, (int, float))
        and isinstance(relu, bool)
    ):
        return False
    num_channels = input.shape[1]
    if not (
        num_channels > 0
        and input.numel() // num_channels > 1
        and input.is_contiguous(memory_format=torch.channels_last)
    ):
        return False
    device = input.device
    if residual is not None and not (
        isinstance(residual, Tensor)
        and residual.shape == input.shape
        and residual.dtype == input.dtype
        and residual.device == device
        and residual.is_contiguous(memory_format=torch.channels_last)
    ):
        return False
    if weight is not None and not _is_channel_vector(weight, input):
        return False
    if bias is not None and not _is_channel_vector(bias, input):
        return False
    if running_mean is None and running_var is None:
        return True
    # The kernels update both buffers in place, with one element type.
    return (
        _is_channel_vector(running_mean, input)
        and _is_channel_vector(running_var, input)
        and running_mean.dtype == running_var.dtype
    )


def _torch_expression(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
    residual: Tensor | None,
    relu: bool,
) -> Tensor:
    """What `batch_norm_act` computes, written with torch's functions."""
    out = F.batch_norm(
        input, running_mean, running_var, weight, bias, training=True, momentum=momentum, eps=eps
    )
    if residual is not None:
        out = out + residual
    return F.relu(out) if relu else out


class _BatchNormAct(torch.autograd.Function):
    """The eager path: the kernel functions called directly, without the custom ops' dispatch
    (their schema handling and fake-tensor machinery cost the host more than the kernels cost the
    GPU at ResNet sizes). Returns ``out`` only; the running statistics are updated in place by
    the forward kernels."""

    @staticmethod
    def forward(
        ctx,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        residual: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        momentum: float,
        eps: float,
        relu: bool,
        kernels,
    ) -> Tensor:
        out, mean, invstd, _ = kernels.batch_norm_act_forward(
            input,
            weight,
            bias,
            residual,
            eps,
            relu,
            running_mean=running_mean,
            running_var=running_var,
            momentum=momentum,
            validate=False,  # _runs_fused checked every argument
        )
        ctx.kernels = kernels
        ctx.has_residual = residual is not None
        ctx.relu = relu
        ctx.save_for_backward(input, weight, bias, mean, invstd, _output_for_backward(out, residual, relu))
        return out

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiable again: say so, not zero
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, bias, mean, invstd, out = ctx.saved_tensors
        grad_input, grad_weight, grad_bias, grad_residual = ctx.kernels.batch_norm_act_backward(
            grad_out, input, weight, bias, mean, invstd, out, ctx.has_residual, ctx.relu, validate=False
        )
        needs = ctx.needs_input_grad
        return (
            grad_input if needs[0] else None,
            grad_weight if needs[1] else None,
            grad_bias if needs[2] else None,
            grad_residual if needs[3] else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def batch_norm_act(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
    residual: Tensor | None = None,
    relu: bool = True,
) -> Tensor:
    """Training-mode BatchNorm over channel dim 1, then ``+ residual``, then ReLU, fused:
    ``F.relu(F.batch_norm(input, running_mean, running_var, weight, bias, training=True,
    momentum=momentum, eps=eps) + residual)`` in value, and the running statistics updated in place
    as F.batch_norm updates them (left alone when None).

    The normalization uses the batch statistics (biased variance), computed in fp32; the residual
    is added and the ReLU applied in fp32 and the output rounded once to ``input``'s dtype (torch
    rounds the normalized value before the add, so low-precision results may differ by a unit in
    the last place). ``weight`` / ``bias`` may be None, float32 while ``input`` is fp16/bf16 (O2
    keeps BatchNorm parameters in FP32), or of the input's dtype; their gradients come back in
    their own dtype, computed in fp32.

    Fused when ``input`` is a 4-D fp16/bf16/fp32 tensor contiguous in ``torch.channels_last`` with
    more than one value per channel, ``residual`` (if any) has its shape, dtype and layout, and the
    parameters and running statistics are (C,) vectors on its device. Any other call, and every
    call under torch.compile (where Inductor fuses the torch expression itself), computes the
    torch expression above, with its results and errors.

    Example:
        >>> bn = torch.nn.BatchNorm2d(8)
        >>> x = torch.randn(4, 8, 5, 5).to(memory_format=torch.channels_last)
        >>> identity = torch.randn(4, 8, 5, 5).to(memory_format=torch.channels_last)
        >>> y = batch_norm_act(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, 0.1, bn.eps,
        ...                    residual=identity)
        >>> expected = F.relu(torch.nn.BatchNorm2d(8)(x) + identity)
        >>> torch.allclose(y, expected, atol=1e-5)
        True
    """
    arguments = (input, weight, bias, running_mean, running_var, momentum, eps, residual, relu)
    if torch.compiler.is_compiling() or not _runs_fused(*arguments):
        return _torch_expression(*arguments)
    # Imported on first use: importing amp_fx must not load Triton.
    from amp_fx.kernels import implementation_for, reference

    if is_eager(input):
        kernels = implementation_for((input,))
        stats = (running_mean, running_var, float(momentum), float(eps))
        return _BatchNormAct.apply(input, weight, bias, residual, *stats, relu, kernels)
    out, mean, _, var = batch_norm_act_forward(input, weight, bias, residual, float(eps), relu)
    if running_mean is not None:
        reference.update_batch_norm_running_stats_(
            running_mean, running_var, mean, var, float(momentum), input.numel() // input.shape[1]
        )
    return out


# An eager fused call costs the host about three times torch's BatchNorm + add + ReLU (Triton
# launches), and an eager ResNet-50 step at O2 is close to host-bound; the GPU time the kernels save
# grows with the activation. On an H200 (ResNet-50 shapes, batch 256, fp16, CUDA graphs,
# 2026-11-30) the fused call of a BN -> [add] -> ReLU chain took 0.78-0.81x torch's GPU time from
# 2**26 elements up, and below that 0.69-1.29x, a few microseconds either way, so smaller calls run
# torch's ops.
MIN_FUSED_ELEMENTS = 2**26


def is_fusable_batch_norm(module: nn.Module) -> bool:
    """True for a plain BatchNorm2d (not a subclass with its own forward, not SyncBatchNorm)."""
    return isinstance(module, nn.BatchNorm2d) and type(module).forward is nn.BatchNorm2d.forward


class FusedBatchNormAct(nn.Module):
    """``relu(batch_norm(x) [+ residual])`` through the BatchNorm2d module `batch_norm`.

    Args:
        batch_norm: the BatchNorm2d module; referenced, not registered (its owner keeps it).
        name: its qualified name in the model (for passes that plan its parameters' dtype).
        relu: apply ReLU after the (optional) residual add.
    """

    # The op `amp_fx.core.module_ops.module_op` names it by: the policy decides it as a BatchNorm.
    amp_fx_op = "batch_norm"

    def __init__(self, batch_norm: nn.BatchNorm2d, name: str, relu: bool = True) -> None:
        super().__init__()
        if not is_fusable_batch_norm(batch_norm):
            raise TypeError(
                f"FusedBatchNormAct needs an nn.BatchNorm2d with torch's forward, got "
                f"{type(batch_norm).__name__}; leave other norms unfused"
            )
        # A tuple hides the module from nn.Module's registration: no duplicate state_dict keys.
        self._batch_norm = (batch_norm,)
        self.batch_norm_name = name
        self.relu = relu

    @property
    def batch_norm(self) -> nn.BatchNorm2d:
        return self._batch_norm[0]

    def extra_repr(self) -> str:
        return f"{self.batch_norm_name}: {self.batch_norm.extra_repr()}, relu={self.relu}"

    def _momentum(self) -> float:
        # nn.BatchNorm2d.forward's exponential_average_factor, counting the batch as it does.
        bn = self.batch_norm
        if not (bn.training and bn.track_running_stats) or bn.num_batches_tracked is None:
            return 0.0 if bn.momentum is None else bn.momentum
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # cumulative moving average (a host read, as in torch)
            return 1.0 / float(bn.num_batches_tracked)
        return bn.momentum

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        bn = self.batch_norm
        if has_forward_hooks(bn):
            # Hooks registered after convert: the module itself runs, so that they fire.
            return self._add_and_relu(bn(x), residual)
        bn._check_input_dim(x)
        momentum = self._momentum()
        uses_batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
        tracked = not bn.training or bn.track_running_stats
        running_mean = bn.running_mean if tracked else None
        running_var = bn.running_var if tracked else None
        if uses_batch_stats and x.numel() >= MIN_FUSED_ELEMENTS:
            return batch_norm_act(
                x, bn.weight, bn.bias, running_mean, running_var, momentum, bn.eps, residual, self.relu
            )
        y = F.batch_norm(x, running_mean, running_var, bn.weight, bn.bias, uses_batch_stats, momentum, bn.eps)
        return self._add_and_relu(y, residual)

    def _add_and_relu(self, y: Tensor, residual: Tensor | None) -> Tensor:
        if residual is not None:
            y = y + residual
        return F.relu(y) if self.relu else y
