"""FP32 norms that read low-precision input: `rms_norm_fp32`, `layer_norm_fp32`, and the residual
add before either (`add_rms_norm_fp32`, `add_layer_norm_fp32`).

At O2, as under torch.autocast, a transformer's norms run in fp32 on an fp32 residual stream: a
Llama RMSNorm is ``x.to(float32)``, pow, mean, add, rsqrt, mul, a cast, the weight's mul, and then
amp_fx's casts of the output to bf16 for the next matmuls, each a pass over the activations, forward
and backward. These functions compute the same chain in one kernel each way
(``amp_fx.kernels.norms``): the input read once in its own dtype, fp32 math, each output written
once in the dtype the chain wrote (or the one its casts asked for), weight gradients in fp32 when
the weights are. `amp_fx.passes.fuse_norms` puts them in place of the chains it recognizes.

Each function's value is a torch expression, written in its docstring; calls the kernels do not
compute (other dtypes, a weight that is not a vector of the row's width, a residual that
broadcasts) return exactly that expression. The kernels are wrapped as the custom ops
``amp_fx::fused_norm`` and ``amp_fx::fused_norm_backward``, with fake implementations and
autograd, so the functions work under autograd and compile under ``torch.compile`` and
``torch.export`` as one op; eager calls skip the custom ops' dispatch
(`amp_fx.ops.dispatch.fused_op`). They run the Triton kernels on CUDA tensors; an eager call on a CPU
computes the function's torch expression (`amp_fx.kernels.kernels_run_for`). Under `amp_fx.watch` the forward
kernel records the range statistics of the output and the sum it writes
(`amp_fx.ops.range_record.kernel_record`).

    >>> x = torch.randn(4, 64, dtype=torch.bfloat16)
    >>> y = rms_norm_fp32(x, torch.ones(64), 1e-6)
    >>> y.dtype, torch.allclose(y, x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
    (torch.float32, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# amp_fx.kernels loads Triton only when a CUDA tensor's kernels are asked for.
from amp_fx.kernels import implementation_for, reference
from amp_fx.kernels.arguments import KERNEL_DTYPES
from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.ops.dispatch import fused_op, gives_expression, is_traced_backward
from amp_fx.ops.outputs import reshaped_output
from amp_fx.ops.range_record import kernel_record, records_in_kernel

__all__ = [
    "add_layer_norm_fp32",
    "add_rms_norm_fp32",
    "fused_norm",
    "fused_norm_backward",
    "layer_norm_fp32",
    "rms_norm_fp32",
]


def _implementation(x: Tensor):
    """The kernels for ``x``: Triton on CUDA, the reference elsewhere and for rows wider than the
    Triton kernels hold."""
    kernels = implementation_for([x])
    if kernels is not reference and x.shape[-1] > _max_triton_width():
        return reference
    return kernels


def _max_triton_width() -> int:
    from amp_fx.kernels.norms.triton import MAX_WIDTH

    return MAX_WIDTH


def _rows(tensor: Tensor, width: int) -> Tensor:
    """``tensor`` as (rows, width) with contiguous rows (a view where it can be)."""
    rows = tensor if tensor.dim() == 2 else tensor.reshape(-1, width)
    return rows if rows.stride(1) == 1 or width == 1 else rows.contiguous()


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


@fused_op("amp_fx::fused_norm")
def fused_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    subtract_mean: bool,
    weight_offset: float,
    mid_dtype: torch.dtype | None,
    product_dtype: torch.dtype,
    out_dtype: torch.dtype,
    sum_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernel ``norm_forward`` of ``amp_fx.kernels.norms`` over the last dimension of ``x``
    (any leading shape; weight and bias vectors of that width): ``(out, summed, mean, rstd)``,
    ``summed`` empty without a residual and ``mean`` empty for RMSNorm."""
    width = x.shape[-1]
    out, summed, mean, rstd = _implementation(x).norm_forward(
        _rows(x, width), weight, bias, eps,
        residual=None if residual is None else _rows(residual, width), subtract_mean=subtract_mean,
        weight_offset=weight_offset, mid_dtype=mid_dtype, product_dtype=product_dtype,
        out_dtype=out_dtype, sum_dtype=sum_dtype, record=_kernel_record(x, residual, out_dtype, sum_dtype),
    )  # fmt: skip
    # Outputs of their own, not views of the kernels' (rows, width) buffers: the next op may
    # modify them in place.
    return (
        reshaped_output(out, x.shape),
        _empty(x) if summed is None else reshaped_output(summed, x.shape),
        _empty(x) if mean is None else mean,
        rstd,
    )


