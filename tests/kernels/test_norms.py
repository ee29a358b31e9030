"""The norm kernels: the reference against float64 and torch.autocast, Triton against the reference.

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same checks run on CUDA when marked
`gpu`. Widths include odd ones (123, 1000) that leave most of the last power-of-two block masked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.testing import assert_close_normwise, grad_tolerances, rounding_tolerances, tolerances

LOW_DTYPES = [torch.float16, torch.bfloat16]
# (rows, D) of the shapes the tests use: 5 x 123 and 3 x 7 x 1000 flattened.
SHAPES = [(5, 123), (21, 1000)]
EPS = 1e-5


def make_case(
    shape, dtype, seed, *, residual=False, subtract_mean=False, device="cpu", stream_dtype=torch.float32
):
    """x (and residual: the residual stream, fp32 unless ``stream_dtype``), weight and bias (fp32),
    upstream gradients."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = shape

    def randn(*size):
        return torch.randn(*size, generator=generator).to(device)

    x = (2 * randn(rows, width) + 0.5).to(dtype)
    return {
        "x": x,
        "residual": randn(rows, width).to(stream_dtype) if residual else None,
        "weight": 1 + 0.3 * randn(width),
        "bias": 0.2 * randn(width) if subtract_mean else None,
        "grad_out": randn(rows, width).to(dtype),
        "grad_sum": randn(rows, width).to(stream_dtype) if residual else None,
    }


def float64_chain(case, subtract_mean, weight_offset=0.0):
    """The chain the kernels replace, in float64 with autograd: (out, summed, grads by name)."""
    leaves = {
        name: case[name].detach().double().requires_grad_()
        for name in ("x", "residual", "weight", "bias")
        if case[name] is not None
    }
    s = leaves["x"] + leaves["residual"] if "residual" in leaves else leaves["x"]
    if subtract_mean:
        y = F.layer_norm(s, s.shape[-1:], leaves["weight"], leaves["bias"], EPS)
    else:
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * (leaves["weight"] + weight_offset)
    outputs, grads = [y], [case["grad_out"].double()]
    if case["grad_sum"] is not None:
        outputs.append(s)
        grads.append(case["grad_sum"].double())
    torch.autograd.backward(outputs, grads)
    return y, s, {name: leaf.grad for name, leaf in leaves.items()}


def run(implementation, case, *, subtract_mean, weight_offset=0.0, out_dtype=None, mid_dtype=None):
    """Forward and backward through one implementation: (out, summed, grads by name)."""
    x, residual = case["x"], case["residual"]
    out, summed, mean, rstd = implementation.norm_forward(
        x, case["weight"], case["bias"], EPS, residual=residual, subtract_mean=subtract_mean,
        weight_offset=weight_offset, mid_dtype=mid_dtype, out_dtype=out_dtype,
    )  # fmt: skip
    grad_out = case["grad_out"].to(out.dtype)
    grad_x, grad_residual, grad_weight, grad_bias = implementation.norm_backward(
        grad_out, case["grad_sum"], summed if summed is not None else x, case["weight"], mean, rstd,
        bias_dtype=None if case["bias"] is None else case["bias"].dtype, subtract_mean=subtract_mean,
        weight_offset=weight_offset, mid_dtype=mid_dtype, grad_dtype=x.dtype,
        residual_grad_dtype=None if residual is None else residual.dtype,
    )  # fmt: skip
    grads = {"x": grad_x, "residual": grad_residual, "weight": grad_weight, "bias": grad_bias}
    return out, summed, {name: grad for name, grad in grads.items() if grad is not None}


def assert_grads_close(grads, expected):
    assert set(grads) == set(expected)
    for name, grad in grads.items():
        rtol, atol = rounding_tolerances(grad.dtype)
        # Norm-wise: a gradient through a normalization is a difference of O(1) terms.
        assert_close_normwise(grad, expected[name], rtol=4 * rtol, atol=atol, name=name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "add"])
