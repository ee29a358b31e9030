"""Fused activations: ``act(gate) * up`` and ``act(x)`` read once in fp16/bf16, computed in fp32.

What: the family's contract, ``amp_fx.kernels.activations``, which has the math.

Why fused: at O2 a gated MLP's ``silu(gate) * up`` is two torch kernels (the activation writes a
tensor the multiply reads back), and a GELU written out as Hugging Face's ``gelu_new`` is nine,
with an fp32 island around ``pow`` and two casts: each reads and writes a (rows, 4 * hidden)
tensor, half of them in fp32. Here the forward reads each input once and writes the output once;
the backward reads the upstream gradient and the inputs once and writes each input's gradient
once, recomputing the activation (a few flops per element in a memory-bound kernel) instead of
saving it.

How: a 2-D grid of tiles, BLOCK_ROWS x BLOCK_COLUMNS elements per program; any strides (a
``chunk`` of one projection is read in place; Triton specializes the unit column stride, so a
contiguous row is loaded as vectors). tanh is written with exp (Triton's interpreter has no
libdevice): ``tanh(z) = sign(z) * (1 - e) / (1 + e)``, ``e = exp(-2|z|)``, which never overflows
and is exact to fp32's absolute error, what ``1 + tanh`` keeps of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from amp_fx.kernels.activations import ACTIVATIONS
from amp_fx.kernels.activations.arguments import check_activation_arguments
from amp_fx.kernels.devices import on_device
from amp_fx.kernels.pointer_table import triton_dtype
from amp_fx.kernels.range_stats import KernelRecord
from amp_fx.kernels.range_stats.arguments import check_kernel_record
from amp_fx.kernels.range_stats.triton import record_block, record_constexprs
from amp_fx.kernels.rounding import round_to_dtype


@dataclass(frozen=True)
class ActivationLaunch:
    """Elements per program (a power of two) and warps per program."""

    block_elements: int
    num_warps: int


# 4096 elements and 8 warps a program: 16 per thread, two 16-byte loads of fp16 per input, 8 KB of
# each input in flight per program. Chosen from those counts, as the cross-entropy kernel's launch;
# benchmarks/bench_activations.py measures it against the copy ceiling on a GPU.
LAUNCH = ActivationLaunch(block_elements=4096, num_warps=8)

# The constants are written as numbers inside the kernels: compiled Triton refuses a module global
# that is not a constexpr, and the interpreter turns constexpr * tensor into a constexpr.
# sqrt(2 / pi) = 0.7978845608028654, 1 / sqrt(2) = 0.7071067811865475,
# 1 / sqrt(2 pi) = 0.3989422804014327; 0.044715 is the tanh approximation's cubic term.


@triton.jit
def _tanh(z):
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0.0, -t, t)


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """act(x) of fp32 x; ACTIVATION indexes `ACTIVATIONS` (silu, gelu, gelu_tanh)."""
    if ACTIVATION == 0:
        return x * tl.sigmoid(x)
    elif ACTIVATION == 1:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865475))
    else:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + _tanh(inner))


@triton.jit
def _activation_and_slope(x, ACTIVATION: tl.constexpr):
    """(act(x), act'(x)) of fp32 x, sharing their common terms."""
    if ACTIVATION == 0:
        s = tl.sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s))
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865475))
        return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    else:
        x2 = x * x
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x2 * x))
        half_one_plus_t = 0.5 * (1.0 + t)
        slope = half_one_plus_t + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x2)
        return x * half_one_plus_t, slope


