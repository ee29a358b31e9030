"""`matmul_fp32`'s two branches, both on a CPU-only machine: CUDA's ``torch.mm(..., out_dtype=
torch.float32)`` (run on fake CUDA tensors: the overload, its output dtype and shape, which a
torch change could break unseen by CPU CI) and the CPU's float32 copies (run for real)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from amp_fx.ops.head_matmuls import _MM_HAS_OUT_DTYPE, matmul_fp32


class RecordedCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((getattr(func, "__name__", str(func)), dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not _MM_HAS_OUT_DTYPE, reason="this torch has no mm.dtype overload")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_inputs_take_the_out_dtype_overload(dtype: torch.dtype) -> None:
    with FakeTensorMode():
        a = torch.empty(5, 8, dtype=dtype, device="cuda")
        b = torch.empty(8, 3, dtype=dtype, device="cuda")
        with RecordedCalls() as recorded:
            out = matmul_fp32(a, b)
    assert (out.dtype, out.shape, out.device.type) == (torch.float32, (5, 3), "cuda")
    assert [call for call in recorded.calls if call[0] == "mm"] == [("mm", {"out_dtype": torch.float32})]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_inputs_are_multiplied_exactly_in_float32(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(5, 8, generator=generator) * 300).to(dtype)
    b = (torch.randn(8, 3, generator=generator) * 300).to(dtype)
    out = matmul_fp32(a, b)
    assert out.dtype == torch.float32 and out.abs().max() > torch.finfo(torch.float16).max
    # Each product of two 16-bit values is exact in float32; float64 bounds the sums' rounding.
    torch.testing.assert_close(out, (a.double() @ b.double()).float(), rtol=1e-6, atol=0.0)
