"""The matmuls of a fused language-model head + loss, shared by `amp_fx.ops.cross_entropy`'s
`linear_cross_entropy` and `amp_fx.ops.chunked_cross_entropy`: products accumulated and returned
in float32 (`matmul_fp32`), so a gradient is scaled before its one rounding to a low dtype.

>>> a, b = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
>>> matmul_fp32(a, b).dtype
torch.float32
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["matmul_fp32"]

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
