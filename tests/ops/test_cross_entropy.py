"""fp32_cross_entropy against what torch.autocast computes, F.cross_entropy(x.float(), t, ...).

The fused path must give the same float32 loss up to summation order and the same gradient in the
input's dtype up to one rounding; every call it does not fuse must give exactly torch's result.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from amp_fx.kernels import reference
from amp_fx.ops import cross_entropy as cross_entropy_op
from amp_fx.ops.cross_entropy import (
    cross_entropy_rows,
    cross_entropy_rows_backward,
    cross_entropy_rows_backward_,
    fp32_cross_entropy,
)
from amp_fx.testing import rounding_tolerances, tolerances

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
REDUCTIONS = ["mean", "sum", "none"]


def assert_rounded_once_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Gradients in the input's dtype, each side rounded once from fp32 math."""
    assert actual.dtype == expected.dtype
    rtol, atol = rounding_tolerances(actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def assert_loss_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def make_logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (4 * torch.randn(shape, generator=generator)).to(dtype).to(device).requires_grad_()


def make_target(num_rows: int, num_classes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, num_classes, (num_rows,), generator=generator).to(device)


def loss_and_grad(function, logits: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss, and the gradient of it (of a weighted sum of per-row losses, so that each row gets
    its own upstream gradient) w.r.t. a fresh copy of ``logits``."""
    x = logits.detach().clone().requires_grad_()
    loss = function(x, *args, **kwargs)
    if loss.dim() == 0:
        loss.backward()
    else:
        weights = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
        (loss * weights).sum().backward()
    return loss.detach(), x.grad


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Counts the calls of the fused op that fp32_cross_entropy makes (one entry per call)."""
    calls: list[int] = []

    def counted(*args):
        calls.append(1)
        return cross_entropy_rows(*args)

    monkeypatch.setattr(cross_entropy_op, "cross_entropy_rows", counted)
    return calls


def cast_path(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return F.cross_entropy(logits.float(), *args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("num_rows", "num_classes"), [(1, 1), (3, 17), (6, 40)])
def test_matches_the_cast_path(dtype, reduction, num_rows, num_classes, fused_calls) -> None:
    logits = make_logits((num_rows, num_classes), dtype, seed=num_rows)
    target = make_target(num_rows, num_classes, seed=num_rows)
    target[::3] = -100
    loss, grad = loss_and_grad(fp32_cross_entropy, logits, target, reduction=reduction)
    expected_loss, expected_grad = loss_and_grad(cast_path, logits, target, reduction=reduction)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)
    assert torch.all(grad[::3] == 0)
    assert len(fused_calls) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_custom_ignore_index(dtype, fused_calls) -> None:
    logits = make_logits((5, 9), dtype, seed=7)
    target = torch.tensor([0, 3, 0, 8, 2])
    loss, grad = loss_and_grad(fp32_cross_entropy, logits, target, ignore_index=0)
    expected_loss, expected_grad = loss_and_grad(cast_path, logits, target, ignore_index=0)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)
    assert len(fused_calls) == 1


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored(reduction, fused_calls) -> None:
    logits = make_logits((3, 5), torch.float16, seed=0)
    target = torch.full((3,), -100)
    loss, grad = loss_and_grad(fp32_cross_entropy, logits, target, reduction=reduction)
    expected_loss, expected_grad = loss_and_grad(cast_path, logits, target, reduction=reduction)
    if reduction == "mean":
        assert loss.isnan() and expected_loss.isnan()
    else:
        assert torch.equal(loss, expected_loss)
    assert torch.equal(grad, expected_grad) and torch.all(grad == 0)
    assert len(fused_calls) == 1


def test_no_rows() -> None:
    logits = torch.zeros(0, 5, dtype=torch.float16, requires_grad=True)
    target = torch.zeros(0, dtype=torch.int64)
    for reduction in REDUCTIONS:
        loss = fp32_cross_entropy(logits, target, reduction=reduction)
        expected = cast_path(logits, target, reduction=reduction)
        torch.testing.assert_close(loss, expected, equal_nan=True)


def test_out_of_range_target_is_a_nan_row() -> None:
    # torch raises for these; checking needs a host synchronization, so the fused loss is NaN.
    logits = make_logits((3, 5), torch.float16, seed=1)
    target = torch.tensor([1, 5, -1])
    losses = fp32_cross_entropy(logits, target, reduction="none")
    assert losses[0].isfinite() and losses[1:].isnan().all()
    assert fp32_cross_entropy(logits, target).isnan()
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        cast_path(logits, target)


FALLBACKS = {
    "weight": dict(weight=torch.linspace(0.5, 2.0, 7)),
    "label_smoothing": dict(label_smoothing=0.1),
    "legacy size_average": dict(size_average=False),
    "legacy reduce": dict(reduce=False),
}


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [*FALLBACKS, "3-D input", "probability targets", "float64 input"])
def test_other_calls_are_exactly_the_cast_path(dtype, case, fused_calls) -> None:
    logits = make_logits((4, 7), dtype, seed=3)
    target = make_target(4, 7, seed=3)
    kwargs = FALLBACKS.get(case, {})
    if case == "3-D input":
        logits = make_logits((4, 7, 3), dtype, seed=3)
        target = target[:, None].expand(4, 3) % 7
    elif case == "probability targets":
        target = torch.softmax(torch.randn(4, 7), dim=1)
    elif case == "float64 input":
        logits = logits.detach().double().requires_grad_()
    loss, grad = loss_and_grad(fp32_cross_entropy, logits, target, **kwargs)
    expected_loss, expected_grad = loss_and_grad(cast_path, logits, target, **kwargs)
    assert loss.dtype == torch.float32 and grad.dtype == logits.dtype
    assert torch.equal(loss, expected_loss)
    assert torch.equal(grad, expected_grad)
    assert not fused_calls


