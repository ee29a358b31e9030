"""The rotary op (`amp_fx.ops.rotary.rotary_embedding`) against the torch chain it replaces: float64
values and gradients (q, cos, sin), torch.autocast's fp32 math bit for bit, the fallback outside the
kernels' contract, and the custom ops under torch.compile and torch.export.

Runs the reference kernels on CPU, and the Triton ones through the ``kernels`` fixture under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from amp_fx.ops.rotary import rotary_chain, rotary_embedding, rotary_embedding_pair
from amp_fx.testing import grad_tolerances, rounding_tolerances
from tests.kernels.test_rotary import CASES, make_inputs
from tests.ops.dynamo_graphs import calls_amp_fx_ops, compile_keeping_graphs

LOW = [torch.float16, torch.bfloat16]


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


class Rotate(torch.nn.Module):
    def forward(self, q, cos, sin):
        return rotary_embedding(q, cos, sin, rotary_dim=cos.shape[-1], dtype=torch.bfloat16)


def test_compiles_as_the_chain_without_graph_breaks() -> None:
    """Under torch.compile the call is the torch chain, for Inductor to fuse with its neighbours."""
    q, cos, sin, _ = make_inputs(CASES[2], torch.bfloat16, "cpu")
    q.requires_grad_(True)
    compiled, graphs = compile_keeping_graphs(Rotate())
    out = compiled(q, cos, sin)
    (grad,) = torch.autograd.grad(out.float().sum(), q)
    expected = rotary_chain(q, cos, sin, rotary_dim=cos.shape[-1], dtype=torch.bfloat16)
    (expected_grad,) = torch.autograd.grad(expected.float().sum(), q)
    assert torch.equal(out, expected) and torch.equal(grad, expected_grad)
    assert not calls_amp_fx_ops(graphs[0])


def test_exports_as_one_custom_op() -> None:
    q, cos, sin, _ = make_inputs(CASES[0], torch.bfloat16, "cpu")
    exported = torch.export.export(Rotate(), (q, cos, sin))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets == ["amp_fx.rotary_embedding.default"]
    assert torch.equal(exported.module()(q, cos, sin), Rotate()(q, cos, sin))


@pytest.mark.parametrize("needs_table_grads", [False, True])
def test_pair_equals_two_calls(kernels, needs_table_grads) -> None:
    q, cos, sin, _ = make_inputs(CASES[2], torch.bfloat16, "cpu")
    k = make_inputs(((2, 1, 5, 10), (1,), False, True), torch.bfloat16, "cpu", seed=1)[0]
    options = {"rotary_dim": 4, "interleaved": False}

    def run(pair: bool):
        leaves = [
            t.clone().requires_grad_(t.dtype == torch.bfloat16 or needs_table_grads) for t in (q, k, cos, sin)
        ]
        lq, lk, lcos, lsin = leaves
        if pair:
            outs = rotary_embedding_pair(lq, lk, lcos, lsin, dtypes=(torch.bfloat16, None), **options)
        else:
            outs = (
                rotary_embedding(lq, lcos, lsin, dtype=torch.bfloat16, **options),
                rotary_embedding(lk, lcos, lsin, **options),
            )
        grads = [
            torch.randn(o.shape, generator=torch.Generator().manual_seed(i)).to(o.dtype)
            for i, o in enumerate(outs)
        ]
        torch.autograd.backward(outs, grads)
        return outs, [t.grad for t in leaves]

    (outs, grads), (expected, expected_grads) = run(pair=True), run(pair=False)
    assert [o.dtype for o in outs] == [torch.bfloat16, torch.float32]
    for ours, theirs in zip([*outs, *grads], [*expected, *expected_grads], strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
