"""The rotary kernels: Triton against the pure-torch reference (bit for bit) and the argument
checks (the op built on them, against the torch chain: tests/ops/test_rotary.py).

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same checks run on CUDA when marked
`gpu`. Sizes are small and odd (3 or 5 heads, 5 positions, pass-through widths of 2 and 6).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.kernels.rotary import triton as rotary_triton
from amp_fx.testing import rounding_tolerances

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# (q shape, cos shape, interleaved, transposed): q as [batch, heads, seq, dim] (the transposed view
# of a projection, as Llama makes it) or [batch, seq, heads, dim] (GPT-J), cos per batch or shared.
CASES = [
    ((2, 3, 5, 8), (2, 1, 5, 8), False, True),  # Llama: 3 heads, cos per batch
    ((2, 5, 5, 8), (1, 1, 5, 8), False, True),  # cos shared over the batch
    ((2, 3, 5, 10), (2, 1, 5, 4), False, True),  # partial: 4 of 10 features (GPT-NeoX, Phi)
    ((2, 5, 3, 8), (2, 5, 1, 8), True, False),  # GPT-J: interleaved, heads third
    ((2, 5, 3, 12), (2, 5, 1, 6), True, False),  # GPT-J partial
    ((5, 3, 6), (5, 1, 6), False, False),  # 3-D: [seq, heads, dim]
    ((3, 6), (6,), True, False),  # 2-D, one cos row for every position
]


def make_inputs(case, dtype, device, seed=0, cos_dtype=torch.float32):
    shape, cos_shape, interleaved, transposed = case
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=generator).to(dtype)
    if transposed:  # the strides of a [batch, seq, heads, dim] projection viewed as [batch, heads, seq, dim]
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    cos = torch.randn(cos_shape, generator=generator).to(cos_dtype)
    sin = torch.randn(cos_shape, generator=generator).to(cos_dtype)
    return q.to(device), cos.to(device), sin.to(device), interleaved


def run_both(xs, cos, sin, interleaved, out_dtypes, grad_dtypes):
    """Forward and backward with the Triton kernels and the reference; the reference on CPU copies."""
    ours = triton_ops.rotary_forward(xs, cos, sin, interleaved, out_dtypes)
    ours_grad = triton_ops.rotary_backward(ours, cos, sin, interleaved, grad_dtypes)
    cpu = [x.cpu() for x in xs]
    expected = reference.rotary_forward(cpu, cos.cpu(), sin.cpu(), interleaved, out_dtypes)
    expected_grad = reference.rotary_backward(expected, cos.cpu(), sin.cpu(), interleaved, grad_dtypes)
    return (ours, ours_grad), (expected, expected_grad)


def assert_matches_reference(ours, expected) -> None:
    """Bit for bit where the kernel is interpreted; compiled for a GPU, within one rounding: the
    compiler contracts ``a * c - b * s`` into fused multiply-adds, which round once less."""
    for mine, theirs in zip(ours, expected, strict=True):
        assert mine.dtype == theirs.dtype and mine.stride() == theirs.stride()
        rtol, atol = rounding_tolerances(mine.dtype) if mine.is_cuda else (0, 0)
        torch.testing.assert_close(mine.cpu(), theirs, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("case", "dtype"), [(case, DTYPES[i % 3]) for i, case in enumerate(CASES)])
def test_triton_matches_reference(device, case, dtype) -> None:
    q, cos, sin, interleaved = make_inputs(case, dtype, device)
    for out_dtype in (dtype, torch.float32):
        (ours, ours_grad), (expected, expected_grad) = run_both(
            [q], cos, sin, interleaved, [out_dtype], [dtype]
        )
        assert_matches_reference(ours, expected)
        assert_matches_reference(ours_grad, expected_grad)


@pytest.mark.parametrize(
    ("k_shape", "cos_shape", "launches"),
    [
        ((2, 1, 5, 8), (2, 1, 5, 8), 1),  # grouped-query: 3 query heads, 1 key head
        ((1, 2, 5, 8), (1, 1, 5, 8), 2),  # another batch size: the positions differ
    ],
)
def test_query_and_key_together(device, monkeypatch, k_shape, cos_shape, launches) -> None:
    calls = []
    launch = rotary_triton._launch
    monkeypatch.setattr(rotary_triton, "_launch", lambda *args: calls.append(1) or launch(*args))
    q, cos, sin, _ = make_inputs(((2, 3, 5, 8), cos_shape, False, True), torch.bfloat16, device)
    k = torch.randn(k_shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    (ours, ours_grad), (expected, expected_grad) = run_both(
        [q, k], cos, sin, False, [torch.bfloat16, torch.float32], [torch.bfloat16, torch.bfloat16]
    )
    assert_matches_reference(ours, expected)
    assert_matches_reference(ours_grad, expected_grad)
    assert len(calls) == 2 * launches  # forward and backward


@given(
    dtype=st.sampled_from(DTYPES),
    heads=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    seq=st.integers(1, 4),
    pairs=st.integers(1, 5),
    passed=st.integers(0, 3),
    interleaved=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference_any_size(
    device, dtype, heads, kv_heads, seq, pairs, passed, interleaved, seed
) -> None:
    width = 2 * pairs + passed
    q, cos, sin, interleaved = make_inputs(
        ((2, heads, seq, width), (1, 1, seq, 2 * pairs), interleaved, True), dtype, device, seed
    )
    k = make_inputs(((2, kv_heads, seq, width), (1,), False, False), dtype, device, seed + 1)[0]
    ours, expected = run_both([q, k], cos, sin, interleaved, [dtype, dtype], [dtype, dtype])
    for mine, theirs in zip(ours, expected, strict=True):
        assert_matches_reference(mine, theirs)


@pytest.mark.parametrize(
    ("cos_shape", "message"),
    [((5, 7), "odd number"), ((5, 10), "between 2"), ((2, 2, 5, 8), "does not broadcast")],
)
def test_kernels_refuse_bad_arguments(cos_shape, message) -> None:
    q = torch.randn(2, 3, 5, 8)
    cos = torch.randn(cos_shape)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match=message):
            implementation.rotary_forward([q], cos, cos, False, [torch.float32])
    with pytest.raises(ValueError, match="features but sin has"):
        reference.rotary_forward([q], torch.randn(5, 8), torch.randn(5, 6), False, [torch.float32])
    with pytest.raises(ValueError, match="one dtype per tensor"):
        reference.rotary_backward([q, q], torch.randn(5, 8), torch.randn(5, 8), False, [torch.float32])
    with pytest.raises(TypeError, match="one or two tensors"):
        triton_ops.rotary_forward(q, torch.randn(5, 8), torch.randn(5, 8), False, [torch.float32])


@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_forward_records_what_record_range_records(device, implementation, dtype) -> None:
    # amp_fx.watch asks the kernel for the range statistics of the outputs it writes: the same as
    # record_range_ of each (the range_stats reference), outputs unchanged. A query and key in one
    # launch (the key's statistics not asked for), and a partial rotary with pass-through features;
    # overflowing, NaN and underflowing values among them.
    if implementation == "triton" and triton_ops is None:
        pytest.skip("needs Triton")
    kernels = reference if implementation == "reference" else triton_ops
    generator = torch.Generator().manual_seed(2)
    q, k = (
        torch.randn(shape, generator=generator).to(dtype).to(device)
        for shape in ((2, 4, 3, 16), (2, 2, 3, 16))
    )
    q[0, 0, 0, :4] = torch.finfo(dtype).max
    q[0, 1, 0, 5] = float("nan")
    q[1, 0, 2, :] = torch.finfo(dtype).tiny / 2  # subnormal, and passed through below
    tables = torch.randn(1, 1, 3, 16, generator=generator).to(device)
    partial = torch.randn(2, 1, 3, 10, generator=generator).to(device)
    for xs, cos, interleaved, indices in (([q, k], tables, False, (1, None)), ([q], partial, True, (3,))):
        amax, counts = torch.full((4,), 0.5, device=device), torch.arange(12, device=device)
        expected = (amax.clone(), counts.clone())
        out_dtypes = [dtype] * len(xs)
        outs = kernels.rotary_forward(xs, cos, cos.flip(-1), interleaved, out_dtypes, (amax, counts, indices))
        plain = kernels.rotary_forward(xs, cos, cos.flip(-1), interleaved, out_dtypes)
        for out, unrecorded, index in zip(outs, plain, indices, strict=True):
            assert torch.equal(out.view(torch.int16), unrecorded.view(torch.int16))
            if index is not None:
                reference.record_range_(out, *expected, index)
        assert torch.equal(amax, expected[0]) and torch.equal(counts, expected[1])
        added = (counts - torch.arange(12, device=device)).view(-1, 3)
        assert added[indices[-1] or 1, 1] > 0  # inf/NaN among them