@pytest.mark.parametrize(
    ("kwargs", "target"),
    [
        (dict(reduction="avg"), torch.tensor([0, 1])),
        ({}, torch.tensor([0, 1, 2])),  # one target too many
        ({}, torch.tensor([0, 1], dtype=torch.int32)),
    ],
)
def test_bad_arguments_get_torch_errors(kwargs, target) -> None:
    logits = make_logits((2, 3), torch.float16, seed=0)
    with pytest.raises((ValueError, RuntimeError)) as expected:
        cast_path(logits, target, **kwargs)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        fp32_cross_entropy(logits, target, **kwargs)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
def test_dispatches_to_triton(triton_calls) -> None:
    logits = make_logits((3, 40), torch.bfloat16, seed=5)
    target = torch.tensor([3, -100, 39])
    loss, grad = loss_and_grad(fp32_cross_entropy, logits, target)
    expected_loss, expected_grad = loss_and_grad(cast_path, logits, target)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)
    # One forward and one backward kernel: the Triton path, not the reference that gives the same numbers.
    assert triton_calls == {"cross_entropy_forward": 1, "cross_entropy_backward": 1}


def test_never_reads_a_value_on_the_host(kernels, fused_calls, no_host_reads) -> None:
    # Ignored and out-of-range targets are handled on the device: neither the forward nor the
    # backward synchronizes (on a GPU) to look at a value.
    logits = make_logits((3, 40), torch.float16, seed=7)
    target = torch.tensor([3, -100, 39])
    with no_host_reads():
        loss, grad = loss_and_grad(fp32_cross_entropy, logits, target)
    assert fused_calls == [1]
    expected_loss, expected_grad = loss_and_grad(cast_path, logits, target)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)


def fused_and_fallback(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Both branches of fp32_cross_entropy in one graph: fused, then label smoothing (cast path).
    return fp32_cross_entropy(logits, target) + fp32_cross_entropy(logits, target, label_smoothing=0.1)


def test_compiles_without_graph_breaks() -> None:
    compiled = torch.compile(fused_and_fallback, backend="aot_eager", fullgraph=True)
    logits = make_logits((4, 11), torch.float16, seed=2)
    target = torch.tensor([1, -100, 10, 0])
    loss, grad = loss_and_grad(compiled, logits, target)
    expected_loss, expected_grad = loss_and_grad(fused_and_fallback, logits, target)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)