def test_reference_matches_float64(shape, dtype, subtract_mean, residual) -> None:
    case = make_case(shape, dtype, seed=1, residual=residual, subtract_mean=subtract_mean)
    out, summed, grads = run(reference, case, subtract_mean=subtract_mean)
    expected, expected_sum, expected_grads = float64_chain(case, subtract_mean)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), rtol=rounding_tolerances(dtype)[0], atol=1e-6)
    if residual:
        assert summed.dtype == torch.float32
        torch.testing.assert_close(summed, expected_sum.float())
    assert grads["weight"].dtype == torch.float32  # the master's dtype: no rounding on the way
    assert_grads_close(grads, expected_grads)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_gemma_offset_and_a_rounding_before_the_weight(dtype) -> None:
    case = make_case((5, 123), dtype, seed=2)
    out, _, grads = run(reference, case, subtract_mean=False, weight_offset=1.0, out_dtype=torch.float32)
    expected, _, expected_grads = float64_chain(case, False, weight_offset=1.0)
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(out, expected.float(), rtol=rtol, atol=atol)
    assert_grads_close(grads, expected_grads)
    # Llama's ``weight * x.to(input_dtype)``: rounded to the input's dtype before the weight.
    rounded, _, _ = run(reference, case, subtract_mean=False, mid_dtype=dtype, out_dtype=torch.float32)
    x = case["x"].float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    torch.testing.assert_close(rounded, case["weight"] * normed, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_reference_matches_autocast(dtype) -> None:
    # torch.autocast("cpu") runs layer_norm on the low input with fp32 weights, in fp32 math, and
    # writes the input's dtype (CUDA's writes fp32): the kernel computes it from the same reads.
    case = make_case((21, 1000), dtype, seed=3, subtract_mean=True)
    x = case["x"].detach().requires_grad_()
    weight = case["weight"].detach().requires_grad_()
    bias = case["bias"].detach().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        expected = F.layer_norm(x, (1000,), weight, bias, EPS)
    expected.backward(case["grad_out"].float())
    out, _, grads = run(reference, case, subtract_mean=True, out_dtype=expected.dtype)
    rtol, atol = rounding_tolerances(expected.dtype)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    assert grads["x"].dtype == dtype and grads["weight"].dtype == torch.float32
    # CPU autocast's backward rounds through the low dtype (its weight gradient too): the suite's
    # gradient tolerances for a low-precision recipe against another.
    rtol, atol = grad_tolerances(dtype)
    for name, expected_grad in (("x", x.grad), ("weight", weight.grad), ("bias", bias.grad)):
        assert_close_normwise(grads[name], expected_grad, rtol=rtol, atol=atol, name=name)


# How many units in float32's last place the forward's statistics (mean, rstd) may differ by
# between the implementations: reductions of D values summed in another order.
STATISTICS_ULPS = 4


def mid_rounding_slack(case, *, subtract_mean, weight_offset=0.0, mid_dtype=None, **_):
    """Both implementations round n = (s - mean) * rstd to ``mid_dtype`` at the same point, but
    their reductions sum in another order: mean and rstd differ in their last float32 bits, and an
    n that close to a rounding midpoint of ``mid_dtype`` rounds to the other neighbour, one unit of
    ``mid_dtype`` apart. Returns (out's extra tolerance (rows, D), the weight gradient's (D,), the
    mask of those n), all zero but at those few n; None without a ``mid_dtype``."""
    if mid_dtype is None:
        return None
    x = case["x"]
    _, summed, mean, rstd = reference.norm_forward(
        x, None, None, EPS, residual=case["residual"], subtract_mean=subtract_mean
    )
    s = (summed if summed is not None else x).float()
    centered = s - mean[:, None] if subtract_mean else s
    n = centered * rstd[:, None]
    # How far n may move: its own last bits, and (LayerNorm) the mean's, scaled by rstd.
    scale = n.abs() + (mean.abs()[:, None] * rstd[:, None] if subtract_mean else 0.0)
    reach = STATISTICS_ULPS * torch.finfo(torch.float32).eps * scale
    flips = (n - reach).to(mid_dtype) != (n + reach).to(mid_dtype)
    # One unit of mid_dtype at n is at most |n| * its eps; out has it times the weight, the
    # weight's gradient times the upstream gradient, summed over the rows.
    step = flips * n.abs() * torch.finfo(mid_dtype).eps
    out_slack = step * (case["weight"].float() + weight_offset).abs()
    weight_slack = (step * case["grad_out"].float().abs()).sum(dim=0)
    return out_slack, weight_slack, flips


def assert_same_results(ours, expected, slack=None):
    """Triton's results against the reference's: each rounded once (one unit of its dtype), the
    gradients summed over rows in another order; ``slack`` (`mid_rounding_slack`) adds what a
    flipped mid rounding may add to out and the weight's gradient."""
    (out, summed, grads), (ref_out, ref_summed, ref_grads) = ours, expected
    out_slack, weight_slack, _ = slack if slack is not None else (0.0, 0.0, None)
    rtol, atol = rounding_tolerances(out.dtype)
    _assert_within(out, ref_out, rtol, atol + out_slack, "out")
    if ref_summed is not None:
        assert torch.equal(summed, ref_summed)  # one add, rounded once, on both sides
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert grad.dtype == ref_grads[name].dtype
        rtol, atol = rounding_tolerances(grad.dtype)
        _assert_within(
            grad, ref_grads[name], rtol, atol * 10 + (weight_slack if name == "weight" else 0.0), name
        )


def _assert_within(actual, expected, rtol, atol, name):
    """|actual - expected| <= atol + rtol * |expected| element-wise (atol may be a tensor)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    difference = (actual.double() - expected.double()).abs()
    allowed = atol + rtol * expected.double().abs()
    worst = (difference - allowed).argmax()
    assert (difference <= allowed).all(), (
        f"{name}: {int((difference > allowed).sum())} of {difference.numel()} elements differ by more "
        f"than allowed, the worst by {difference.flatten()[worst].item():.3g} "
        f"(allowed {allowed.flatten()[worst].item():.3g})"
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_triton_matches_reference(device, shape, dtype, subtract_mean) -> None:
    case = make_case(shape, dtype, seed=4, residual=True, subtract_mean=subtract_mean, device=device)
    options = {"subtract_mean": subtract_mean, "out_dtype": torch.float32}
    assert_same_results(run(triton_ops, case, **options), run(reference, case, **options))


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_a_low_residual_stream(device, dtype, subtract_mean) -> None:
    # O2 with low_precision_residual: stream and branch low, the sum written low and normalized as
    # rounded; the stream's gradient written low.
    case = make_case(
        (5, 123), dtype, 7, residual=True, subtract_mean=subtract_mean, device=device, stream_dtype=dtype
    )
    options = {"subtract_mean": subtract_mean, "out_dtype": dtype}
    ours = run(triton_ops, case, **options)
    expected = run(reference, case, **options)
    assert_same_results(ours, expected)
    out, summed, grads = expected
    assert summed.dtype == grads["residual"].dtype == grads["x"].dtype == dtype
    assert torch.equal(summed, case["x"] + case["residual"])  # torch's low-precision add
    chain, _, _ = float64_chain({**case, "x": summed, "residual": None, "grad_sum": None}, subtract_mean)
    torch.testing.assert_close(out, chain.to(dtype), rtol=2 * rounding_tolerances(dtype)[0], atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 70),
    dtype=st.sampled_from(LOW_DTYPES + [torch.float32]),
    subtract_mean=st.booleans(),
    residual=st.booleans(),
    weight_offset=st.sampled_from([0.0, 1.0]),
    mid_dtype=st.sampled_from([None, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference_everywhere(
    device, rows, width, dtype, subtract_mean, residual, weight_offset, mid_dtype, seed
) -> None:
    case = make_case(
        (rows, width), dtype, seed, residual=residual, subtract_mean=subtract_mean, device=device
    )
    options = {"subtract_mean": subtract_mean, "weight_offset": weight_offset, "mid_dtype": mid_dtype}
    slack = mid_rounding_slack(case, **options)
    assert_same_results(run(triton_ops, case, **options), run(reference, case, **options), slack)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_a_rounding_before_the_weight_at_a_midpoint(device, dtype, subtract_mean) -> None:
    # Llama's ``weight * x.to(input_dtype)`` (mid_dtype: the input's) after a residual add, fp32 out.
    # Both implementations round n at the same point; their reductions sum in another order, so an
    # n at a rounding midpoint of mid_dtype may round either way: out and the fp32 weight gradient
    # then differ by one unit of mid_dtype at that n, and only there.
    # Seed 3: on CPU each of the four cases has such an n that rounds apart.
    case = make_case((21, 1000), dtype, 3, residual=True, subtract_mean=subtract_mean, device=device)
    options = {"subtract_mean": subtract_mean, "mid_dtype": dtype, "out_dtype": torch.float32}
    slack = mid_rounding_slack(case, **options)
    flips = slack[2]
    assert 0 < int(flips.sum()) <= flips.numel() // 100  # the case has such n, and few of them
    ours, expected = run(triton_ops, case, **options), run(reference, case, **options)
    assert_same_results(ours, expected, slack)


def test_strided_rows_and_no_rows(device) -> None:
    wide = make_case((4, 40), torch.bfloat16, seed=5, device=device)
    narrow = {name: value for name, value in wide.items()}
    narrow["x"] = wide["x"][:, 3:20]  # row stride 40, rows contiguous
    narrow["grad_out"] = wide["grad_out"][:, 3:20].contiguous()
    narrow["weight"] = wide["weight"][3:20].contiguous()
    ours = run(triton_ops, narrow, subtract_mean=False)
    assert_same_results(ours, run(reference, narrow, subtract_mean=False))
    empty = make_case((0, 8), torch.float16, seed=6, device=device)
    out, _, grads = run(triton_ops, empty, subtract_mean=True)
    assert out.shape == (0, 8) and torch.equal(grads["weight"], torch.zeros(8, device=device))


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_outputs_are_tensors_of_their_own(device, implementation) -> None:
    """The op returns the kernels' outputs as a custom op's, which may alias nothing: no output
    shares memory with an input or another one, where the gradients of an fp32 x and an fp32
    residual are the same values too."""
    if implementation == "triton" and triton_ops is None:
        pytest.skip("needs Triton")
    kernels = reference if implementation == "reference" else triton_ops
    x, residual, weight = (torch.randn(shape, device=device) for shape in ((4, 32), (4, 32), (32,)))
    out, summed, mean, rstd = kernels.norm_forward(x, weight, None, EPS, residual=residual)
    grad_out, grad_sum = torch.randn_like(x), torch.randn_like(x)
    grads = kernels.norm_backward(
        grad_out, grad_sum, summed, weight, mean, rstd, bias_dtype=torch.float32,
        grad_dtype=torch.float32, residual_grad_dtype=torch.float32,
    )  # fmt: skip
    for tensors in (
        (x, residual, weight, out, summed, rstd),
        (grad_out, grad_sum, summed, weight, rstd, *grads),
    ):
        storages = [tensor.untyped_storage().data_ptr() for tensor in tensors]
        assert len(set(storages)) == len(storages)


def test_bad_arguments_are_refused_before_any_work() -> None:
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"must be 2-D \(rows, D\)"):
        reference.norm_forward(x.reshape(3, 2, 4), None, None, EPS)
    with pytest.raises(ValueError, match=r"must be a \(8,\) vector"):
        reference.norm_forward(x, torch.ones(4), None, EPS)
    with pytest.raises(ValueError, match="rows are not contiguous"):
        reference.norm_forward(torch.randn(8, 3).t(), None, None, EPS)
    with pytest.raises(ValueError, match="sum_dtype is for a residual add"):
        reference.norm_forward(x, None, None, EPS, sum_dtype=torch.float32)
    with pytest.raises(ValueError, match="x's shape"):
        reference.norm_forward(x, None, None, EPS, residual=torch.randn(3, 4))


@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_the_forward_records_what_record_range_records(device, implementation, dtype, subtract_mean) -> None:
    # amp_fx.watch asks the kernel for the range statistics of out and the sum it writes: the same
    # as record_range_ of each (the range_stats reference), out unchanged. A low-precision stream
    # with an overflowing sum, a NaN, huge weights (out overflows) and tiny ones (out underflows).
    if implementation == "triton" and triton_ops is None:
        pytest.skip("needs Triton")
    kernels = reference if implementation == "reference" else triton_ops
    case = make_case(
        (21, 1000), dtype, 9, residual=True, subtract_mean=subtract_mean, device=device, stream_dtype=dtype
    )
    x, residual = case["x"].clone(), case["residual"].clone()
    x[0, :4] = torch.finfo(dtype).max
    residual[0, :4] = torch.finfo(dtype).max
    x[3, 7] = float("nan")
    weight = case["weight"].clone()
    weight[:5], weight[5:10] = 1e6, torch.finfo(dtype).tiny / 4
    options = {"residual": residual, "subtract_mean": subtract_mean, "out_dtype": dtype}
    amax = torch.full((5,), 0.25, device=device)  # accumulates onto what is there
    counts = torch.arange(15, device=device)
    record = (amax, counts, (3, 1))
    out, summed, _, _ = kernels.norm_forward(x, weight, case["bias"], EPS, record=record, **options)
    unrecorded, _, _, _ = kernels.norm_forward(x, weight, case["bias"], EPS, **options)
    assert torch.equal(out.view(torch.int16), unrecorded.view(torch.int16))
    expected = (torch.full((5,), 0.25, device=device), torch.arange(15, device=device))
    reference.record_range_(out, *expected, 3)
    reference.record_range_(summed, *expected, 1)
    assert torch.equal(amax, expected[0]) and torch.equal(counts, expected[1])
    added = (counts - torch.arange(15, device=device)).view(-1, 3)
    assert added[3, 1] > 0 and added[1, 1] > 0  # the cases are there: inf/NaN in out and the sum
    # (fp16's smallest normal times n is a normal fp32 value; bf16's is not, which a GPU may flush.)
    assert added[3, 0] > 0 or dtype == torch.bfloat16
    # Only what is asked: the sum alone, and nothing.
    only_sum = (torch.zeros(5, device=device), torch.zeros(15, dtype=torch.int64, device=device), (None, 1))
    kernels.norm_forward(x, weight, case["bias"], EPS, record=only_sum, **options)
    assert only_sum[0].count_nonzero() == 1 and only_sum[1].view(-1, 3)[3].sum() == 0


def test_a_record_that_does_not_fit_is_refused() -> None:
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    amax, counts = torch.zeros(4), torch.zeros(12, dtype=torch.int64)
    with pytest.raises(ValueError, match="one per value the kernel writes"):
        reference.norm_forward(x, None, None, EPS, record=(amax, counts, (1,)))
    with pytest.raises(ValueError, match="a value this call does not write"):
        reference.norm_forward(x, None, None, EPS, record=(amax, counts, (1, 2)))
    with pytest.raises(ValueError, match="index must be an int in"):
        reference.norm_forward(x, None, None, EPS, record=(amax, counts, (4, None)))
