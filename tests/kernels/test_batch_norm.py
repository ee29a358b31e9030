"""The fused BatchNorm + residual + ReLU kernels: Triton against the pure-torch reference, the
reference against float64.

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same checks run on CUDA when marked
`gpu`. Most cases use a small launch configuration (tiles of 8 channels x 4 rows, about 4 programs)
so that a few dozen rows span several tiles and programs, with channel counts and row counts that
are not multiples of the tile.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.kernels.batch_norm import triton as batch_norm_triton
from amp_fx.kernels.batch_norm.triton import BatchNormLaunch
from amp_fx.testing import assert_close_normwise, rounding_tolerances, tolerances

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Finalize programs of 4 channels reading 2 rows of partial sums at a time: several programs, the
# last one masked, and several masked iterations over the ~4 rows of partials.
SMALL = BatchNormLaunch(
    block_channels=8,
    tile_elements=32,
    num_warps=1,
    target_programs=4,
    finalize_block_channels=4,
    finalize_block_programs=2,
)
# (N, C, H, W): channels below, on and across the small block (8); rows (N*H*W) across tiles.
SHAPES = [(2, 11, 3, 5), (1, 8, 2, 3), (3, 3, 2, 2), (4, 5, 6, 6), (2, 16, 1, 3)]
PARAMS = ["float32", "input dtype", "none"]
EPS = 1e-5


@contextlib.contextmanager
def launch_config(config: BatchNormLaunch) -> Iterator[None]:
    saved = batch_norm_triton.LAUNCH
    batch_norm_triton.LAUNCH = config
    try:
        yield
    finally:
        batch_norm_triton.LAUNCH = saved


def assert_rounded_once_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Outputs and input gradients in the input's dtype, each side rounded once from fp32 math (or
    float64): one unit in the last place of that dtype (eps, relative), plus fp32's absolute
    tolerance for entries near 0; fp32 results: fp32 tolerance (amp_fx.testing's
    `rounding_tolerances`)."""
    assert actual.dtype == expected.dtype
    rtol, atol = rounding_tolerances(actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def assert_statistics_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Per-channel fp32 statistics that differ in summation order only."""
    assert actual.dtype == torch.float32
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(actual, expected.float(), rtol=rtol, atol=atol)


def assert_channel_sums_close(actual: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor) -> None:
    """Parameter gradients, per-channel sums over M rows of ``terms`` (N, C, ...): fp32 sums in
    another order differ by up to M fp32 units of the sum of |terms|, far from 0 when the sum
    cancels. compare_tensors' ``scale`` is that magnitude; fp32 tolerances, or one unit in the
    last place for gradients rounded to fp16/bf16 parameters."""
    rtol, atol = rounding_tolerances(actual.dtype)
    dims = [d for d in range(terms.dim()) if d != 1]
    scale = terms.double().abs().sum(dims).max().item()
    assert_close_normwise(actual, expected, rtol=rtol, atol=atol, scale=scale, name="channel sums")


def make_case(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    params: str,
    with_residual: bool,
    seed: int,
    device: str,
) -> dict[str, torch.Tensor | None]:
    """A channels_last input with a nonzero mean per channel, parameters, a residual and an
    upstream gradient."""
    generator = torch.Generator().manual_seed(seed)
    num_channels = shape[1]

    def activation(scale: float, offset: float) -> torch.Tensor:
        values = scale * torch.randn(shape, generator=generator) + offset
        values = values.to(dtype).to(device)
        return values.to(memory_format=torch.channels_last) if values.dim() == 4 else values

    param_dtype = dtype if params == "input dtype" else torch.float32
    weight = (torch.rand(num_channels, generator=generator) + 0.5).to(param_dtype).to(device)
    bias = torch.randn(num_channels, generator=generator).to(param_dtype).to(device)
    return {
        "input": activation(2.0, 3.0),
        "weight": None if params == "none" else weight,
        "bias": None if params == "none" else bias,
        "residual": activation(1.0, 0.0) if with_residual else None,
        "grad_out": activation(1.0, 0.0),
    }


def run(implementation, case: dict, relu: bool, stats: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Forward and backward of one implementation; the backward uses ``stats`` (mean, invstd)
    when given, so both implementations' backward kernels see the same statistics."""
    forward = implementation.batch_norm_act_forward(
        case["input"], case["weight"], case["bias"], case["residual"], EPS, relu
    )
    out, mean, invstd, _ = forward
    if stats is not None:
        mean, invstd = stats
    has_residual = case["residual"] is not None
    backward = implementation.batch_norm_act_backward(
        case["grad_out"],
        case["input"],
        case["weight"],
        case["bias"],
        mean,
        invstd,
        out if relu and has_residual else None,
        has_residual,
        relu,
    )
    return forward, backward


def assert_matches(ours, expected, case: dict) -> None:
    (out, mean, invstd, var), (grad_input, grad_weight, grad_bias, grad_residual) = ours
    (ref_out, ref_mean, ref_invstd, ref_var), (ref_gi, ref_gw, ref_gb, ref_gr) = expected
    assert out.stride() == ref_out.stride() and grad_input.stride() == ref_gi.stride()
    assert_rounded_once_close(out, ref_out)
    for actual, wanted in ((mean, ref_mean), (invstd, ref_invstd), (var, ref_var)):
        assert_statistics_close(actual, wanted)
    assert_rounded_once_close(grad_input, ref_gi)
    assert grad_weight.dtype == ref_gw.dtype and grad_bias.dtype == ref_gb.dtype
    grad_out = case["grad_out"]
    assert_channel_sums_close(grad_weight, ref_gw, grad_out * 4)  # |x_hat| < 4 here
    assert_channel_sums_close(grad_bias, ref_gb, grad_out)
    assert grad_residual.shape == ref_gr.shape
    if case["residual"] is not None:
        assert torch.equal(grad_residual, ref_gr)  # dy or 0: exact in any dtype


@given(
    dtype=st.sampled_from(DTYPES),
    params=st.sampled_from(PARAMS),
    with_residual=st.booleans(),
    relu=st.booleans(),
    shape=st.sampled_from(SHAPES),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference(device, dtype, params, with_residual, relu, shape, seed) -> None:
    case = make_case(shape, dtype, params, with_residual, seed, device)
    with launch_config(SMALL):
        ours = run(triton_ops, case, relu)
    expected = run(reference, case, relu, stats=ours[0][1:3])
    assert_matches(ours, expected, case)


@pytest.mark.parametrize("shape", [(2, 200, 3, 3), (3, 64, 4, 4)])
def test_production_launch(device, shape) -> None:
    # The production configuration: 200 channels are two blocks of 128, the second masked.
    case = make_case(shape, torch.float16, "float32", True, 0, device)
    ours = run(triton_ops, case, relu=True)
    expected = run(reference, case, relu=True, stats=ours[0][1:3])
    assert_matches(ours, expected, case)


def test_rows_of_a_contiguous_matrix(device) -> None:
    # An (M, C) contiguous matrix is the same row-major layout as a channels_last activation.
    case = make_case((24, 11), torch.bfloat16, "float32", True, 3, device)
    with launch_config(SMALL):
        ours = run(triton_ops, case, relu=True)
    expected = run(reference, case, relu=True, stats=ours[0][1:3])
    assert_matches(ours, expected, case)


def test_statistics_of_a_large_mean(device) -> None:
    # Values of 1000 +- 1 in fp32: summing x^2 directly would lose the variance to cancellation.
    generator = torch.Generator().manual_seed(4)
    x = (1000 + torch.randn(4, 6, 5, 5, generator=generator)).to(device)
    x = x.to(memory_format=torch.channels_last)
    with launch_config(SMALL):
        _, mean, invstd, var = triton_ops.batch_norm_act_forward(x, None, None, None, EPS, False)
    expected_var, expected_mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=0)
    assert_statistics_close(mean, expected_mean)
    torch.testing.assert_close(var, expected_var.float(), rtol=1e-4, atol=0.0)
    assert_statistics_close(invstd, torch.rsqrt(expected_var + EPS))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_recomputed_mask_is_the_stored_outputs_mask(device, dtype) -> None:
    # Without a residual the backward recomputes relu's mask from x, rounded to the output's
    # dtype: the same mask as reading the output, so the same gradients bit for bit.
    case = make_case((2, 11, 3, 5), dtype, "float32", False, 6, device)
    for implementation in (reference, triton_ops):
        with launch_config(SMALL):
            out, mean, invstd, _ = implementation.batch_norm_act_forward(
                case["input"], case["weight"], case["bias"], None, EPS, True
            )
            args = (case["grad_out"], case["input"], case["weight"], case["bias"], mean, invstd)
            recomputed = implementation.batch_norm_act_backward(*args, None, False, True)
            stored = implementation.batch_norm_act_backward(*args, out, False, True)
        for a, b in zip(recomputed, stored, strict=True):
            assert torch.equal(a, b)


def chunk_sums(values: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """fp32 column sums of an [M, C] matrix over ``num_chunks`` row chunks, as the statistics and
    reduce kernels' programs write them: [num_chunks, C]."""
    return torch.stack([chunk.sum(dim=0) for chunk in values.float().chunk(num_chunks)])


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    """The [M, C] view of a channels_last (N, C, H, W) tensor."""
    return tensor.permute(0, 2, 3, 1).reshape(-1, tensor.shape[1])


@pytest.mark.parametrize("running_dtype", DTYPES)
def test_finalize_statistics_matches_reference(device, running_dtype) -> None:
    # Partial sums of 5 row chunks (3 iterations of 2 rows of partials, the last masked), 11
    # channels (3 programs of 4, the last masked), around a shift of row 0, as the kernel gets them.
    case = make_case((3, 11, 3, 4), torch.bfloat16, "none", False, 2, device)
    x = case["input"]
    shifted = rows_of(x).float() - rows_of(x)[0].float()
    partials = torch.stack([chunk_sums(shifted, 5), chunk_sums(shifted * shifted, 5)]).contiguous()
    generator = torch.Generator().manual_seed(3)
    running = [
        (torch.randn(11, generator=generator) + 2.0).to(running_dtype).to(device),
        (torch.rand(11, generator=generator) + 0.5).to(running_dtype).to(device),
    ]
    ours_running = [t.clone() for t in running]
    expected_running = [t.clone() for t in running]
    with launch_config(SMALL):
        mean, invstd, var = batch_norm_triton.finalize_statistics(
            x, partials, EPS, *ours_running, momentum=0.25
        )
    _, ref_mean, ref_invstd, ref_var = reference.batch_norm_act_forward(
        x,
        None,
        None,
        None,
        EPS,
        False,
        running_mean=expected_running[0],
        running_var=expected_running[1],
        momentum=0.25,
    )
    for actual, wanted in ((mean, ref_mean), (invstd, ref_invstd), (var, ref_var)):
        assert_statistics_close(actual, wanted)
    # The running statistics: float64 from the buffers, rounded once (the reference: fp32 math).
    batch_var, batch_mean = torch.var_mean(x.double(), dim=(0, 2, 3), correction=1)
    for actual, wanted, old, batch in zip(
        ours_running, expected_running, running, (batch_mean, batch_var), strict=True
    ):
        assert actual.dtype == running_dtype
        exact = 0.75 * old.double() + 0.25 * batch
        assert_rounded_once_close(actual, exact.to(running_dtype))
        rtol, atol = tolerances(running_dtype)
        torch.testing.assert_close(actual, wanted, rtol=rtol, atol=atol)


@pytest.mark.parametrize("params", ["float32", "input dtype", "none"])
def test_finalize_backward_matches_reference(device, params) -> None:
    case = make_case((2, 11, 3, 5), torch.float16, params, False, 4, device)
    x, dy, weight, bias = case["input"], case["grad_out"], case["weight"], case["bias"]
    _, mean, invstd, _ = reference.batch_norm_act_forward(x, weight, bias, None, EPS, False)
    centered = rows_of(x).float() - mean
    partials = torch.stack([chunk_sums(rows_of(dy), 5), chunk_sums(rows_of(dy).float() * centered, 5)])
    weight_dtype = torch.float32 if weight is None else weight.dtype
    bias_dtype = torch.float32 if bias is None else bias.dtype
    with launch_config(SMALL):
        grad_weight, grad_bias, mean_dy, coefficient = batch_norm_triton.finalize_backward(
            partials.contiguous(), invstd, 30, weight_dtype, bias_dtype
        )
    expected = reference.batch_norm_act_backward(dy, x, weight, bias, mean, invstd, None, False, False)
    assert grad_weight.dtype == expected[1].dtype and grad_bias.dtype == expected[2].dtype
    assert_channel_sums_close(grad_weight, expected[1], dy * 4)
    assert_channel_sums_close(grad_bias, expected[2], dy)
    # The input gradient's coefficients: grad_bias / M and invstd * grad_weight / M, in fp32.
    sum_dy = rows_of(dy).double().sum(dim=0)
    sum_dy_centered = (rows_of(dy).double() * centered.double()).sum(dim=0)
    assert mean_dy.dtype == coefficient.dtype == torch.float32
    assert_channel_sums_close(mean_dy, sum_dy / 30, dy / 30)
    expected_coefficient = invstd.double() ** 2 * sum_dy_centered / 30
    assert_channel_sums_close(coefficient, expected_coefficient, dy * 4 * invstd.max() / 30)


@pytest.mark.parametrize("momentum", [0.1, 1.0])
def test_forward_updates_running_stats_like_the_reference(device, momentum) -> None:
    case = make_case((2, 11, 3, 5), torch.float16, "float32", True, 5, device)
    buffers = {
        name: [torch.full((11,), 0.5, device=device), torch.full((11,), 2.0, device=device)]
        for name in ("triton", "reference")
    }
    versions = [t._version for t in buffers["triton"]]
    arguments = (case["input"], case["weight"], case["bias"], case["residual"], EPS, True)
    with launch_config(SMALL):
        ours = triton_ops.batch_norm_act_forward(
            *arguments, running_mean=buffers["triton"][0], running_var=buffers["triton"][1], momentum=momentum
        )
    expected = reference.batch_norm_act_forward(
        *arguments,
        running_mean=buffers["reference"][0],
        running_var=buffers["reference"][1],
        momentum=momentum,
    )
    assert_rounded_once_close(ours[0], expected[0])
    rtol, atol = tolerances(torch.float32)
    for actual, wanted in zip(buffers["triton"], buffers["reference"], strict=True):
        torch.testing.assert_close(actual, wanted, rtol=rtol, atol=atol)
    # Written through data pointers, but autograd sees the in-place update.
    assert all(t._version > v for t, v in zip(buffers["triton"], versions, strict=True))


_ONE_BUFFER = torch.zeros(3)


@pytest.mark.parametrize(
    ("running", "message"),
    [
        ((torch.zeros(3), None), "both running_mean and running_var"),
        ((torch.zeros(3), torch.ones(3, dtype=torch.float16)), "must have one dtype"),
        ((torch.zeros(4), torch.ones(4)), "running_mean must be a contiguous 1-D float tensor of 3"),
        ((torch.zeros(3), torch.ones(6)[::2]), "running_var must be a contiguous"),
        ((_ONE_BUFFER, _ONE_BUFFER), "share memory"),
    ],
)
def test_bad_running_stats_raise_the_same_errors(running, message) -> None:
    x = torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match=message):
            implementation.batch_norm_act_forward(
                x, None, None, None, EPS, True, running_mean=running[0], running_var=running[1]
            )
    one_row = torch.zeros(1, 3, 1, 1).to(memory_format=torch.channels_last)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            implementation.batch_norm_act_forward(
                one_row, None, None, None, EPS, True, running_mean=torch.zeros(3), running_var=torch.ones(3)
            )


def test_relu_keeps_nan(device) -> None:
    case = make_case((2, 3, 2, 2), torch.float16, "none", False, 1, device)
    case["input"][0, 1, 0, 0] = float("nan")
    for implementation in (reference, triton_ops):
        out, mean, _, _ = implementation.batch_norm_act_forward(case["input"], None, None, None, EPS, True)
        assert out[:, 1].isnan().all() and mean[1].isnan()
        assert out[:, 0].isfinite().all() and out[:, 2].isfinite().all()


def test_strided_parameters(device) -> None:
    # The kernels index weight and bias by channel: a strided (C,) view must give the same result.
    case = make_case((2, 5, 3, 3), torch.float16, "float32", False, 9, device)
    strided = {k: torch.stack([case[k], case[k]], dim=1)[:, 0] for k in ("weight", "bias")}
    assert not strided["weight"].is_contiguous()
    with launch_config(SMALL):
        ours = run(triton_ops, {**case, **strided}, relu=True)
        expected = run(triton_ops, case, relu=True)
    for actual, wanted in zip(ours[0] + ours[1], expected[0] + expected[1], strict=True):
        assert torch.equal(actual, wanted)


def test_other_layouts_are_refused_by_the_triton_wrapper() -> None:
    x = torch.randn(2, 3, 4, 4)  # NCHW
    with pytest.raises(ValueError, match="channels_last"):
        triton_ops.batch_norm_act_forward(x, None, None, None, EPS, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(input=torch.zeros(2, 3, 2, 2, dtype=torch.float64)), "float64"),
        (dict(input=torch.zeros(2, 0, 2, 2)), "at least one channel"),
        (dict(weight=torch.ones(4)), "weight must be a 1-D float tensor of 3 channels"),
        (dict(bias=torch.ones(3, dtype=torch.int64)), "bias must be a 1-D float tensor"),
        (dict(residual=torch.zeros(2, 3, 2, 2, dtype=torch.float16)), "residual must match input"),
    ],
)
def test_bad_arguments_raise_the_same_errors(kwargs, message) -> None:
    arguments = dict(input=torch.zeros(2, 3, 2, 2), weight=None, bias=None, residual=None)
    arguments.update(kwargs)
    arguments["input"] = arguments["input"].to(memory_format=torch.channels_last)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match=message):
            implementation.batch_norm_act_forward(*arguments.values(), EPS, True)
    x = torch.zeros(2, 3, 2, 2)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match="needs the forward's output"):
            implementation.batch_norm_act_backward(
                x, x, None, None, torch.zeros(3), torch.ones(3), None, has_residual=True, relu=True
            )
        with pytest.raises(ValueError, match="mean must be float32"):
            implementation.batch_norm_act_backward(
                x, x, None, None, torch.zeros(3).half(), torch.ones(3), None, has_residual=False, relu=True
            )


