"""`amp_fx.ops.activations` against torch: the fused functions equal the fp32 expression rounded
once, eagerly (reference and Triton kernels), through the custom ops (opcheck, make_fx) and under
torch.compile; calls the kernels do not take fall back to that expression."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from amp_fx.ops.activations import (
    ACTIVATIONS,
    fp32_activation,
    fp32_gated_activation,
    fused_activation,
    fused_gated_activation,
)
from amp_fx.testing import rounding_tolerances
from tests.ops.dynamo_graphs import calls_amp_fx_ops, compile_keeping_graphs


def torch_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def fp32_expression(gate, up, activation):
    """The math the fused functions compute, as torch ops on fp32 copies (up None: alone)."""
    out = torch_activation(gate.float(), activation)
    return (out if up is None else out * up.float()).to(gate.dtype)


def leaves(*shape: int, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * 2).to(dtype).requires_grad_() for _ in range(3)]


def grads_of(fn, *inputs, grad):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    out.backward(grad)
    return out.detach(), [x.grad for x in inputs]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eager_equals_the_fp32_expression(kernels, activation, dtype) -> None:
    gate, up, grad = leaves(3, 5, 11, dtype=dtype)
    rtol, _ = rounding_tolerances(dtype)
    # GELU's 1 + erf(x) cancels in its tail: fp32's absolute error there, times |gate * up| <= 64.
    atol = 4e-5
    out, grads = grads_of(lambda g, u: fp32_gated_activation(g, u, activation), gate, up, grad=grad)
    expected, expected_grads = grads_of(lambda g, u: fp32_expression(g, u, activation), gate, up, grad=grad)
    assert out.dtype == dtype and out.shape == gate.shape
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        assert actual.dtype == dtype
        # The expression's backward rounds act'(g) * dy * u at two places, the kernel at one.
        torch.testing.assert_close(actual, wanted, rtol=2 * rtol, atol=1e-3)
    lone, (lone_grad,) = grads_of(lambda x: fp32_activation(x, activation), gate, grad=grad)
    expected_lone, (expected_lone_grad,) = grads_of(
        lambda x: fp32_expression(x, None, activation), gate, grad=grad
    )
    torch.testing.assert_close(lone, expected_lone, rtol=rtol, atol=atol)
    torch.testing.assert_close(lone_grad, expected_lone_grad, rtol=rtol, atol=atol)


def test_chunks_of_one_projection(kernels) -> None:
    """Two halves of one projection give what their contiguous copies give, and the projection's
    gradient is the two halves' gradients side by side."""
    both, grad, _ = leaves(4, 2 * 7)
    grad = grad.detach()[:, :7]
    out, (grad_both,) = grads_of(
        lambda t: fp32_gated_activation(*t.chunk(2, dim=-1), "silu"), both, grad=grad
    )
    gate, up = (half.contiguous() for half in both.detach().chunk(2, dim=-1))
    expected, expected_grads = grads_of(lambda g, u: fp32_gated_activation(g, u, "silu"), gate, up, grad=grad)
    assert torch.equal(out, expected)
    assert torch.equal(grad_both, torch.cat(expected_grads, dim=-1))


def test_other_calls_fall_back_to_the_expression() -> None:
    gate = torch.randn(3, 4, dtype=torch.bfloat16)
    row = torch.randn(4, dtype=torch.bfloat16)
    assert torch.equal(
        fp32_gated_activation(gate, row, "gelu"), fp32_expression(gate, row.expand(3, 4), "gelu")
    )
    mixed = fp32_gated_activation(gate, gate.float(), "silu")
    assert mixed.dtype == torch.float32
    with pytest.raises(ValueError, match="not one of silu, gelu, gelu_tanh"):
        fp32_activation(gate, "relu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_custom_ops_pass_opcheck(activation) -> None:
    gate, up, _ = leaves(2, 3, 5, dtype=torch.float16)
    torch.library.opcheck(fused_gated_activation.op, (gate, up, activation))
    torch.library.opcheck(fused_activation.op, (gate, activation))


def test_tracers_see_one_op_each_way() -> None:
    gate, up, grad = leaves(2, 6)

    def step(g, u, dy):
        out = fp32_gated_activation(g, u, "silu") + fp32_activation(g, "gelu_tanh")
        return torch.autograd.grad(out, (g, u), dy)

    graph = make_fx(step)(gate, up, grad)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"amp_fx.gated_activation.default", "amp_fx.gated_activation_backward.default"} <= targets
    assert {"amp_fx.activation.default", "amp_fx.activation_backward.default"} <= targets


def test_compiles_as_the_expression_without_graph_breaks() -> None:
    """Under torch.compile the call is its torch expression, for Inductor to fuse."""
    gate, up, grad = leaves(4, 6)
    compiled, graphs = compile_keeping_graphs(lambda g, u: fp32_gated_activation(g, u, "gelu"))
    out, grads = grads_of(compiled, gate, up, grad=grad)
    assert not calls_amp_fx_ops(graphs[0])
    expected, expected_grads = grads_of(lambda g, u: fp32_gated_activation(g, u, "gelu"), gate, up, grad=grad)
    assert torch.equal(out, expected)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=0)