def test_grad_into_input_overwrites_the_logits_with_the_same_gradient(fused_calls) -> None:
    logits = make_logits((5, 23), torch.float16, seed=3)
    target = make_target(5, 23, seed=3)
    expected_loss, expected_grad = loss_and_grad(fp32_cross_entropy, logits, target)
    # A non-leaf input, as a model's logits are: the gradient is written over its memory.
    leaf = logits.detach().clone().requires_grad_(True)
    consumed = leaf * 1
    loss = fp32_cross_entropy(consumed, target, grad_into_input=True)
    (grad,) = torch.autograd.grad(loss, consumed, retain_graph=True)
    assert grad.data_ptr() == consumed.data_ptr()
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)
    # The logits are gone: a second backward through the graph is refused, not silently wrong.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, consumed)


def test_grad_into_input_compiles() -> None:
    def loss_fn(logits, target):
        return fp32_cross_entropy(logits * 1, target, grad_into_input=True)

    logits = make_logits((4, 11), torch.float16, seed=2)
    target = torch.tensor([1, -100, 10, 0])
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    loss, grad = loss_and_grad(compiled, logits, target)
    expected_loss, expected_grad = loss_and_grad(fp32_cross_entropy, logits, target)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)


def test_compiled_backward_is_plain_math_for_inductor_to_fuse() -> None:
    # Under torch.compile the backward is traced as torch ops (Inductor fuses them into one pass
    # and reuses the logits' buffer): no custom op, mutating or not, in the backward graph.
    from torch._dynamo.backends.common import aot_autograd

    backward_code: list[str] = []

    def keep_forward(gm, example_inputs):
        return gm

    def record_backward(gm, example_inputs):
        backward_code.append(gm.code)
        return gm

    backend = aot_autograd(fw_compiler=keep_forward, bw_compiler=record_backward)

    def loss_fn(logits, target):
        return fp32_cross_entropy(logits * 1, target, grad_into_input=True)

    torch._dynamo.reset()
    logits = make_logits((4, 11), torch.float16, seed=2)
    target = torch.tensor([1, -100, 10, 0])
    loss, grad = loss_and_grad(torch.compile(loss_fn, backend=backend, fullgraph=True), logits, target)
    expected_loss, expected_grad = loss_and_grad(fp32_cross_entropy, logits, target)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)
    (code,) = backward_code
    assert "amp_fx" not in code and "exp" in code


def test_opcheck() -> None:
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    logits = make_logits((3, 6), torch.float16, seed=4)
    target = torch.tensor([5, -100, 0])
    opcheck(cross_entropy_rows.op, (logits, target, -100))
    _, lse = reference.cross_entropy_forward(logits.detach(), target, -100)
    opcheck(cross_entropy_rows_backward.op, (torch.rand(3), logits.detach(), target, lse, -100))
    opcheck(cross_entropy_rows_backward_.op, (torch.rand(3), logits.detach().clone(), target, lse, -100))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt_sized_loss_on_gpu(dtype) -> None:
    logits = make_logits((16, 50304), dtype, seed=6, device="cuda")
    target = make_target(16, 50304, seed=6, device="cuda")
    target[3] = -100
    loss, grad = loss_and_grad(fp32_cross_entropy, logits, target)
    # The reference kernels on the same CUDA tensors, and torch's cast path.
    losses, lse = reference.cross_entropy_forward(logits.detach(), target, -100)
    expected_grad = reference.cross_entropy_backward(
        torch.full((16,), 1 / 15, device="cuda"), logits.detach(), target, lse, -100
    )
    assert_loss_close(loss, losses.sum() / 15)
    assert_rounded_once_close(grad, expected_grad)
    cast_loss, cast_grad = loss_and_grad(cast_path, logits, target)
    assert_loss_close(loss, cast_loss)
    assert_rounded_once_close(grad, cast_grad)


@pytest.mark.gpu
def test_compiles_with_inductor_on_gpu() -> None:
    compiled = torch.compile(fused_and_fallback, fullgraph=True)
    logits = make_logits((32, 1000), torch.float16, seed=8, device="cuda")
    target = make_target(32, 1000, seed=8, device="cuda")
    loss, grad = loss_and_grad(compiled, logits, target)
    expected_loss, expected_grad = loss_and_grad(fused_and_fallback, logits, target)
    assert_loss_close(loss, expected_loss)
    assert_rounded_once_close(grad, expected_grad)
