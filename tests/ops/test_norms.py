"""The fused norm functions against the torch expressions they stand for (their docstrings).

Fused calls must give the expression's value up to fp32 summation order and its gradients up to
one rounding; calls the kernels do not compute must give exactly the expression's.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from amp_fx.ops import norms
from amp_fx.ops.norms import (
    add_layer_norm_fp32,
    add_rms_norm_fp32,
    fused_norm,
    fused_norm_backward,
    layer_norm_fp32,
    rms_norm_fp32,
)
from amp_fx.testing import assert_close_normwise, rounding_tolerances, tolerances
from tests.ops.dynamo_graphs import calls_amp_fx_ops, compile_keeping_graphs

LOW_DTYPES = [torch.float16, torch.bfloat16]
EPS = 1e-6


def rms_expression(x, weight, eps, *, weight_offset=0.0, mid_dtype=None, out_dtype=None):
    """rms_norm_fp32's docstring, as Hugging Face writes it."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype)
    y = (weight + weight_offset if weight_offset else weight) * y
    return y if out_dtype is None else y.to(out_dtype)


def outputs_and_grads(function, *inputs, **kwargs):
    """The function's outputs and the gradients of every input that is a floating tensor."""
    leaves = [t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
    outputs = function(*leaves, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(out.shape, generator=generator).to(out.dtype) for out in outputs]
    torch.autograd.backward(outputs, grads)
    return outputs, [leaf.grad for leaf in leaves if isinstance(leaf, torch.Tensor)]


def assert_matches_expression(ours, expected, rounded_to=None):
    """``rounded_to``: a dtype the expression's backward rounds gradients to on the way (the
    backward of a cast to it), which the kernels' fp32 backward does not."""
    (outputs, grads), (expected_outputs, expected_grads) = ours, expected
    for out, ref in zip(outputs, expected_outputs, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        rtol, atol = rounding_tolerances(out.dtype)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=max(atol, 1e-5))
    for grad, ref in zip(grads, expected_grads, strict=True):
        if ref is None:  # the expression does not read it; the fused call's gradient is zero
            assert grad is None or not grad.any()
            continue
        assert grad.dtype == ref.dtype
        rtol, atol = rounding_tolerances(rounded_to or grad.dtype)
        assert_close_normwise(grad, ref, rtol=4 * rtol, atol=atol)


def inputs(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(shape, generator=generator)).to(dtype)
    stream = torch.randn(shape, generator=generator)
    weight = 1 + 0.2 * torch.randn(shape[-1], generator=generator)
    bias = 0.1 * torch.randn(shape[-1], generator=generator)
    return x, stream, weight, bias


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Counts the calls of the fused op (one entry per call)."""
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return fused_norm(*args)

    monkeypatch.setattr(norms, "fused_norm", counted)
    return calls


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 1000)])
@pytest.mark.parametrize(
    "options",
    [
        {},  # T5: the weight times the fp32 result
        {"mid_dtype": "low", "out_dtype": "low"},  # Llama on a low stream
        {"weight_offset": 1.0, "out_dtype": "low"},  # Gemma: (1 + w) in fp32, then type_as(x)
    ],
    ids=["t5", "llama", "gemma"],
)
def test_rms_norm(dtype, shape, options, fused_calls) -> None:
    options = {key: dtype if value == "low" else value for key, value in options.items()}
    x, _, weight, _ = inputs(shape, dtype)
    ours = outputs_and_grads(rms_norm_fp32, x, weight, EPS, **options)
    assert_matches_expression(ours, outputs_and_grads(rms_expression, x, weight, EPS, **options))
    assert fused_calls == [1]


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_add_rms_norm_on_an_fp32_stream(dtype, fused_calls) -> None:
    # Llama at O2: the fp32 stream plus the low branch, the norm's output cast low for the matmuls.
    x, stream, weight, _ = inputs((3, 7, 100), dtype)

    def expression(x, stream, weight):
        summed = stream + x
        return summed, rms_expression(summed, weight, EPS, out_dtype=dtype)

    ours = outputs_and_grads(add_rms_norm_fp32, x, stream, weight, EPS, out_dtype=dtype)
    assert_matches_expression(ours, outputs_and_grads(expression, x, stream, weight))
    (summed, _), (grad_x, grad_stream, _) = ours
    assert summed.dtype == torch.float32 and grad_x.dtype == dtype and grad_stream.dtype == torch.float32
    assert fused_calls == [1]


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("subtract_mean", [False, True], ids=["rms", "layer"])
def test_add_norms_on_a_low_stream(dtype, subtract_mean, fused_calls) -> None:
    # O2 with low_precision_residual (and a model cast with .to(dtype)): stream and branch low,
    # their sum rounded to the low dtype once and normalized in fp32 with fp32 weights.
    x, stream, weight, bias = inputs((3, 7, 100), dtype)
    stream = stream.to(dtype)

    def expression(x, stream, weight, bias):
        summed = stream + x
        if subtract_mean:
            return summed, F.layer_norm(summed.float(), (100,), weight, bias, EPS).to(dtype)
        return summed, rms_expression(summed, weight, EPS, mid_dtype=dtype, out_dtype=dtype)

    if subtract_mean:
        ours = outputs_and_grads(add_layer_norm_fp32, x, stream, (100,), weight, bias, EPS, out_dtype=dtype)
    else:
        options = {"mid_dtype": dtype, "out_dtype": dtype}
        ours = outputs_and_grads(
            lambda x, s, w, b: add_rms_norm_fp32(x, s, w, EPS, **options), x, stream, weight, bias
        )
    # The expression's backward rounds the sum's gradient to the low dtype; the kernel's does not.
    assert_matches_expression(ours, outputs_and_grads(expression, x, stream, weight, bias), rounded_to=dtype)
    (summed, _), (grad_x, grad_stream, grad_weight, _) = ours
    assert torch.equal(summed, x + stream)  # one low-precision add, as torch's
    assert summed.dtype == grad_x.dtype == grad_stream.dtype == dtype and grad_weight.dtype == torch.float32
    assert fused_calls == [1]


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm(dtype, residual, fused_calls) -> None:
    x, stream, weight, bias = inputs((3, 7, 123), dtype)
    if residual:

        def expression(x, stream, weight, bias):
            summed = x + stream
            return summed, F.layer_norm(summed, (123,), weight, bias, EPS).to(dtype)

        ours = outputs_and_grads(add_layer_norm_fp32, x, stream, (123,), weight, bias, EPS, out_dtype=dtype)
        expected = outputs_and_grads(expression, x, stream, weight, bias)
    else:
        ours = outputs_and_grads(layer_norm_fp32, x, (123,), weight, bias, EPS)
        expected = outputs_and_grads(
            lambda x, w, b: F.layer_norm(x.float(), (123,), w, b, EPS), x, weight, bias
        )
    assert_matches_expression(ours, expected)
    assert fused_calls == [1]


def test_layer_norm_over_two_dimensions(fused_calls) -> None:
    x, _, _, _ = inputs((4, 3, 10), torch.bfloat16)
    weight = torch.randn(3, 10)
    ours = outputs_and_grads(layer_norm_fp32, x, (3, 10), weight, None)
    expected = outputs_and_grads(lambda x, w: F.layer_norm(x.float(), (3, 10), w), x, weight)
    assert_matches_expression(ours, expected)
    assert fused_calls == [1]


def test_calls_the_kernels_do_not_compute_are_the_expression(fused_calls) -> None:
    x, stream, weight, bias = inputs((4, 16), torch.bfloat16)
    cases = [
        # A weight that is not a vector of the row's width broadcasts: torch computes it.
        (rms_norm_fp32(x, weight[None, :], EPS), rms_expression(x, weight[None, :], EPS)),
        # A residual that broadcasts.
        (add_rms_norm_fp32(x, stream[:1], weight, EPS)[1], rms_expression(x + stream[:1], weight, EPS)),
        # float64.
        (rms_norm_fp32(x.double(), weight, EPS), rms_expression(x.double(), weight, EPS)),
    ]
    for ours, expected in cases:
        assert torch.equal(ours, expected)
    assert not fused_calls
    with pytest.raises(RuntimeError):
        layer_norm_fp32(x, (15,), weight, bias)  # torch's own error for a bad normalized_shape


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
def test_dispatches_to_triton(triton_calls) -> None:
    x, stream, weight, _ = inputs((3, 40), torch.bfloat16)
    ours = outputs_and_grads(add_rms_norm_fp32, x, stream, weight, EPS, mid_dtype=torch.bfloat16)

    def expression(x, stream, weight):
        summed = x + stream
        return summed, rms_expression(summed, weight, EPS, mid_dtype=torch.bfloat16)

    expected = outputs_and_grads(expression, x, stream, weight)
    assert_matches_expression(ours, expected, rounded_to=torch.bfloat16)
    # The Triton kernels ran (the reference gives the same numbers), once each way.
    assert triton_calls == {"norm_forward": 1, "norm_backward": 1}


def test_never_reads_a_value_on_the_host(kernels, no_host_reads) -> None:
    x, stream, weight, bias = inputs((3, 40), torch.float16)
    with no_host_reads():
        outputs_and_grads(add_layer_norm_fp32, x, stream, (40,), weight, bias, out_dtype=torch.float16)
        outputs_and_grads(rms_norm_fp32, x, weight, EPS, weight_offset=1.0)


def test_compiles_as_the_expression_without_graph_breaks() -> None:
    """Under torch.compile the calls are their torch expressions, for Inductor to fuse."""

    def model(x, stream, weight, bias):
        summed, normed = add_rms_norm_fp32(x, stream, weight, EPS, out_dtype=torch.bfloat16)
        return layer_norm_fp32(normed, (16,), weight, bias).sum() + summed.sum()

    x, stream, weight, bias = inputs((4, 16), torch.bfloat16)
    compiled, graphs = compile_keeping_graphs(model)
    (loss,), grads = outputs_and_grads(compiled, x, stream, weight, bias)
    assert not calls_amp_fx_ops(graphs[0])
    (expected,), expected_grads = outputs_and_grads(model, x, stream, weight, bias)
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(loss, expected, rtol=rtol, atol=atol)
    for grad, ref in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=rtol, atol=atol)


def test_opcheck() -> None:
    x, stream, weight, bias = inputs((3, 8), torch.bfloat16)
    arguments = (
        x,
        stream,
        weight.requires_grad_(),
        bias,
        EPS,
        True,
        0.0,
        None,
        torch.float32,
        torch.bfloat16,
        None,
    )
    torch.library.opcheck(fused_norm.op, arguments)
    _, summed, mean, rstd = (t.detach() for t in fused_norm(*arguments))
    backward = (torch.randn(3, 8), None, summed, weight.detach(), mean, rstd, torch.float32, True, 0.0, None)
    torch.library.opcheck(fused_norm_backward.op, (*backward, torch.bfloat16, torch.float32))


def test_a_sum_or_an_output_read_alone(fused_calls) -> None:
    # A final norm's sum has no other reader (no gradient comes back for it), and a norm whose
    # output is dropped leaves only the sum's gradient.
    x, stream, weight, _ = inputs((3, 16), torch.bfloat16)
    for read in (0, 1):

        def expression(x, stream, weight, read=read):
            summed = x + stream
            return (summed, rms_expression(summed, weight, EPS))[read]

        def fused(x, stream, weight, read=read):
            return add_rms_norm_fp32(x, stream, weight, EPS)[read]

        assert_matches_expression(
            outputs_and_grads(fused, x, stream, weight), outputs_and_grads(expression, x, stream, weight)
        )
    assert len(fused_calls) == 2
