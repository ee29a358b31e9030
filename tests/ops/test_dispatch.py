"""`amp_fx.ops.dispatch`: eager calls of a fused op skip the custom op and give what it gives
(values, gradients, defaults); tracers get the custom op."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from amp_fx.ops.dispatch import fused_op, is_eager
from amp_fx.ops.norms import fused_norm, rms_norm_fp32


@fused_op("amp_fx_tests::scaled_square")
def scaled_square(x: Tensor, factor: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    return x * x * factor + offset, x.sum(-1)


@scaled_square.register_fake
def _scaled_square_fake(x: Tensor, factor: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[:-1])


def _setup_context(ctx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    x, factor, offset = inputs  # every argument, the default too
    ctx.save_for_backward(x)
    ctx.factor = factor
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad: Tensor, _grad_sum: Tensor | None) -> tuple[Tensor, None, None]:
    (x,) = ctx.saved_tensors
    return 2 * x * ctx.factor * grad, None, None


scaled_square.register_autograd(_backward, setup_context=_setup_context)


@pytest.fixture
def op_calls(monkeypatch) -> list[str]:
    """The names of the custom ops called through ``FusedOp.op`` (the torch.library path)."""
    calls: list[str] = []
    for fused in (scaled_square, fused_norm):
        op = fused.op
        monkeypatch.setattr(fused, "op", lambda *args, op=op, **kwargs: calls.append(op._name) or op(*args))
    return calls


def test_eager_calls_skip_the_custom_op_with_its_values_and_gradients(op_calls) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    out, row_sums = scaled_square(x, 3.0)
    out.sum().backward()
    assert op_calls == []
    y = x.detach().clone().requires_grad_()
    expected, expected_sums = torch.ops.amp_fx_tests.scaled_square(y, 3.0)
    expected.sum().backward()
    assert torch.equal(out, expected) and torch.equal(row_sums, expected_sums)
    assert torch.equal(x.grad, y.grad)
    assert not row_sums.requires_grad  # marked non-differentiable, as the op marks it
    with torch.no_grad():
        assert torch.equal(scaled_square(x, 3.0, offset=1.0)[0], expected.detach() + 1)
    assert op_calls == []


def test_a_norm_call_skips_the_custom_op_eagerly_and_takes_it_under_a_tracer(op_calls) -> None:
    x = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(8))
    rms_norm_fp32(x, weight, 1e-6, mid_dtype=torch.bfloat16).sum().backward()
    assert op_calls == []
    graph = make_fx(lambda x, w: rms_norm_fp32(x, w, 1e-6), tracing_mode="fake")(x.detach(), weight.detach())
    assert op_calls == ["fused_norm"]
    assert any("amp_fx.fused_norm" in str(node.target) for node in graph.graph.nodes)


def test_is_eager() -> None:
    plain, parameter = torch.ones(2), torch.nn.Parameter(torch.ones(2))
    assert is_eager(plain, parameter, None, 2.0)
    with FakeTensorMode() as mode:
        assert not is_eager(plain)  # a dispatch mode is active
    assert not is_eager(plain, mode.from_tensor(plain))  # a fake tensor among the arguments
    # Traced by Dynamo: not eager, so t + False.
    compiled = torch.compile(lambda t: t + is_eager(t), backend="eager", fullgraph=True)
    assert compiled(plain).tolist() == [1.0, 1.0]


@fused_op("amp_fx_tests::zero_", mutates_args=("x",))
def zero_(x: Tensor) -> None:
    x.data.zero_()  # a write autograd does not see, as a Triton kernel's


@zero_.register_fake
def _zero_fake(x: Tensor) -> None:
    return None


def test_an_eager_call_marks_what_the_op_writes() -> None:
    x = torch.ones(3)
    version = x._version
    zero_(x)
    assert x._version > version and not x.any()
