"""The rotary kernels: Triton against the pure-torch reference (bit for bit), the reference against
the torch chain it replaces (float64, and eager/autocast fp32 math bit for bit), the op's
gradients against float64 autograd, and the argument checks.

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same checks run on CUDA when marked
`gpu`. Sizes are small and odd (3 or 5 heads, 5 positions, pass-through widths of 2 and 6).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.ops.rotary import rotary_chain, rotary_embedding
from amp_fx.testing import grad_tolerances, rounding_tolerances

LOW = [torch.float16, torch.bfloat16]
DTYPES = [*LOW, torch.float32]

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


@pytest.mark.parametrize(("case", "dtype"), [(case, DTYPES[i % 3]) for i, case in enumerate(CASES)])
def test_triton_matches_reference(device, case, dtype) -> None:
    q, cos, sin, interleaved = make_inputs(case, dtype, device)
    for out_dtype in (dtype, torch.float32):
        ours = triton_ops.rotary_forward(q, cos, sin, interleaved, out_dtype)
        expected = reference.rotary_forward(q.cpu(), cos.cpu(), sin.cpu(), interleaved, out_dtype)
        assert ours.dtype == out_dtype and ours.stride() == expected.stride()
        torch.testing.assert_close(ours.cpu(), expected, rtol=0, atol=0)
        grad = triton_ops.rotary_backward(ours, cos, sin, interleaved, dtype)
        expected_grad = reference.rotary_backward(expected, cos.cpu(), sin.cpu(), interleaved, dtype)
        torch.testing.assert_close(grad.cpu(), expected_grad, rtol=0, atol=0)


@given(
    dtype=st.sampled_from(DTYPES),
    heads=st.integers(1, 5),
    seq=st.integers(1, 4),
    pairs=st.integers(1, 5),
    passed=st.integers(0, 3),
    interleaved=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference_any_size(
    device, dtype, heads, seq, pairs, passed, interleaved, seed
) -> None:
    case = ((2, heads, seq, 2 * pairs + passed), (1, 1, seq, 2 * pairs), interleaved, True)
    q, cos, sin, interleaved = make_inputs(case, dtype, device, seed)
    ours = triton_ops.rotary_forward(q, cos, sin, interleaved, dtype)
    expected = reference.rotary_forward(q.cpu(), cos.cpu(), sin.cpu(), interleaved, dtype)
    torch.testing.assert_close(ours.cpu(), expected, rtol=0, atol=0)
    grad = triton_ops.rotary_backward(q, cos, sin, interleaved, dtype)
    torch.testing.assert_close(
        grad.cpu(),
        reference.rotary_backward(q.cpu(), cos.cpu(), sin.cpu(), interleaved, dtype),
        rtol=0,
        atol=0,
    )


def _chain64(case, q, cos, sin):
    """The chain the kernels replace, in float64 autograd (partial rotary as GPT-NeoX writes it)."""
    interleaved = case[2]
    width = cos.shape[-1]
    rotary_dim = width if width < q.shape[-1] else None
    return rotary_chain(q, cos, sin, rotary_dim=rotary_dim, interleaved=interleaved), rotary_dim


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", LOW)
def test_op_matches_float64_chain(case, dtype) -> None:
    q, cos, sin, interleaved = make_inputs(case, dtype, "cpu")
    cos.requires_grad_(True)
    sin.requires_grad_(True)
    q64, cos64, sin64 = (t.detach().double().requires_grad_(True) for t in (q, cos, sin))
    expected, rotary_dim = _chain64(case, q64, cos64, sin64)
    q.requires_grad_(True)
    out = rotary_embedding(q, cos, sin, rotary_dim=rotary_dim, interleaved=interleaved, dtype=dtype)
    assert out.dtype == dtype
    rtol, atol = rounding_tolerances(dtype)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad_out.to(dtype))
    expected.backward(grad_out.to(dtype).double())
    assert q.grad.dtype == dtype and cos.grad.dtype == torch.float32
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=rtol, atol=atol)
    rtol, atol = grad_tolerances(torch.float32)
    for ours, exact in ((cos.grad, cos64.grad), (sin.grad, sin64.grad)):
        # The tables' gradients sum q's rounded values: exact sums of products of them, in fp32.
        torch.testing.assert_close(ours.double(), exact, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", LOW)
def test_reference_equals_chain_under_autocast(case, dtype) -> None:
    # Low q, fp32 cos and sin (what O2 and autocast see): the chain promotes to fp32 and rounds each
    # product and the sum once in fp32, as the kernels do; the two agree bit for bit.
    q, cos, sin, interleaved = make_inputs(case, dtype, "cpu")
    rotary_dim = cos.shape[-1] if cos.shape[-1] < q.shape[-1] else None
    with torch.autocast("cpu", dtype=dtype):
        expected = rotary_chain(q, cos, sin, rotary_dim=rotary_dim, interleaved=interleaved)
    out = rotary_embedding(q, cos, sin, rotary_dim=rotary_dim, interleaved=interleaved)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_calls_outside_the_contract_compute_the_chain() -> None:
    q = torch.randn(2, 3, 5, 8, dtype=torch.bfloat16)
    for cos in (
        torch.randn(5, 6),
        torch.randn(5, 1),
        torch.randn(2, 2, 3, 5, 8),
    ):  # too narrow, width 1, enlarging
        sin = torch.randn_like(cos)
        expected = rotary_chain(q, cos, sin) if cos.shape[-1] in (1, 8) else None
        if expected is None:
            with pytest.raises(RuntimeError):
                rotary_embedding(q, cos, sin)
            continue
        torch.testing.assert_close(rotary_embedding(q, cos, sin), expected, rtol=0, atol=0)
    q64 = q.double()
    cos = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(rotary_embedding(q64, cos, cos), rotary_chain(q64, cos, cos), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("cos_shape", "message"),
    [((5, 7), "odd number"), ((5, 10), "between 2"), ((2, 2, 5, 8), "does not broadcast")],
)
def test_kernels_refuse_bad_arguments(cos_shape, message) -> None:
    q = torch.randn(2, 3, 5, 8)
    cos = torch.randn(cos_shape)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match=message):
            implementation.rotary_forward(q, cos, cos, False, torch.float32)
    with pytest.raises(ValueError, match="features but sin has"):
        reference.rotary_forward(q, torch.randn(5, 8), torch.randn(5, 6), False, torch.float32)