def _kernel_record(
    x: Tensor, residual: Tensor | None, out_dtype: torch.dtype, sum_dtype: torch.dtype | None
) -> KernelRecord | None:
    """The kernel's ``record`` where a watch asks for it (`amp_fx.ops.range_record.kernel_record`):
    out is the functions' result, or with a residual the second of (sum, out)."""
    if residual is None:
        return kernel_record(x.device, [(None, out_dtype), None])
    sum_dtype = sum_dtype or torch.promote_types(x.dtype, residual.dtype)
    return kernel_record(x.device, [(1, out_dtype), (0, sum_dtype)])


@fused_norm.register_fake
def _fused_norm_fake(
    x,
    residual,
    weight,
    bias,
    eps,
    subtract_mean,
    weight_offset,
    mid_dtype,
    product_dtype,
    out_dtype,
    sum_dtype,
):
    rows = math.prod(x.shape[:-1])
    summed = _empty(x)
    if residual is not None:
        summed = x.new_empty(x.shape, dtype=sum_dtype or torch.promote_types(x.dtype, residual.dtype))
    mean = x.new_empty((rows,), dtype=torch.float32) if subtract_mean else _empty(x)
    return x.new_empty(x.shape, dtype=out_dtype), summed, mean, x.new_empty((rows,), dtype=torch.float32)


