"""The max-pool kernels: Triton against the pure-torch reference (bit for bit), the reference
against torch's F.max_pool2d (values, argmax, gradients) and a float64 computation.

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same checks run on CUDA when marked
`gpu`. Most cases use a small launch configuration (16 pixels x 4 channels per program) so that a
tensor of a few pixels and 5 channels spans several programs, with masked pixel and channel tails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from amp_fx.kernels import reference, triton_ops
from amp_fx.kernels.max_pool import triton as max_pool_triton
from amp_fx.kernels.max_pool.triton import MaxPoolLaunch
from amp_fx.testing import rounding_tolerances

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SMALL = MaxPoolLaunch(block_elements=64, max_block_channels=4, num_warps=1)

# (H, W, kernel_size, stride, padding, dilation, ceil_mode), as pairs. Stride < kernel (windows
# overlap), = kernel, > kernel (input elements no window reaches); padding, dilation, ceil_mode
# with a last window hanging over the end; odd sizes; 1xK windows.
WINDOWS = [
    (7, 9, (3, 3), (2, 2), (1, 1), (1, 1), False),  # ResNet's stem window
    (7, 9, (3, 3), (2, 2), (1, 1), (1, 1), True),
    (6, 5, (2, 2), (1, 1), (0, 0), (1, 1), False),
    (8, 8, (3, 3), (1, 1), (1, 1), (2, 2), True),
    (5, 7, (3, 2), (1, 2), (1, 0), (1, 2), True),
    (4, 4, (4, 4), (3, 3), (2, 2), (1, 1), True),
    (5, 5, (1, 1), (1, 1), (0, 0), (1, 1), False),
    (9, 3, (1, 3), (3, 1), (0, 1), (3, 1), False),
    (7, 7, (2, 2), (3, 3), (0, 0), (1, 1), True),
    (3, 2, (3, 3), (2, 2), (1, 1), (1, 1), False),
]


@contextlib.contextmanager
def launch_config(config: MaxPoolLaunch) -> Iterator[None]:
    saved = max_pool_triton.LAUNCH
    max_pool_triton.LAUNCH = config
    try:
        yield
    finally:
        max_pool_triton.LAUNCH = saved


def make_input(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Integers in [-3, 3] (many ties), a NaN and a -inf row, channels_last."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=generator).to(dtype)
    x[0, 0, 0, 0] = float("nan")
    if shape[0] > 1 and shape[1] > 1:
        x[1, 1, min(1, shape[2] - 1)] = float("-inf")
    return x.to(device).contiguous(memory_format=torch.channels_last)


def make_grad(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal dtype, shape, strides and values (NaN where the other has NaN)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def window_args(case: tuple) -> tuple[tuple[int, int], ...]:
    return case[2:6]


# Under the interpreter each Triton case costs seconds: every window once, in turn in each dtype,
# and the stem's window in all three.
TRITON_CASES = [(case, DTYPES[i % len(DTYPES)]) for i, case in enumerate(WINDOWS)] + [
    (WINDOWS[0], dtype) for dtype in DTYPES[1:]
]


@pytest.mark.parametrize(("case", "dtype"), TRITON_CASES)
def test_triton_matches_reference_exactly(device, case, dtype) -> None:
    height, width, *_, ceil_mode = case
    x = make_input((2, 5, height, width), dtype, seed=len(WINDOWS), device=device)
    window = window_args(case)
    with launch_config(SMALL):
        out, offsets = triton_ops.max_pool2d_forward(x, *window, ceil_mode)
    ref_out, ref_offsets = reference.max_pool2d_forward(x, *window, ceil_mode)
    assert_same_values(out, ref_out)
    assert_same_values(offsets, ref_offsets)
    grad_out = make_grad(out.shape, dtype, seed=3, device=device)
    with launch_config(SMALL):
        grad = triton_ops.max_pool2d_backward(grad_out, offsets, x.shape, *window)
    # The same fp32 additions in the same order: bit-identical.
    assert_same_values(grad, reference.max_pool2d_backward(grad_out, ref_offsets, x.shape, *window))


def test_production_launch(device) -> None:
    # The production configuration: 64 channels (ResNet's stem) in one block, pixel tail masked.
    x = make_input((2, 64, 11, 13), torch.float16, seed=1, device=device)
    window = ((3, 3), (2, 2), (1, 1), (1, 1))
    out, offsets = triton_ops.max_pool2d_forward(x, *window, False)
    ref_out, ref_offsets = reference.max_pool2d_forward(x, *window, False)
    assert_same_values(out, ref_out)
    assert_same_values(offsets, ref_offsets)
    grad_out = make_grad(out.shape, torch.float16, seed=1, device=device)
    grad = triton_ops.max_pool2d_backward(grad_out, offsets, x.shape, *window)
    assert_same_values(grad, reference.max_pool2d_backward(grad_out, ref_offsets, x.shape, *window))


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_backward_reads_any_grad_strides(device, implementation) -> None:
    # The gradient of out.sum() is an expanded scalar (all strides 0); a permuted one is contiguous.
    kernels = reference if implementation == "reference" else triton_ops
    x = make_input((2, 3, 6, 6), torch.float32, seed=2, device=device)
    window = ((3, 3), (2, 2), (1, 1), (1, 1))
    with launch_config(SMALL):
        out, offsets = kernels.max_pool2d_forward(x, *window, False)
        dense = make_grad(out.shape, torch.float32, seed=2, device=device)
        expected = kernels.max_pool2d_backward(
            dense.contiguous(memory_format=torch.channels_last), offsets, x.shape, *window
        )
        assert_same_values(
            kernels.max_pool2d_backward(dense.contiguous(), offsets, x.shape, *window), expected
        )
        ones = torch.ones((), device=device).expand(out.shape)
        expected_ones = kernels.max_pool2d_backward(torch.ones_like(out), offsets, x.shape, *window)
        assert_same_values(kernels.max_pool2d_backward(ones, offsets, x.shape, *window), expected_ones)


def torch_indices_from_offsets(offsets: torch.Tensor, width: int, window: tuple) -> torch.Tensor:
    """torch's flat argmax index (ih * W + iw) of each window, from the tap offsets."""
    (_, kernel_w), (stride_h, stride_w), (pad_h, pad_w), (dilation_h, dilation_w) = window
    taps = offsets.long()
    oh = torch.arange(offsets.shape[2]).view(-1, 1)
    ow = torch.arange(offsets.shape[3]).view(1, -1)
    ih = oh * stride_h - pad_h + (taps // kernel_w) * dilation_h
    iw = ow * stride_w - pad_w + (taps % kernel_w) * dilation_w
    return ih * width + iw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", WINDOWS)
def test_reference_matches_torch(case, dtype) -> None:
    height, width, kernel, stride, padding, dilation, ceil_mode = case
    x = make_input((2, 5, height, width), dtype, seed=7)
    window = window_args(case)
    leaf = x.clone().requires_grad_()
    expected, indices = F.max_pool2d(leaf, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
    out, offsets = reference.max_pool2d_forward(x, *window, ceil_mode)
    assert_same_values(out, expected.detach())
    assert torch.equal(torch_indices_from_offsets(offsets, width, window), indices)

    grad_out = make_grad(out.shape, dtype, seed=7)
    grad = reference.max_pool2d_backward(grad_out, offsets, x.shape, *window)
    expected.backward(grad_out)
    assert grad.stride() == leaf.grad.stride()
    # float64: the same windows (torch's indices) summed exactly, rounded once.
    exact = torch.zeros(x.shape, dtype=torch.float64).flatten(2)
    exact.scatter_add_(2, indices.flatten(2), grad_out.double().flatten(2))
    rtol, atol = rounding_tolerances(dtype)
    torch.testing.assert_close(grad, exact.view(x.shape).to(dtype), rtol=rtol, atol=atol)
    # torch's own backward: on CPU it sums fp16/bf16 gradients in their dtype, so compare with its
    # float32 backward (same windows, same order of additions), rounded once.
    leaf32 = x.float().requires_grad_()
    F.max_pool2d(leaf32, kernel, stride, padding, dilation, ceil_mode).backward(grad_out.float())
    assert_same_values(grad, leaf32.grad.to(dtype))


def test_special_values(device) -> None:
    window = ((3, 3), (2, 2), (1, 1), (1, 1))  # windows at the edge have padding taps
    nan, inf = float("nan"), float("inf")
    x = torch.tensor(
        [
            [-inf, -inf, -inf, 5.0],  # first window: in-range taps all -inf -> first in-range tap
            [-inf, -inf, 2.0, 2.0],
            [-1.0, nan, 2.0, nan],  # window (1, 1) sees two NaNs: the last one in scan order wins
            [-2.0, -3.0, nan, -9.0],
        ]
    ).view(1, 1, 4, 4)
    x = x.expand(1, 2, 4, 4).contiguous(memory_format=torch.channels_last).to(device)
    for kernels in (reference, triton_ops):
        with launch_config(SMALL):
            out, offsets = kernels.max_pool2d_forward(x, *window, False)
        assert out[0, 0, 0, 0] == -inf and offsets[0, 0, 0, 0] == 4  # tap (1, 1) = x[0, 0]
        assert out[0, 0, 0, 1] == 5.0 and offsets[0, 0, 0, 1] == 5  # x[0, 3]: tap (1, 2)
        # Window (1, 1) covers rows 1..3, columns 1..3: NaNs at x[2, 1], x[2, 3], x[3, 2].
        assert torch.isnan(out[0, 0, 1, 1]) and offsets[0, 0, 1, 1] == 7  # x[3, 2] is the last NaN
        assert torch.isnan(out[0, 0, 1, 0]) and offsets[0, 0, 1, 0] == 5  # x[2, 1]: tap (1, 2)


def test_padding_never_wins_and_ties_take_the_first(device) -> None:
    # All values negative (a zero padding would win) and equal (the first in-range tap wins).
    x = torch.full((1, 3, 5, 5), -7.0).contiguous(memory_format=torch.channels_last).to(device)
    window = ((3, 3), (2, 2), (1, 1), (1, 1))
    expected_first_tap = torch.tensor([[4, 3, 3], [1, 0, 0], [1, 0, 0]], dtype=torch.uint8)
    for kernels in (reference, triton_ops):
        out, offsets = kernels.max_pool2d_forward(x, *window, False)
        assert torch.all(out == -7.0)
        assert torch.equal(offsets[0, 1].cpu(), expected_first_tap)


def test_empty_batch(device) -> None:
    x = torch.empty(0, 4, 6, 6, device=device).contiguous(memory_format=torch.channels_last)
    window = ((2, 2), (2, 2), (0, 0), (1, 1))
    out, offsets = triton_ops.max_pool2d_forward(x, *window, False)
    assert out.shape == offsets.shape == (0, 4, 3, 3)
    grad = triton_ops.max_pool2d_backward(torch.empty_like(out), offsets, x.shape, *window)
    assert grad.shape == x.shape


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_argument_errors(implementation) -> None:
    kernels = reference if implementation == "reference" else triton_ops
    x = torch.zeros(1, 2, 6, 6).contiguous(memory_format=torch.channels_last)
    window = ((2, 2), (2, 2), (0, 0), (1, 1))
    with pytest.raises(ValueError, match="channels_last"):
        kernels.max_pool2d_forward(x.contiguous(), *window, False)
    with pytest.raises(ValueError, match="supported dtypes"):
        kernels.max_pool2d_forward(x.double(), *window, False)
    with pytest.raises(ValueError, match="more than 256 taps"):
        big = torch.zeros(1, 2, 20, 20).contiguous(memory_format=torch.channels_last)
        kernels.max_pool2d_forward(big, (17, 17), (1, 1), (0, 0), (1, 1), False)
    with pytest.raises(ValueError, match="more than half the kernel size"):
        kernels.max_pool2d_forward(x, (2, 2), (2, 2), (2, 0), (1, 1), False)
    with pytest.raises(ValueError, match="output size"):
        kernels.max_pool2d_forward(x, (4, 4), (1, 1), (0, 0), (3, 3), False)
    with pytest.raises(TypeError, match="kernel_size must be a pair of ints"):
        kernels.max_pool2d_forward(x, 2, (2, 2), (0, 0), (1, 1), False)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        kernels.max_pool2d_forward(x, (2, 2), (0, 2), (0, 0), (1, 1), False)
    out, offsets = reference.max_pool2d_forward(x, *window, False)
    with pytest.raises(ValueError, match="uint8 offsets"):
        kernels.max_pool2d_backward(out, offsets.to(torch.int8), x.shape, *window)
    with pytest.raises(ValueError, match="shape and device of the offsets"):
        kernels.max_pool2d_backward(out[:, :, :2], offsets, x.shape, *window)
    with pytest.raises(ValueError, match="do not belong to an input"):
        kernels.max_pool2d_backward(out, offsets, (1, 3, 6, 6), *window)
