"""Fused RMSNorm / LayerNorm (with the residual add before them) over rows, computed in fp32.

What: the family's contract, ``amp_fx.kernels.norms``, which has the math.

Why fused: at O2, as under torch.autocast, a transformer's norms run in fp32 on an fp32 residual
stream. From torch parts a Llama RMSNorm after a residual add is the add (reads the fp32 stream
and the bf16 branch, writes the fp32 sum), a cast, pow, mean, add, rsqrt, two muls, and the casts
of the output to bf16 for the next matmuls: about ten passes over the activations forward and as
many backward. Here the forward reads the two inputs once and writes the sum and the normed output
once, in the dtypes the chain wrote; the backward reads the saved sum and the upstream gradients
once and writes each input's gradient once.

How: the forward runs one program per row, the whole row in registers (``BLOCK_SIZE`` the next
power of two of D): one reduction for the mean (LayerNorm), one for the mean square. The backward
runs a fixed number of programs, each over a contiguous run of rows, keeping its share of the
weight's and bias' gradients in fp32 registers and writing it once to a (programs, D) buffer that
torch sums (deterministic, no atomics), as Liger-Kernel's and Apex's norms do.

Layout: rows may be strided, each row contiguous; outputs are allocated contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.devices import on_device
from amp_fx.kernels.norms.arguments import check_norm_backward_arguments, check_norm_forward_arguments
from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.kernels.range_stats.arguments import check_kernel_record
from amp_fx.kernels.range_stats.triton import record_block, record_constexprs
from amp_fx.kernels.rounding import round_to_dtype

__all__ = ["MAX_WIDTH", "norm_backward", "norm_forward"]

# Widest row a program holds in registers: 32768 fp32 values over 16 warps are 64 per thread, with
# the backward's three row-sized values 192 registers, under the 255 a thread may have. Wider
# rows (rare: hidden sizes stop at 16384 today) go to the reference (`amp_fx.ops.norms` checks).
MAX_WIDTH = 32768
# Backward programs per streaming multiprocessor: 4 programs of up to 16 warps keep 16-64 warps
# resident per SM to hide memory latency, and the (programs, D) fp32 buffer of weight-gradient
# shares stays small (528 x 1536 x 4 bytes = 3.2 MB for Llama-0.5B on an H200, 3% of its input).
_PROGRAMS_PER_SM = 4
# Backward programs under the CPU interpreter (tests): a few, so the row loop runs more than once.
_INTERPRETED_PROGRAMS = 3


def _num_warps(block_size: int) -> int:
    """8 values per thread up to 16 warps: enough loads in flight per warp, few idle lanes."""
    return max(1, min(16, block_size // 256))


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE and widened back (identity for fp32)."""
    if DTYPE == tl.float32:
        return x
    else:
        return round_to_dtype(x, DTYPE).to(tl.float32)


