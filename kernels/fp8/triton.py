"""The FP8 family's kernels for CUDA tensors: the reference's, for now.

There is no Triton kernel in this family yet. ``fp8_scaled_mm`` is ``torch._scaled_mm`` on every
device (cuBLAS's or CUTLASS's kernel on CUDA), and ``fp8_quantize``'s torch ops (an amax, a scale,
a multiply, a clamp and a cast: about five passes over the tensor) run on CUDA as they are; under
torch.compile Inductor fuses them. A Triton quantiser that reads the tensor once for its amax and
once for the cast, writing the layout the product takes, will replace ``fp8_quantize`` here.
"""

from amp_fx.kernels.fp8.reference import fp8_quantize, fp8_scaled_mm

__all__ = ["fp8_quantize", "fp8_scaled_mm"]