@fused_op("amp_fx::fused_norm_backward")
def fused_norm_backward(
    grad_out: Tensor,
    grad_sum: Tensor | None,
    normalized: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    bias_dtype: torch.dtype | None,
    subtract_mean: bool,
    weight_offset: float,
    mid_dtype: torch.dtype | None,
    grad_dtype: torch.dtype,
    residual_grad_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernel ``norm_backward``: ``(grad_x, grad_residual, grad_weight, grad_bias)``, empty
    where there is no such input."""
    grads = _backward_kernel(
        _implementation(normalized), grad_out, grad_sum, normalized, weight, mean, rstd,
        bias_dtype=bias_dtype, subtract_mean=subtract_mean, weight_offset=weight_offset,
        mid_dtype=mid_dtype, grad_dtype=grad_dtype, residual_grad_dtype=residual_grad_dtype,
    )  # fmt: skip
    # The kernels' outputs alias no input and no other output (their contract): a custom op's
    # outputs may alias nothing.
    return tuple(_empty(normalized) if grad is None else grad for grad in grads)


def _backward_kernel(
    kernels, grad_out, grad_sum, normalized, weight, mean, rstd, *, subtract_mean, **options
) -> tuple[Tensor | None, ...]:
    """``kernels.norm_backward`` on tensors of any leading shape, grads shaped like them."""
    width, shape = normalized.shape[-1], normalized.shape
    grad_x, grad_residual, grad_weight, grad_bias = kernels.norm_backward(
        _rows(grad_out, width), None if grad_sum is None else _rows(grad_sum, width),
        _rows(normalized, width), weight, mean if subtract_mean else None, rstd,
        subtract_mean=subtract_mean, **options,
    )  # fmt: skip
    return (
        grad_x.reshape(shape),
        None if grad_residual is None else grad_residual.reshape(shape),
        grad_weight,
        grad_bias,
    )


@fused_norm_backward.register_fake
def _fused_norm_backward_fake(
    grad_out, grad_sum, normalized, weight, mean, rstd, bias_dtype, subtract_mean, weight_offset,
    mid_dtype, grad_dtype, residual_grad_dtype,
):  # fmt: skip
    width = normalized.shape[-1]
    return (
        normalized.new_empty(normalized.shape, dtype=grad_dtype),
        _empty(normalized)
        if residual_grad_dtype is None
        else normalized.new_empty(normalized.shape, dtype=residual_grad_dtype),
        _empty(normalized) if weight is None else weight.new_empty((width,)),
        _empty(normalized) if bias_dtype is None else normalized.new_empty((width,), dtype=bias_dtype),
    )


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    x, residual, weight, bias, _eps, subtract_mean, weight_offset, mid_dtype, *_ = inputs
    _out, summed, mean, rstd = output
    ctx.save_for_backward(summed if residual is not None else x, weight, mean, rstd)
    ctx.has_residual = residual is not None
    ctx.options = {
        "bias_dtype": None if bias is None else bias.dtype,
        "subtract_mean": subtract_mean,
        "weight_offset": weight_offset,
        "mid_dtype": mid_dtype,
        "grad_dtype": x.dtype,
        "residual_grad_dtype": None if residual is None else residual.dtype,
    }
    ctx.mark_non_differentiable(mean, rstd)
    # A sum nothing else reads (a final norm's) gets no gradient: the kernel then reads none,
    # rather than a tensor of zeros.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out: Tensor, grad_summed: Tensor | None, _grad_mean, _grad_rstd) -> tuple:
    normalized, weight, mean, rstd = ctx.saved_tensors
    grad_sum = grad_summed if ctx.has_residual else None
    if grad_out is None:  # only the sum is read
        grad_out = torch.zeros_like(normalized)
    tensors = (grad_out, grad_sum, normalized, weight, mean, rstd)
    # AOT autograd traces this backward with functional tensors: plain torch math there, which
    # the compiler can fuse with its neighbours.
    if is_traced_backward(normalized):
        grads = _backward_kernel(reference, *tensors, **ctx.options)
    else:
        grads = fused_norm_backward(*tensors, **ctx.options)
    grad_x, grad_residual, grad_weight, grad_bias = grads
    return (
        grad_x,
        grad_residual if ctx.has_residual else None,
        grad_weight if weight is not None else None,
        grad_bias if ctx.options["bias_dtype"] is not None else None,
        *(None,) * 7,
    )


fused_norm.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# What converted graphs call: each function is its torch expression, fused where the kernels apply.
# ---------------------------------------------------------------------------------------------


def _is_vector(vector: Tensor | None, width: int, x: Tensor) -> bool:
    return vector is None or (
        isinstance(vector, Tensor)
        and vector.dim() == 1
        and vector.shape[0] == width
        and vector.dtype in KERNEL_DTYPES
        and vector.device == x.device
    )


def _runs_fused(x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether the kernels compute this call: dtypes, shapes and devices only, so torch.compile
    decides it while tracing."""
    if not isinstance(x, Tensor) or gives_expression(x):
        return False
    if not (x.dim() >= 1 and x.shape[-1] > 0 and x.dtype in KERNEL_DTYPES):
        return False
    if residual is not None and not (
        isinstance(residual, Tensor)
        and residual.shape == x.shape
        and residual.dtype in KERNEL_DTYPES
        and residual.device == x.device
    ):
        return False
    width = x.shape[-1]
    return _is_vector(weight, width, x) and _is_vector(bias, width, x)


def _rms_product_dtype(weight: Tensor | None, mid_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of ``weight * normed`` in torch: normed is float32, or mid_dtype after the cast."""
    normed = mid_dtype or torch.float32
    return normed if weight is None else torch.promote_types(weight.dtype, normed)


def _rms_norm_expression(x, weight, eps, weight_offset, mid_dtype, out_dtype) -> Tensor:
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype)
    if weight is not None:
        y = (weight + weight_offset if weight_offset else weight) * y
    return y if out_dtype is None else y.to(out_dtype)


def _rms_norm(x, residual, weight, eps, weight_offset, mid_dtype, out_dtype, sum_dtype):
    product = _rms_product_dtype(weight, mid_dtype)
    out, summed, _, _ = fused_norm(
        x, residual, weight, None, float(eps), False, float(weight_offset), mid_dtype, product,
        out_dtype or product, sum_dtype,
    )  # fmt: skip
    return out, summed


def rms_norm_fp32(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    weight_offset: float = 0.0,
    mid_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """RMSNorm over the last dimension in fp32, as Hugging Face and others write it out::

        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        if mid_dtype is not None: y = y.to(mid_dtype)          # Llama's .to(input_dtype)
        if weight is not None: y = (weight + weight_offset) * y  # Gemma's (1 + w): offset 1
        return y if out_dtype is None else y.to(out_dtype)

    (``weight + weight_offset`` only with an offset.) Fused (one read of x, one write of the
    result, fp32 math with the expression's roundings) when x is fp16, bf16 or fp32 and weight a
    vector of x's last size; the gradient of x comes back in x's dtype, the weight's in its own.

    Example:
        >>> x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.ones(8, requires_grad=True)
        >>> y = rms_norm_fp32(x, w, 1e-6, mid_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
        >>> y.backward(torch.ones_like(y)); x.grad.dtype, w.grad.dtype
        (torch.bfloat16, torch.float32)
    """
    if not _runs_fused(x, None, weight, None):
        return _rms_norm_expression(x, weight, eps, weight_offset, mid_dtype, out_dtype)
    return _rms_norm(x, None, weight, eps, weight_offset, mid_dtype, out_dtype, None)[0]


def add_rms_norm_fp32(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    eps: float,
    *,
    weight_offset: float = 0.0,
    mid_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``(s, rms_norm_fp32(s, weight, eps, ...))`` with ``s = x + residual``: a residual stream's
    add and the norm after it in one pass (the sum in torch's promotion of the two, fp32 for an
    fp32 stream and a bf16 branch). Fused when `rms_norm_fp32` is and the two have one shape;
    x's gradient comes back in x's dtype, residual's in its own.

    Example:
        >>> stream, branch = torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16)
        >>> s, y = add_rms_norm_fp32(branch, stream, torch.ones(8), 1e-6, out_dtype=torch.bfloat16)
        >>> s.dtype, y.dtype, torch.equal(s, branch + stream)
        (torch.float32, torch.bfloat16, True)
    """
    if not _runs_fused(x, residual, weight, None):
        summed = x + residual
        return summed, _rms_norm_expression(summed, weight, eps, weight_offset, mid_dtype, out_dtype)
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    out, summed = _rms_norm(x, residual, weight, eps, weight_offset, mid_dtype, out_dtype, sum_dtype)
    return summed, out


def _layer_norm_arguments(x, normalized_shape, weight, bias) -> tuple | None:
    """(x, weight, bias) with the normalized dimensions flattened into one, or None when the
    kernels do not compute this call."""
    shape = tuple(normalized_shape)
    if not (isinstance(x, Tensor) and len(shape) >= 1 and tuple(x.shape[-len(shape) :]) == shape):
        return None
    for vector in (weight, bias):
        if vector is not None and not (isinstance(vector, Tensor) and tuple(vector.shape) == shape):
            return None
    width = math.prod(shape)
    flat = x.reshape(*x.shape[: x.dim() - len(shape)], width) if len(shape) > 1 else x
    return (
        flat,
        None if weight is None else weight.reshape(width),
        None if bias is None else bias.reshape(width),
    )


def _layer_norm_expression(x, normalized_shape, weight, bias, eps, out_dtype) -> Tensor:
    y = F.layer_norm(x.float(), normalized_shape, weight, bias, eps)
    return y if out_dtype is None else y.to(out_dtype)


def _layer_norm(x, residual, weight, bias, eps, out_dtype, sum_dtype):
    # F.layer_norm on fp32 input with these parameters writes float32 (fp32 parameters, as O2 keeps
    # them; the caller checks).
    out, summed, _, _ = fused_norm(
        x, residual, weight, bias, float(eps), True, 0.0, None, torch.float32, out_dtype or torch.float32,
        sum_dtype,
    )  # fmt: skip
    return out, summed


def _fp32_parameters(weight: Tensor | None, bias: Tensor | None) -> bool:
    return all(p is None or p.dtype == torch.float32 for p in (weight, bias))


def layer_norm_fp32(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``F.layer_norm(x.float(), normalized_shape, weight, bias, eps)``, then ``.to(out_dtype)``
    when given: what autocast and O2 compute for a LayerNorm on low-precision input. Fused (one
    read of x in its dtype, one write) when x is fp16, bf16 or fp32 and weight and bias are fp32
    of ``normalized_shape`` or None.

    Example:
        >>> x = torch.randn(2, 3, 8, dtype=torch.float16)
        >>> y = layer_norm_fp32(x, (8,), torch.ones(8), torch.zeros(8), out_dtype=torch.float16)
        >>> y.dtype, torch.allclose(y.float(), F.layer_norm(x.float(), (8,)), atol=1e-3)
        (torch.float16, True)
    """
    flat = _layer_norm_arguments(x, normalized_shape, weight, bias)
    if flat is None or not _fp32_parameters(weight, bias) or not _runs_fused(flat[0], None, *flat[1:]):
        return _layer_norm_expression(x, normalized_shape, weight, bias, eps, out_dtype)
    out, _ = _layer_norm(*flat[:1], None, *flat[1:], eps, out_dtype, None)
    return out.reshape(x.shape)


def add_layer_norm_fp32(
    x: Tensor,
    residual: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``(s, layer_norm_fp32(s, normalized_shape, weight, bias, eps, out_dtype=out_dtype))`` with
    ``s = x + residual``: GPT-2's residual add and the LayerNorm after it in one pass.

    Example:
        >>> stream, branch = torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16)
        >>> s, y = add_layer_norm_fp32(branch, stream, (8,), torch.ones(8), torch.zeros(8))
        >>> s.dtype, y.dtype, torch.allclose(y, F.layer_norm(branch + stream, (8,)), atol=1e-6)
        (torch.float32, torch.float32, True)
    """
    flat = _layer_norm_arguments(x, normalized_shape, weight, bias)
    residual_flat = _layer_norm_arguments(residual, normalized_shape, None, None)
    if (
        flat is None
        or residual_flat is None
        or not _fp32_parameters(weight, bias)
        or not _runs_fused(flat[0], residual_flat[0], *flat[1:])
    ):
        summed = x + residual
        return summed, _layer_norm_expression(summed, normalized_shape, weight, bias, eps, out_dtype)
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    out, summed = _layer_norm(flat[0], residual_flat[0], *flat[1:], eps, out_dtype, sum_dtype)
    return summed.reshape(x.shape), out.reshape(x.shape)


# A watched graph asks these functions' kernel to record the range statistics of what it writes.
records_in_kernel(rms_norm_fp32, add_rms_norm_fp32, layer_norm_fp32, add_layer_norm_fp32)