def float64_forward_backward(case: dict, relu: bool) -> tuple[torch.Tensor, ...]:
    """Output and gradients of ``relu(F.batch_norm(x) + residual)`` computed by torch in float64."""

    def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().double().requires_grad_(True)

    x, weight, bias, residual = (leaf(case[k]) for k in ("input", "weight", "bias", "residual"))
    out = F.batch_norm(x, None, None, weight, bias, training=True, eps=EPS)
    if residual is not None:
        out = out + residual
    if relu:
        out = F.relu(out)
    out.backward(case["grad_out"].double())
    return out, x.grad, weight, bias, residual


@given(
    dtype=st.sampled_from(DTYPES),
    params=st.sampled_from(PARAMS),
    with_residual=st.booleans(),
    relu=st.booleans(),
    shape=st.sampled_from(SHAPES),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_float64(dtype, params, with_residual, relu, shape, seed) -> None:
    case = make_case(shape, dtype, params, with_residual, seed, "cpu")
    (out, mean, invstd, var), (grad_input, grad_weight, grad_bias, grad_residual) = run(reference, case, relu)
    expected_out, expected_gi, weight, bias, residual = float64_forward_backward(case, relu)
    expected_var, expected_mean = torch.var_mean(case["input"].double(), dim=(0, 2, 3), correction=0)
    assert_rounded_once_close(out, expected_out.to(dtype))
    assert_statistics_close(mean, expected_mean)
    assert_statistics_close(var, expected_var)
    assert_statistics_close(invstd, torch.rsqrt(expected_var + EPS))
    assert_rounded_once_close(grad_input, expected_gi.to(dtype))
    if weight is not None:
        assert grad_weight.dtype == case["weight"].dtype
        assert_channel_sums_close(grad_weight, weight.grad, case["grad_out"] * 4)
        assert_channel_sums_close(grad_bias, bias.grad, case["grad_out"])
    if residual is not None:
        assert torch.equal(grad_residual, residual.grad.to(dtype))
    else:
        assert grad_residual.numel() == 0
    assert math.isfinite(out.float().sum().item())


@pytest.mark.gpu
def test_resnet_sized_stage_on_gpu() -> None:
    # ResNet-50's stage 3 output BatchNorm: 1024 channels at 14 x 14, batch 32, with its residual.
    case = make_case((32, 1024, 14, 14), torch.float16, "float32", True, 8, "cuda")
    ours = run(triton_ops, case, relu=True)
    expected = run(reference, case, relu=True, stats=ours[0][1:3])
    assert_matches(ours, expected, case)
