"""The max-pool kernels' argument checks, shared by the reference and the Triton kernels (metadata
only: they never read a value, so they never synchronize with the device)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from amp_fx.kernels.arguments import INT32_MAX, check_dtype

__all__ = [
    "MAX_POOL_MAX_PIXELS",
    "MAX_POOL_MAX_TAPS",
    "check_channels_last",
    "check_max_pool2d_arguments",
    "check_max_pool2d_backward_arguments",
    "check_triton_max_pool2d_pixels",
    "max_pool2d_output_size",
]

MAX_POOL_MAX_TAPS = 256  # the offsets are uint8
MAX_POOL_MAX_PIXELS = INT32_MAX  # N * H * W: the Triton kernels index pixels with int32


def max_pool2d_output_size(
    size: int, kernel_size: int, stride: int, padding: int, dilation: int, ceil_mode: bool
) -> int:
    """One output dimension, by torch's formula (``pooling_output_shape``): with ceil_mode the last
    window may hang over the end, but it must start inside the input or its left padding.

    Example:
        >>> max_pool2d_output_size(112, 3, 2, 1, 1, False), max_pool2d_output_size(5, 2, 2, 0, 1, True)
        (56, 3)
    """
    numerator = size + 2 * padding - dilation * (kernel_size - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = numerator // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _check_pair(name: str, value: object, minimum: int) -> tuple[int, int]:
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(
            f"{name} must be a pair of ints (height, width), got {value!r}; "
            "amp_fx.ops.max_pool.max_pool2d accepts F.max_pool2d's forms and normalizes them"
        )
    if min(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum} in both dimensions, got {tuple(value)}")
    return value[0], value[1]


def check_max_pool2d_arguments(
    input_size: Sequence[int],
    dtype: torch.dtype,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> tuple[int, int]:
    """Validate a max-pool window for an input of ``input_size`` (N, C, H, W) and ``dtype`` (metadata
    only); returns the output's (OH, OW). Raises TypeError/ValueError with torch's rules: padding at
    most half the kernel size, an output of at least one element per dimension, and (for the 1-byte
    offsets) at most 256 taps per window."""
    if len(input_size) != 4:
        raise ValueError(
            f"max_pool2d kernels take a 4-D (N, C, H, W) input, got {len(input_size)} dimensions; "
            "add a batch dimension with x.unsqueeze(0)"
        )
    check_dtype("max_pool2d input has", dtype)
    kernel = _check_pair("kernel_size", kernel_size, 1)
    strides = _check_pair("stride", stride, 1)
    pads = _check_pair("padding", padding, 0)
    dilations = _check_pair("dilation", dilation, 1)
    if not isinstance(ceil_mode, bool):
        raise TypeError(f"ceil_mode must be True or False, got {ceil_mode!r}")
    if kernel[0] * kernel[1] > MAX_POOL_MAX_TAPS:
        raise ValueError(
            f"a {kernel[0]}x{kernel[1]} window has more than {MAX_POOL_MAX_TAPS} taps, too many for "
            "1-byte offsets; use F.max_pool2d for such windows"
        )
    if pads[0] > kernel[0] // 2 or pads[1] > kernel[1] // 2:
        raise ValueError(f"padding {pads} is more than half the kernel size {kernel}; use a smaller padding")
    out_size = tuple(
        max_pool2d_output_size(input_size[2 + i], kernel[i], strides[i], pads[i], dilations[i], ceil_mode)
        for i in range(2)
    )
    if min(out_size) < 1:
        raise ValueError(
            f"max_pool2d of an input of spatial size {tuple(input_size[2:])} with kernel {kernel}, "
            f"dilation {dilations} and padding {pads} has output size {out_size}; "
            "use a smaller kernel or a larger input"
        )
    return out_size


def check_channels_last(name: str, tensor: Tensor) -> None:
    """Raise unless ``tensor`` is a 4-D tensor contiguous in channels_last (the max-pool layout)."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dim() != 4 or not tensor.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(
            f"{name} must be a 4-D tensor contiguous in channels_last (strides {tensor.stride()} for "
            f"shape {tuple(tensor.shape)}); convert it with .contiguous(memory_format=torch.channels_last)"
        )


def check_triton_max_pool2d_pixels(*counts: int) -> None:
    """The Triton max-pool kernels' own limit: they index pixels (N * H * W) with int32."""
    if max(counts) > MAX_POOL_MAX_PIXELS:
        raise ValueError(
            f"max_pool2d kernels index pixels with int32; {max(counts)} pixels (N * H * W) is too many: "
            "split the batch"
        )


def check_max_pool2d_backward_arguments(
    grad_out: Tensor,
    offsets: Tensor,
    input_size: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> None:
    """Validate the arguments of ``max_pool2d_backward`` (metadata only)."""
    if not isinstance(grad_out, Tensor):
        raise TypeError(f"grad_out must be a tensor, got {type(grad_out).__name__}")
    check_channels_last("offsets", offsets)
    if offsets.dtype != torch.uint8:
        raise ValueError(f"offsets must be the forward's uint8 offsets, got dtype {offsets.dtype}")
    if not isinstance(input_size, (tuple, list)) or len(input_size) != 4:
        raise ValueError(f"input_size must be the forward input's (N, C, H, W), got {input_size!r}")
    check_max_pool2d_arguments(
        input_size, grad_out.dtype, kernel_size, stride, padding, dilation, ceil_mode=False
    )
    if grad_out.shape != offsets.shape or grad_out.device != offsets.device:
        raise ValueError(
            f"grad_out ({tuple(grad_out.shape)} on {grad_out.device}) must have the shape and device "
            f"of the offsets ({tuple(offsets.shape)} on {offsets.device})"
        )
    if tuple(offsets.shape[:2]) != tuple(input_size[:2]):
        raise ValueError(
            f"offsets of shape {tuple(offsets.shape)} do not belong to an input of size {tuple(input_size)}"
        )