@triton.jit
def _weight_row(weight_ptr, columns, in_row, weight_offset, HAS_OFFSET: tl.constexpr, W_DTYPE: tl.constexpr):
    """w' = round_w(w + offset) in fp32 (w alone without an offset)."""
    w = tl.load(weight_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        w = _rounded(w + weight_offset, W_DTYPE)
    return w


# The entries are never specialized: each watched node records at an index of its own.
@triton.jit(do_not_specialize=["out_index", "sum_index"])
def _norm_forward_kernel(
    x_ptr,  # X_DTYPE* (N, D): row i at x_ptr + i * x_row_stride, columns contiguous
    x_row_stride,
    residual_ptr,  # (N, D) like x, read only with HAS_RESIDUAL
    residual_row_stride,
    sum_ptr,  # SUM_DTYPE* (N, D) contiguous out: x + residual, only with HAS_RESIDUAL
    weight_ptr,  # W_DTYPE* (D,), only with HAS_WEIGHT
    bias_ptr,  # (D,) any float dtype, only with HAS_BIAS
    out_ptr,  # OUT_DTYPE* (N, D) contiguous out
    mean_ptr,  # float32* (N,) out, only with SUBTRACT_MEAN
    rstd_ptr,  # float32* (N,) out
    record_amax_ptr,  # float32*: the range statistics' amax, with RECORD_OUT or RECORD_SUM
    record_counts_ptr,  # int64*: their counts
    out_index,  # the entry out's statistics go to, with RECORD_OUT
    sum_index,  # the entry the sum's go to, with RECORD_SUM
    width,
    eps,
    weight_offset,
    HAS_RESIDUAL: tl.constexpr,
    SUM_DTYPE: tl.constexpr,
    SUBTRACT_MEAN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    W_DTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MID_DTYPE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    RECORD_OUT: tl.constexpr,
    OUT_BITS_DTYPE: tl.constexpr,  # range_stats' bit_layout of out's dtype, with RECORD_OUT
    OUT_EXPONENT_MASK: tl.constexpr,
    OUT_MAGNITUDE_MASK: tl.constexpr,
    RECORD_SUM: tl.constexpr,
    SUM_BITS_DTYPE: tl.constexpr,  # the same for the sum's dtype, with RECORD_SUM
    SUM_EXPONENT_MASK: tl.constexpr,
    SUM_MAGNITUDE_MASK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    numel = tl.num_programs(0).to(tl.int64) * width
    columns = tl.arange(0, BLOCK_SIZE)
    in_row = columns < width
    s = tl.load(x_ptr + row * x_row_stride + columns, mask=in_row, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + columns, mask=in_row, other=0.0)
        summed = round_to_dtype(s + r.to(tl.float32), SUM_DTYPE)
        tl.store(sum_ptr + row * width + columns, summed, mask=in_row)
        if RECORD_SUM:
            record_block(
                summed, in_row, record_amax_ptr, record_counts_ptr, sum_index, numel, row == 0,
                SUM_BITS_DTYPE, SUM_EXPONENT_MASK, SUM_MAGNITUDE_MASK,
            )  # fmt: skip
        s = summed.to(tl.float32)  # the rounded sum is what the next op reads
    if SUBTRACT_MEAN:
        mean = tl.sum(s, axis=0) / width
        tl.store(mean_ptr + row, mean)
        centered = tl.where(in_row, s - mean, 0.0)
    else:
        centered = s
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / width + eps)
    tl.store(rstd_ptr + row, rstd)
    y = _rounded(centered * rstd, MID_DTYPE)
    if HAS_WEIGHT:
        y = y * _weight_row(weight_ptr, columns, in_row, weight_offset, HAS_OFFSET, W_DTYPE)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
    stored = round_to_dtype(_rounded(y, PRODUCT_DTYPE), OUT_DTYPE)
    tl.store(out_ptr + row * width + columns, stored, mask=in_row)
    if RECORD_OUT:
        record_block(
            stored, in_row, record_amax_ptr, record_counts_ptr, out_index, numel, row == 0,
            OUT_BITS_DTYPE, OUT_EXPONENT_MASK, OUT_MAGNITUDE_MASK,
        )  # fmt: skip


@triton.jit
def _norm_backward_kernel(
    grad_out_ptr,  # (N, D) any float dtype: row i at grad_out_ptr + i * grad_out_row_stride
    grad_out_row_stride,
    grad_sum_ptr,  # (N, D) gradient of the returned sum from its other readers, with HAS_GRAD_SUM
    grad_sum_row_stride,
    s_ptr,  # (N, D) the forward's normalized rows (x or the sum)
    s_row_stride,
    weight_ptr,  # W_DTYPE* (D,), only with HAS_WEIGHT
    mean_ptr,  # float32* (N,), only with SUBTRACT_MEAN
    rstd_ptr,  # float32* (N,)
    grad_x_ptr,  # GRAD_DTYPE* (N, D) contiguous out
    grad_residual_ptr,  # RESIDUAL_GRAD_DTYPE* (N, D) contiguous out, only with HAS_RESIDUAL_GRAD
    partial_weight_ptr,  # float32* (programs, D) out: this program's share of grad_weight
    partial_bias_ptr,  # float32* (programs, D) out: this program's share of grad_bias
    num_rows,
    width,
    rows_per_program,
    weight_offset,
    HAS_GRAD_SUM: tl.constexpr,
    SUBTRACT_MEAN: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    W_DTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MID_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    HAS_RESIDUAL_GRAD: tl.constexpr,
    RESIDUAL_GRAD_DTYPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK_SIZE)
    in_row = columns < width
    if HAS_WEIGHT:
        w = _weight_row(weight_ptr, columns, in_row, weight_offset, HAS_OFFSET, W_DTYPE)
    grad_weight = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    grad_bias = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, num_rows)
    for row in range(first, last):
        s = tl.load(s_ptr + row * s_row_stride + columns, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if SUBTRACT_MEAN:
            centered = tl.where(in_row, s - tl.load(mean_ptr + row), 0.0)
        else:
            centered = s
        n = centered * rstd
        dy = tl.load(grad_out_ptr + row * grad_out_row_stride + columns, mask=in_row, other=0.0)
        dy = dy.to(tl.float32)
        if HAS_WEIGHT:
            dn = dy * w
            grad_weight += dy * _rounded(n, MID_DTYPE)
        else:
            dn = dy
        if HAS_BIAS:
            grad_bias += dy
        correction = n * (tl.sum(dn * n, axis=0) / width)
        if SUBTRACT_MEAN:
            correction += tl.sum(dn, axis=0) / width
        ds = rstd * (dn - correction)
        if HAS_GRAD_SUM:
            g = tl.load(grad_sum_ptr + row * grad_sum_row_stride + columns, mask=in_row, other=0.0)
            ds += g.to(tl.float32)
        tl.store(grad_x_ptr + row * width + columns, round_to_dtype(ds, GRAD_DTYPE), mask=in_row)
        if HAS_RESIDUAL_GRAD:
            tl.store(
                grad_residual_ptr + row * width + columns,
                round_to_dtype(ds, RESIDUAL_GRAD_DTYPE),
                mask=in_row,
            )
    if HAS_WEIGHT:
        tl.store(partial_weight_ptr + program * width + columns, grad_weight, mask=in_row)
    if HAS_BIAS:
        tl.store(partial_bias_ptr + program * width + columns, grad_bias, mask=in_row)


def _check_width(width: int) -> None:
    if width > MAX_WIDTH:
        raise ValueError(
            f"rows of {width} values are wider than the Triton norm kernels take ({MAX_WIDTH}); "
            "use amp_fx.kernels.reference for them"
        )


def _mid(dtype: torch.dtype | None) -> tl.dtype:
    return tl.float32 if dtype is None else triton_dtype(dtype)


def norm_forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    *,
    residual: Tensor | None = None,
    subtract_mean: bool = False,
    weight_offset: float = 0.0,
    mid_dtype: torch.dtype | None = None,
    product_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    sum_dtype: torch.dtype | None = None,
    record: KernelRecord | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """RMSNorm (or LayerNorm with ``subtract_mean``) of the rows of ``x`` (+ ``residual``):
    ``(out, summed, mean, rstd)``, the contract of ``amp_fx.kernels.norms``. One launch, which
    also records the range statistics of out and the sum where ``record`` asks.

    Example:
        >>> x = torch.randn(8 * 2048, 1536, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
        >>> out, _, _, rstd = norm_forward(x, torch.ones(1536, device="cuda"), None, 1e-6)  # doctest: +SKIP
    """
    check_norm_forward_arguments(
        x, weight, bias, eps, residual, weight_offset, mid_dtype, product_dtype, out_dtype, sum_dtype
    )
    num_rows, width = x.shape
    _check_width(width)
    out = torch.empty((num_rows, width), dtype=out_dtype or x.dtype, device=x.device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    mean = torch.empty(num_rows, dtype=torch.float32, device=x.device) if subtract_mean else None
    summed = None
    if residual is not None:
        sum_dtype = sum_dtype or torch.promote_types(x.dtype, residual.dtype)
        summed = torch.empty((num_rows, width), dtype=sum_dtype, device=x.device)
    if record is not None:
        check_kernel_record(record, [out, summed])
    if num_rows == 0:
        return out, summed, mean, rstd
    amax, counts, (out_index, sum_index) = record or (rstd, rstd, (None, None))
    block_size = triton.next_power_of_2(width)
    with on_device(x.device):
        _norm_forward_kernel[(num_rows,)](
            x,
            x.stride(0),
            residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0,
            summed if summed is not None else out,
            weight if weight is not None else x,
            bias if bias is not None else x,
            out,
            mean if mean is not None else rstd,
            rstd,
            amax,
            counts,
            out_index or 0,
            sum_index or 0,
            width,
            float(eps),
            float(weight_offset),
            HAS_RESIDUAL=residual is not None,
            SUM_DTYPE=triton_dtype(summed.dtype) if summed is not None else tl.float32,
            SUBTRACT_MEAN=subtract_mean,
            HAS_WEIGHT=weight is not None,
            HAS_OFFSET=weight is not None and weight_offset != 0.0,
            W_DTYPE=triton_dtype(weight.dtype) if weight is not None else tl.float32,
            HAS_BIAS=bias is not None,
            MID_DTYPE=_mid(mid_dtype),
            PRODUCT_DTYPE=triton_dtype(product_dtype),
            OUT_DTYPE=triton_dtype(out.dtype),
            RECORD_OUT=out_index is not None,
            **record_constexprs(out.dtype if out_index is not None else None, "OUT_"),
            RECORD_SUM=sum_index is not None,
            **record_constexprs(summed.dtype if sum_index is not None else None, "SUM_"),
            BLOCK_SIZE=block_size,
            num_warps=_num_warps(block_size),
        )
    return out, summed, mean, rstd


def _backward_programs(device: torch.device, num_rows: int) -> int:
    if device.type == "cuda":
        programs = torch.cuda.get_device_properties(device).multi_processor_count * _PROGRAMS_PER_SM
    else:
        programs = _INTERPRETED_PROGRAMS
    return max(1, min(programs, num_rows))


def norm_backward(
    grad_out: Tensor,
    grad_sum: Tensor | None,
    normalized: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    *,
    bias_dtype: torch.dtype | None = None,
    subtract_mean: bool = False,
    weight_offset: float = 0.0,
    mid_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype,
    residual_grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of `norm_forward`: ``(grad_x, grad_residual, grad_weight, grad_bias)``, the
    contract of ``amp_fx.kernels.norms``. One launch, and a sum over the programs' weight shares.

    Example:
        >>> grads = norm_backward(dy, None, x, weight, None, rstd, grad_dtype=x.dtype)  # doctest: +SKIP
    """
    check_norm_backward_arguments(
        grad_out, grad_sum, normalized, weight, mean, rstd, subtract_mean, grad_dtype,
        residual_grad_dtype, bias_dtype,
    )  # fmt: skip
    num_rows, width = normalized.shape
    _check_width(width)
    device = normalized.device
    grad_x = torch.empty((num_rows, width), dtype=grad_dtype, device=device)
    grad_residual = None
    if residual_grad_dtype is not None:
        grad_residual = torch.empty((num_rows, width), dtype=residual_grad_dtype, device=device)
    programs = _backward_programs(device, num_rows)
    partial_weight = torch.zeros((programs, width), dtype=torch.float32, device=device)
    partial_bias = torch.zeros((programs, width), dtype=torch.float32, device=device)
    if num_rows > 0:
        block_size = triton.next_power_of_2(width)
        with on_device(device):
            _norm_backward_kernel[(programs,)](
                grad_out,
                grad_out.stride(0),
                grad_sum if grad_sum is not None else grad_out,
                grad_sum.stride(0) if grad_sum is not None else 0,
                normalized,
                normalized.stride(0),
                weight if weight is not None else rstd,
                mean if mean is not None else rstd,
                rstd,
                grad_x,
                grad_residual if grad_residual is not None else grad_x,
                partial_weight,
                partial_bias,
                num_rows,
                width,
                triton.cdiv(num_rows, programs),
                float(weight_offset),
                HAS_GRAD_SUM=grad_sum is not None,
                SUBTRACT_MEAN=subtract_mean,
                HAS_WEIGHT=weight is not None,
                HAS_OFFSET=weight is not None and weight_offset != 0.0,
                W_DTYPE=triton_dtype(weight.dtype) if weight is not None else tl.float32,
                HAS_BIAS=bias_dtype is not None,
                MID_DTYPE=_mid(mid_dtype),
                GRAD_DTYPE=triton_dtype(grad_dtype),
                HAS_RESIDUAL_GRAD=grad_residual is not None,
                RESIDUAL_GRAD_DTYPE=triton_dtype(residual_grad_dtype or grad_dtype),
                BLOCK_SIZE=block_size,
                num_warps=_num_warps(block_size),
            )
    grad_weight = partial_weight.sum(dim=0).to(weight.dtype) if weight is not None else None
    grad_bias = partial_bias.sum(dim=0).to(bias_dtype) if bias_dtype is not None else None
    return grad_x, grad_residual, grad_weight, grad_bias
