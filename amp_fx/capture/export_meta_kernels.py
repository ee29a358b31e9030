"""Shape kernels that let torch.export capture what a converted model runs, for the capture only.

torch's meta kernel of ``aten::_grouped_mm`` (the grouped expert product of mixture-of-experts
layers) takes bf16 and fp16 only: it refuses an FP32 model's own call, "Expected mat_a to be
BFloat16 or supported Float16 matrix", although the CPU kernel runs it in FP32. So `export_graph`
captures under `fp32_grouped_mm`, which computes an FP32 call's output shape by torch's own
meta kernel (its shape rules for each 2d/3d layout with ``offs``, on bf16 stand-ins of the
inputs) and gives it FP32: the graph then holds the FP32 product, which O2 runs low (its inputs
cast down at run time) and O1 leaves FP32 as autocast does. Other dtypes go to torch's kernel
unchanged, and after the block torch's kernel is the only one again (fake tensors' cache
forgets what it answered).

    >>> op = torch.ops.aten._grouped_mm.default
    >>> x, w = torch.randn(6, 16, device="meta"), torch.randn(2, 16, 8, device="meta")
    >>> offs = torch.tensor([3, 6], dtype=torch.int32, device="meta")
    >>> from torch._dispatch.python import enable_python_dispatcher
    >>> with enable_python_dispatcher(), fp32_grouped_mm():
    ...     out = op(x, w, offs)
    >>> out.shape, out.dtype
    (torch.Size([6, 8]), torch.float32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["fp32_grouped_mm"]

_META = torch._C.DispatchKey.Meta


def _accepting_fp32(meta: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def kernel(
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        offs: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        fp32 = torch.float32
        if mat_a.dtype != fp32 or mat_b.dtype != fp32 or out_dtype not in (None, fp32):
            return meta(mat_a, mat_b, offs, bias, out_dtype)
        # Contiguous bf16 stand-ins: the layout O2's casts give the kernel at run time.
        low = [torch.empty(m.shape, dtype=torch.bfloat16, device=m.device) for m in (mat_a, mat_b)]
        out = meta(*low, offs, bias, None)
        return torch.empty_strided(out.shape, out.stride(), dtype=fp32, device=out.device)

    return kernel


@contextlib.contextmanager
def fp32_grouped_mm() -> Iterator[None]:
    """While inside, ``aten::_grouped_mm``'s meta kernel under the Python dispatcher (which
    torch.export runs fake tensors with) also takes FP32 inputs and returns FP32 (module
    docstring). The kernel registered with the C++ dispatcher is left alone: a Python kernel
    registered over it stays in use after its library is destroyed (torch 2.14)."""
    op = torch.ops.aten._grouped_mm.default
    previous = op.py_kernels.get(_META)
    if previous is None:  # a torch without a Python meta kernel for it: nothing to widen
        yield
        return
    op.py_kernels[_META] = _accepting_fp32(previous)
    op._uncache_dispatch(_META)
    try:
        yield
    finally:
        op.py_kernels[_META] = previous
        op._uncache_dispatch(_META)
        # Fake tensors cache an op's output metadata across modes: an FP32 call after the block
        # must meet torch's kernel, not an answer given inside it.
        cache = torch._subclasses.fake_tensor.FakeTensorMode.cache
        for key in [key for key in cache if key.key and key.key[0] is op]:
            del cache[key]