@triton.jit
def _tile(num_rows, num_columns, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    """This program's (rows (BLOCK_ROWS, 1) int64, columns (1, BLOCK_COLUMNS), in-bounds mask)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    columns = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)[None, :]
    return rows, columns, (rows < num_rows) & (columns < num_columns)


# The entry is never specialized: each watched node records at an index of its own.
@triton.jit(do_not_specialize=["out_index"])
def _activation_forward_kernel(
    x_ptr,  # DTYPE* (rows, columns): the activation's input (the gate), at (row, column) strides
    x_row_stride,
    x_column_stride,
    up_ptr,  # DTYPE* (rows, columns): the multiplied projection; unused unless GATED
    up_row_stride,
    up_column_stride,
    out_ptr,  # DTYPE* (rows, columns) contiguous, out: act(x) [* up], rounded once
    record_amax_ptr,  # float32*: the range statistics' amax, with RECORD
    record_counts_ptr,  # int64*: their counts
    out_index,  # the entry out's statistics go to, with RECORD
    num_rows,
    num_columns,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    DTYPE: tl.constexpr,
    RECORD: tl.constexpr,
    BITS_DTYPE: tl.constexpr,  # range_stats' bit_layout of DTYPE, with RECORD
    EXPONENT_MASK: tl.constexpr,
    MAGNITUDE_MASK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLUMNS: tl.constexpr,
):
    rows, columns, mask = _tile(num_rows, num_columns, BLOCK_ROWS, BLOCK_COLUMNS)
    x = tl.load(x_ptr + rows * x_row_stride + columns * x_column_stride, mask=mask).to(tl.float32)
    out = _activation(x, ACTIVATION)
    if GATED:
        up = tl.load(up_ptr + rows * up_row_stride + columns * up_column_stride, mask=mask)
        out = out * up.to(tl.float32)
    stored = round_to_dtype(out, DTYPE)
    tl.store(out_ptr + rows * num_columns + columns, stored, mask=mask)
    if RECORD:
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        numel = num_rows.to(tl.int64) * num_columns
        record_block(
            stored, mask, record_amax_ptr, record_counts_ptr, out_index, numel, first,
            BITS_DTYPE, EXPONENT_MASK, MAGNITUDE_MASK,
        )  # fmt: skip


@triton.jit
def _activation_backward_kernel(
    grad_out_ptr,  # DTYPE* (rows, columns): upstream gradient dy, at (row, column) strides
    grad_out_row_stride,
    grad_out_column_stride,
    x_ptr,  # DTYPE* (rows, columns): the activation's input (the gate), as in the forward
    x_row_stride,
    x_column_stride,
    up_ptr,  # DTYPE* (rows, columns): the multiplied projection; unused unless GATED
    up_row_stride,
    up_column_stride,
    grad_x_ptr,  # DTYPE* (rows, columns) contiguous, out: dy [* up] * act'(x)
    grad_up_ptr,  # DTYPE* (rows, columns) contiguous, out: dy * act(x); unused unless GATED
    num_rows,
    num_columns,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLUMNS: tl.constexpr,
):
    rows, columns, mask = _tile(num_rows, num_columns, BLOCK_ROWS, BLOCK_COLUMNS)
    dy = tl.load(grad_out_ptr + rows * grad_out_row_stride + columns * grad_out_column_stride, mask=mask)
    dy = dy.to(tl.float32)
    x = tl.load(x_ptr + rows * x_row_stride + columns * x_column_stride, mask=mask).to(tl.float32)
    act, slope = _activation_and_slope(x, ACTIVATION)
    out_offsets = rows * num_columns + columns
    if GATED:
        up = tl.load(up_ptr + rows * up_row_stride + columns * up_column_stride, mask=mask)
        tl.store(grad_x_ptr + out_offsets, round_to_dtype(dy * up.to(tl.float32) * slope, DTYPE), mask=mask)
        tl.store(grad_up_ptr + out_offsets, round_to_dtype(dy * act, DTYPE), mask=mask)
    else:
        tl.store(grad_x_ptr + out_offsets, round_to_dtype(dy * slope, DTYPE), mask=mask)


# Rows at least this wide are tiled by their largest power-of-two divisor when it is this large:
# GPT-2's 3072 columns as 3 x 1024 (no lane idle) instead of one 4096-wide block, a quarter idle.
_MIN_DIVIDING_BLOCK = 256


def _launch(shape: torch.Size) -> tuple[tuple[int, int], int, int, int]:
    """(grid, BLOCK_ROWS, BLOCK_COLUMNS, num_warps) for a (rows, columns) tensor: tiles of
    LAUNCH.block_elements, as wide as the rows up to that (by a power of two that divides them
    where one is large enough), fewer warps for tiny tensors."""
    num_rows, num_columns = shape
    divisor = num_columns & -num_columns  # the largest power of two dividing num_columns
    width = divisor if divisor >= _MIN_DIVIDING_BLOCK else triton.next_power_of_2(max(num_columns, 1))
    block_columns = min(LAUNCH.block_elements, width)
    block_rows = min(LAUNCH.block_elements // block_columns, triton.next_power_of_2(max(num_rows, 1)))
    num_warps = max(1, min(LAUNCH.num_warps, block_rows * block_columns // 512))
    grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(num_columns, block_columns))
    return grid, block_rows, block_columns, num_warps


def _strided(tensor: Tensor | None, fallback: Tensor) -> tuple[Tensor, int, int]:
    """(tensor, row stride, column stride): the tensor's own, or an unused input's placeholders."""
    tensor = fallback if tensor is None else tensor
    return tensor, tensor.stride(0), tensor.stride(1)


def _forward(x: Tensor, up: Tensor | None, activation: str, record: KernelRecord | None) -> Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if record is not None:
        check_kernel_record(record, [out])
    if x.numel() == 0:
        return out
    amax, counts, (out_index,) = record or (out, out, (None,))
    grid, block_rows, block_columns, num_warps = _launch(x.shape)
    with on_device(x.device):
        _activation_forward_kernel[grid](
            *_strided(x, x),
            *_strided(up, x),
            out,
            amax,
            counts,
            out_index or 0,
            *x.shape,
            ACTIVATION=ACTIVATIONS.index(activation),
            GATED=up is not None,
            DTYPE=triton_dtype(x.dtype),
            RECORD=out_index is not None,
            **record_constexprs(x.dtype if out_index is not None else None),
            BLOCK_ROWS=block_rows,
            BLOCK_COLUMNS=block_columns,
            num_warps=num_warps,
        )
    return out


def _backward(
    grad_out: Tensor, x: Tensor, up: Tensor | None, activation: str
) -> tuple[Tensor, Tensor | None]:
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_up = torch.empty(x.shape, dtype=x.dtype, device=x.device) if up is not None else None
    if x.numel() == 0:
        return grad_x, grad_up
    grid, block_rows, block_columns, num_warps = _launch(x.shape)
    with on_device(x.device):
        _activation_backward_kernel[grid](
            *_strided(grad_out, grad_out),
            *_strided(x, x),
            *_strided(up, x),
            grad_x,
            grad_up if grad_up is not None else grad_x,
            *x.shape,
            ACTIVATION=ACTIVATIONS.index(activation),
            GATED=up is not None,
            DTYPE=triton_dtype(x.dtype),
            BLOCK_ROWS=block_rows,
            BLOCK_COLUMNS=block_columns,
            num_warps=num_warps,
        )
    return grad_x, grad_up


def gated_activation_forward(
    gate: Tensor, up: Tensor, activation: str, record: KernelRecord | None = None
) -> Tensor:
    """``act(gate) * up`` in fp32, rounded once: the contract of ``amp_fx.kernels.activations``.
    One read of each input, one write (recording its range statistics where ``record`` asks).

    Example:
        >>> gate = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
        >>> out = gated_activation_forward(gate, torch.randn_like(gate), "silu")  # doctest: +SKIP
    """
    check_activation_arguments(activation, gate=gate, up=up)
    return _forward(gate, up, activation, record)


def gated_activation_backward(
    grad_out: Tensor, gate: Tensor, up: Tensor, activation: str
) -> tuple[Tensor, Tensor]:
    """(grad_gate, grad_up) of `gated_activation_forward`, the activation recomputed from gate.

    Example:
        >>> grad_gate, grad_up = gated_activation_backward(out, gate, up, "silu")  # doctest: +SKIP
    """
    check_activation_arguments(activation, grad_out=grad_out, gate=gate, up=up)
    grad_gate, grad_up = _backward(grad_out, gate, up, activation)
    assert grad_up is not None
    return grad_gate, grad_up


def activation_forward(input: Tensor, activation: str, record: KernelRecord | None = None) -> Tensor:
    """``act(input)`` in fp32, rounded once (recording its range statistics where ``record`` asks).

    Example:
        >>> x = torch.randn(8, 3072, dtype=torch.float16, device="cuda")  # doctest: +SKIP
        >>> out = activation_forward(x, "gelu_tanh")  # doctest: +SKIP
    """
    check_activation_arguments(activation, input=input)
    return _forward(input, None, activation, record)


def activation_backward(grad_out: Tensor, input: Tensor, activation: str) -> Tensor:
    """Gradient of `activation_forward` w.r.t. its input, recomputing the activation.

    Example:
        >>> grad = activation_backward(torch.ones_like(x), x, "gelu_tanh")  # doctest: +SKIP
    """
    check_activation_arguments(activation, grad_out=grad_out, input=input)
    grad_input, _ = _backward(grad_out, input, None, activation)
    return grad_input
