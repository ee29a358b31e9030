"""The matmuls of a fused language-model head + loss, shared by `amp_fx.ops.cross_entropy`'s
`linear_cross_entropy` and `amp_fx.ops.chunked_cross_entropy`: products accumulated and returned
in float32 (`matmul_fp32`), so a gradient is scaled before its one rounding to a low dtype, and
classes padded to 16 bytes a row (`padded_classes`), as Inductor pads the matmuls it compiles.

cuBLAS runs products whose rows are not 16-byte aligned several times slower: GPT-2's 50257
classes took 34 against 7 ms for its head and loss on an H200 (BENCHMARKS.md). Inside an opaque op
Inductor cannot pad them, so the ops do: the head gets zero classes appended (`padded_classes`),
their logits are set to -inf before the loss kernel reads them (`mask_padding`: no probability,
so their softmax and gradient are 0), and a target among them, out of range unpadded, is moved
past them (`padded_target`), so its loss stays NaN as unpadded.

>>> weight = torch.randn(13, 4, dtype=torch.float16)
>>> padded, _ = padded_classes(weight, None)
>>> padded.shape, padded_class_count(13, torch.float16), padded_class_count(13, torch.float32)
(torch.Size([16, 4]), 16, 16)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["mask_padding", "matmul_fp32", "padded_class_count", "padded_classes", "padded_target"]

# torch.mm(a, b, out_dtype=torch.float32) (the "mm.dtype" overload: fp16/bf16 inputs, fp32
# accumulation and output, CUDA only) exists from torch 2.8 on.
_MM_HAS_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (2-D) accumulated in float32 and returned in float32, not rounded to the inputs'
    dtype: the caller scales the product first and rounds once.

    >>> a = torch.full((1, 4), 256.0, dtype=torch.float16)
    >>> matmul_fp32(a, a.t()).item()  # 262144, past fp16's largest value (65504)
    262144.0
    """
    if a.dtype != torch.float32 and a.is_cuda and _MM_HAS_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    # Elsewhere (CPU, tests) the same math from float32 copies: products of fp16/bf16 values are
    # exact in float32.
    return torch.mm(a.float(), b.float())


def padded_class_count(num_classes: int, dtype: torch.dtype) -> int:
    """``num_classes`` rounded up to a multiple of 16 bytes of ``dtype`` (8 fp16/bf16 classes, 4 fp32).

    >>> padded_class_count(50257, torch.float16), padded_class_count(50304, torch.bfloat16)
    (50264, 50304)
    """
    multiple = max(1, 16 // dtype.itemsize)
    return num_classes + -num_classes % multiple


def padded_classes(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``weight`` (V, d) and ``bias`` (V,) with zero classes appended up to `padded_class_count`;
    the tensors themselves when V is aligned already.

    >>> weight, bias = torch.ones(5, 2, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bfloat16)
    >>> weight, bias = padded_classes(weight, bias)
    >>> weight.shape, bias.tolist()
    (torch.Size([8, 2]), [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    """
    padding = padded_class_count(weight.shape[0], weight.dtype) - weight.shape[0]
    if padding == 0:
        return weight, bias
    return F.pad(weight, (0, 0, 0, padding)), None if bias is None else F.pad(bias, (0, padding))


def padded_target(target: Tensor, num_classes: int, padded_count: int, ignore_index: int) -> Tensor:
    """``target`` for logits of ``padded_count`` classes of which the first ``num_classes`` are real:
    a class index among the padding classes (out of range unpadded) becomes ``padded_count``, out
    of range still, so its loss is NaN as it would be unpadded.

    >>> padded_target(torch.tensor([2, 5, 6, -100]), 5, 8, -100).tolist()
    [2, 8, 8, -100]
    """
    if padded_count == num_classes:
        return target
    outside = (target >= num_classes) & (target != ignore_index)
    return torch.where(outside, padded_count, target)


def mask_padding(logits: Tensor, num_classes: int) -> None:
    """Set the padding classes' logits (the columns from ``num_classes`` on) to -inf, in place:
    no probability for them, so their softmax and gradient are 0.

    >>> logits = torch.zeros(1, 4)
    >>> mask_padding(logits, 3); logits.tolist()
    [[0.0, 0.0, 0.0, -inf]]
    """
    if logits.shape[1] != num_classes:
        logits[:, num_classes:] = float("-inf")
