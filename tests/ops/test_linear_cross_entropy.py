"""linear_cross_entropy against F.cross_entropy(F.linear(h, W, b).float(), t): the loss and the
gradients of the input, the weight and the bias, against that float32 path and against float64.

linear_cross_entropy has two paths for a fused call: plain eager calls run the linear layer and
fp32_cross_entropy; tracers (torch.compile) get the op linear_cross_entropy_rows. The op's path is
run here eagerly too, under a dispatch mode that passes every call through (`op_path`,
`tests.capture.tracer_path`). Its
gradients round G = softmax - onehot once to the input's dtype where the unfused path rounds r * G
once, then both go through the same matmuls: they agree to the matmul tolerances of the dtype, and
each is as close to float64 as the other.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F

from amp_fx.ops import cross_entropy as cross_entropy_op
from amp_fx.ops.cross_entropy import linear_cross_entropy, linear_cross_entropy_rows
from amp_fx.testing import grad_tolerances, tolerances
from tests.capture.tracer_path import as_traced

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
REDUCTIONS = ["mean", "sum", "none"]
IGNORE_INDEX = -100


def make_problem(
    num_rows: int, dim: int, num_classes: int, dtype: torch.dtype, seed: int, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Input, weight, bias (leaves that need gradients) and targets; logits of scale ~3."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(num_rows, dim, generator=generator).to(dtype)
    w = (torch.randn(num_classes, dim, generator=generator) * 3 / dim**0.5).to(dtype)
    b = torch.randn(num_classes, generator=generator).to(dtype) if bias else None
    target = torch.randint(0, num_classes, (num_rows,), generator=generator)
    return h, w, b, target


def torch_path(h, w, b, target, **kwargs) -> torch.Tensor:
    """What the fused call must equal (what O2 computes today)."""
    return F.cross_entropy(F.linear(h, w, b).float(), target, **kwargs)


def loss_and_grads(function, h, w, b, target, upstream: float = 1.0, **kwargs):
    """The loss and the gradients of ``upstream`` times it (each row its own weight for "none")
    w.r.t. fresh copies of (h, w, b)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (h, w, b)]
    loss = function(*leaves, target, **kwargs)
    if loss.dim() == 0:
        (loss * upstream).backward()
    else:
        weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
        (loss * weights * upstream).sum().backward()
    return loss.detach(), [leaf.grad if leaf is not None else None for leaf in leaves]


def assert_close_to(actual, expected, dtype, float64=None) -> None:
    """Loss (float32) and gradients (dtype) against the float32 path; with float64 results too,
    the fused gradients are no farther from them than twice the unfused path's error (plus one
    unit of the dtype)."""
    loss, grads = actual
    expected_loss, expected_grads = expected
    assert loss.dtype == torch.float32 and loss.shape == expected_loss.shape
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(loss, expected_loss, rtol=rtol, atol=atol)
    rtol, atol = grad_tolerances(dtype)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        if expected_grad is None:
            assert grad is None
            continue
        assert grad.dtype == expected_grad.dtype == dtype
        scale = expected_grad.float().abs().amax().item()
        torch.testing.assert_close(
            grad.float(), expected_grad.float(), rtol=rtol, atol=atol * max(scale, 1.0)
        )
    if float64 is None:
        return
    for grad, expected_grad, exact in zip(grads, expected_grads, float64[1], strict=True):
        if exact is None:
            continue
        ours = (grad.double() - exact).abs().max().item()
        theirs = (expected_grad.double() - exact).abs().max().item()
        unit = torch.finfo(dtype).eps * exact.abs().max().item()
        assert ours <= 2 * theirs + unit, (ours, theirs)


# linear_cross_entropy as torch.compile runs it (the op linear_cross_entropy_rows), eagerly.
op_path = as_traced(linear_cross_entropy)

PATHS = {"eager": linear_cross_entropy, "op": op_path}


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """Records which fused path each call takes: "eager" (linear + fp32_cross_entropy) or "op"."""
    calls: list[str] = []
    loss, op = cross_entropy_op.fp32_cross_entropy, cross_entropy_op.linear_cross_entropy_rows

    def counted_loss(*args, **kwargs):
        calls.append("eager")
        return loss(*args, **kwargs)

    def counted_op(*args):
        calls.append("op")
        return op(*args)

    monkeypatch.setattr(cross_entropy_op, "fp32_cross_entropy", counted_loss)
    monkeypatch.setattr(cross_entropy_op, "linear_cross_entropy_rows", counted_op)
    return calls


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_linear_then_fp32_loss(path, dtype, reduction, fused_calls) -> None:
    h, w, b, target = make_problem(6, 16, 37, dtype, seed=1)
    target[2] = IGNORE_INDEX
    ours = loss_and_grads(PATHS[path], h, w, b, target, reduction=reduction)
    expected = loss_and_grads(torch_path, h, w, b, target, reduction=reduction)
    exact = loss_and_grads(torch_path, h.double(), w.double(), b.double(), target, reduction=reduction)
    assert_close_to(ours, expected, dtype, float64=exact)
    assert fused_calls == [path]
    # An ignored row contributes nothing: its input's gradient is exactly 0.
    assert torch.all(ours[1][0][2] == 0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_without_bias_and_with_leading_dimensions(path, dtype, fused_calls) -> None:
    h, w, _, target = make_problem(12, 8, 21, dtype, seed=2, bias=False)
    h3, target3 = h.reshape(3, 4, 8), target.reshape(3, 4)
    for reduction in REDUCTIONS:
        ours = loss_and_grads(PATHS[path], h3, w, None, target3, reduction=reduction)
        expected = loss_and_grads(torch_path, h, w, None, target, reduction=reduction)
        assert ours[0].shape == target3.shape if reduction == "none" else ours[0].dim() == 0
        expected_loss = expected[0].reshape(ours[0].shape)
        expected_grads = [expected[1][0].reshape(3, 4, 8), expected[1][1], None]
        assert_close_to(ours, (expected_loss, expected_grads), dtype)
    assert fused_calls == [path] * 3


@pytest.mark.parametrize("path", PATHS)
def test_custom_ignore_index_and_all_rows_ignored(path) -> None:
    h, w, b, target = make_problem(4, 8, 9, torch.float16, seed=3)
    target[1] = 0
    ours = loss_and_grads(PATHS[path], h, w, b, target, ignore_index=0)
    expected = loss_and_grads(torch_path, h, w, b, target, ignore_index=0)
    assert_close_to(ours, expected, torch.float16)
    everything_ignored = torch.full((4,), IGNORE_INDEX)
    for reduction in REDUCTIONS:
        loss, grads = loss_and_grads(PATHS[path], h, w, b, everything_ignored, reduction=reduction)
        expected_loss = torch_path(h, w, b, everything_ignored, reduction=reduction)
        torch.testing.assert_close(loss, expected_loss, equal_nan=True)  # a mean of nothing is NaN
        if reduction != "mean":
            assert all(torch.all(grad == 0) for grad in grads)


def test_large_loss_scale_does_not_overflow_where_torch_does_not() -> None:
    # A loss scale of 65536 over a mean of 2 confidently right rows: r = 32768 and G is ~1e-4, so
    # the unfused path's r * G is small and finite; scaling h (entries 4) by r before the matmul
    # would give inf (131072 > 65504). The fused gradients must be finite and as accurate.
    h = torch.zeros(2, 8, dtype=torch.float16)
    h[0, 0] = h[1, 1] = 4.0
    w = torch.zeros(11, 8, dtype=torch.float16)
    w[3, 0] = w[7, 1] = 2.5  # logit 10 for the target class, 0 for the others
    b = torch.zeros(11, dtype=torch.float16)
    target = torch.tensor([3, 7])
    ours = loss_and_grads(op_path, h, w, b, target, upstream=65536.0)
    expected = loss_and_grads(torch_path, h, w, b, target, upstream=65536.0)
    exact = loss_and_grads(torch_path, h.double(), w.double(), b.double(), target, upstream=65536.0)
    assert all(grad.isfinite().all() for grad in expected[1])
    assert all(grad.isfinite().all() for grad in ours[1])
    assert_close_to(ours, expected, torch.float16, float64=exact)


def test_unscaled_weight_gradient_larger_than_fp16_is_not_computed() -> None:
    # 4096 rows of one class with h = 32: G.T @ h is about -131072 in that class's column, past
    # fp16's 65504, while the mean's gradient (r = 1/4096) is about -32. Rounding G.T @ h to fp16
    # before scaling would give -inf; the float32 product scaled first gives the true value.
    num_rows = 4096
    h = torch.full((num_rows, 2), 32.0, dtype=torch.float16)
    w = torch.zeros(3, 2, dtype=torch.float16)
    w[0] = -1.0  # the target class has the smallest logit: softmax - onehot is about -1 there
    target = torch.zeros(num_rows, dtype=torch.int64)
    ours = loss_and_grads(op_path, h, w, None, target)
    expected = loss_and_grads(torch_path, h, w, None, target)
    assert ours[1][1].isfinite().all()
    assert_close_to(ours, expected, torch.float16)


def test_per_row_upstream_gradients_of_different_sizes() -> None:
    # reduction="none" with upstream gradients spanning 2**-10 .. 2**10: each row keeps its weight.
    h, w, b, target = make_problem(5, 8, 13, torch.float16, seed=5)
    weights = torch.tensor([2.0**-10, 1.0, 2.0**10, -3.0, 0.0])

    def weighted(function):
        leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
        (function(*leaves, target, reduction="none") * weights).sum().backward()
        return [leaf.grad for leaf in leaves]

    ours = weighted(op_path)
    expected = weighted(torch_path)
    exact = [g for g in weighted(lambda *a, **k: torch_path(*(x.double() for x in a[:3]), a[3], **k))]
    assert_close_to(
        (torch.zeros(()), ours), (torch.zeros(()), expected), torch.float16, float64=(None, exact)
    )
    assert torch.all(ours[0][4] == 0)  # a zero upstream gradient: that row's input gradient is 0


def test_all_zero_upstream_gradient_gives_zero_gradients() -> None:
    h, w, b, target = make_problem(3, 8, 5, torch.bfloat16, seed=6)
    _, grads = loss_and_grads(op_path, h, w, b, target, upstream=0.0)
    assert all(torch.all(grad == 0) for grad in grads)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_rows(path, reduction) -> None:
    h, w, b, _ = make_problem(0, 8, 5, torch.float16, seed=16)
    target = torch.zeros(0, dtype=torch.int64)
    ours = loss_and_grads(PATHS[path], h, w, b, target, reduction=reduction)
    expected = loss_and_grads(torch_path, h, w, b, target, reduction=reduction)
    torch.testing.assert_close(ours[0], expected[0], equal_nan=True)  # a mean of nothing is NaN
    for grad, expected_grad in zip(ours[1], expected[1], strict=True):
        assert torch.equal(grad, expected_grad)


def test_double_backward_raises() -> None:
    # The gradient treats G as a constant: differentiating it again must fail, not be silently wrong.
    h, w, b, target = make_problem(3, 8, 5, torch.float16, seed=7)
    w.requires_grad_()
    losses, _ = linear_cross_entropy_rows(h, w, b, target, IGNORE_INDEX)  # the op's own autograd
    for loss in (op_path(h, w, b, target), losses.sum()):
        (grad,) = torch.autograd.grad(loss.square(), w, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            grad.float().sum().backward()


@pytest.mark.parametrize("path", PATHS)
def test_out_of_range_target_is_a_nan_row(path) -> None:
    h, w, b, target = make_problem(3, 8, 5, torch.float16, seed=8)
    target[1] = 5
    loss, grads = loss_and_grads(PATHS[path], h, w, b, target, reduction="none")
    assert loss[1].isnan() and loss[[0, 2]].isfinite().all()
    assert grads[0][1].isnan().all() and grads[0][[0, 2]].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_products_of_an_unaligned_vocabulary_are_padded(dtype, monkeypatch) -> None:
    """On torch.compile's path 13 classes (GPT-2's 50257 alike) are padded to 16 bytes a row for
    every matmul, forward and backward, as Inductor pads the products it compiles (cuBLAS runs
    unaligned ones several times slower); the values are unchanged."""
    shapes = []

    def recorded(function):
        def call(*args):
            shapes.extend(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            return function(*args)

        return call

    monkeypatch.setattr(cross_entropy_op, "matmul_fp32", recorded(cross_entropy_op.matmul_fp32))
    monkeypatch.setattr(F, "linear", recorded(F.linear))
    h, w, b, target = make_problem(10, 8, 13, dtype, seed=17)
    target[4] = IGNORE_INDEX
    ours = loss_and_grads(op_path, h, w, b, target)
    assert shapes and not any(13 in shape for shape in shapes), shapes
    assert any(16 in shape for shape in shapes), shapes
    monkeypatch.undo()
    expected = loss_and_grads(torch_path, h, w, b, target)
    exact = loss_and_grads(torch_path, h.double(), w.double(), b.double(), target)
    assert_close_to(ours, expected, dtype, float64=exact)


CASES = [
    {"label_smoothing": 0.1},
    {"class_weight": torch.rand(9)},
    {"reduction": "mean", "as_probabilities": True},
    {"dtype": torch.float64},
    {"mismatched_dtypes": True},
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: next(iter(case)))
def test_other_calls_are_exactly_the_torch_path(case, fused_calls) -> None:
    # Not fused: the same values, bit for bit, and the same errors.
    case = dict(case)
    dtype = case.pop("dtype", torch.bfloat16)
    h, w, b, target = make_problem(4, 8, 9, dtype, seed=9)
    if case.pop("as_probabilities", False):
        target = torch.softmax(torch.randn(4, 9), dim=1)
    if case.pop("mismatched_dtypes", False):
        for bad_b, bad_target in ((b.float(), target), (b, target.int())):
            with pytest.raises(RuntimeError) as expected:
                torch_path(h, w, bad_b, bad_target)
            with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
                linear_cross_entropy(h, w, bad_b, bad_target)
        assert fused_calls == []
        return
    ours = loss_and_grads(linear_cross_entropy, h, w, b, target, **case)
    torch_kwargs = {("weight" if k == "class_weight" else k): v for k, v in case.items()}
    expected = loss_and_grads(torch_path, h, w, b, target, **torch_kwargs)
    assert torch.equal(ours[0], expected[0])
    for grad, expected_grad in zip(ours[1], expected[1], strict=True):
        assert torch.equal(grad, expected_grad)
    assert fused_calls == []


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("path", PATHS)
def test_dispatches_to_triton(path, triton_calls) -> None:
    h, w, b, target = make_problem(5, 8, 40, torch.bfloat16, seed=10)
    target[3] = IGNORE_INDEX
    ours = loss_and_grads(PATHS[path], h, w, b, target)
    expected = loss_and_grads(torch_path, h, w, b, target)
    assert_close_to(ours, expected, torch.bfloat16)
    # The Triton kernels ran (the reference gives the same numbers): the eager path's loss op runs a
    # forward and a backward kernel, the captured op one kernel that writes the gradient with the loss.
    expected_calls = {"eager": {"cross_entropy_forward": 1, "cross_entropy_backward": 1}}
    assert triton_calls == expected_calls.get(path, {"cross_entropy_forward_with_grad": 1})


@pytest.mark.parametrize("path", PATHS)
def test_never_reads_a_value_on_the_host(path, kernels, fused_calls, no_host_reads) -> None:
    # Ignored rows and the mean's divisor stay on the device: no synchronization (on a GPU) in the
    # forward or the backward.
    h, w, b, target = make_problem(5, 8, 40, torch.float16, seed=12)
    target[3] = IGNORE_INDEX
    with no_host_reads():
        ours = loss_and_grads(PATHS[path], h, w, b, target)
    assert fused_calls == [path]
    assert_close_to(ours, loss_and_grads(torch_path, h, w, b, target), torch.float16)


def fused_and_fallback(h, w, b, target) -> torch.Tensor:
    # Both branches of linear_cross_entropy in one graph: fused, then label smoothing (torch path).
    return linear_cross_entropy(h, w, b, target) + linear_cross_entropy(h, w, b, target, label_smoothing=0.1)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_compiles_without_graph_breaks(reduction) -> None:
    def loss_fn(h, w, b, target):
        return linear_cross_entropy(h, w, b, target, reduction=reduction)

    h, w, b, target = make_problem(4, 8, 11, torch.float16, seed=11)
    target[1] = IGNORE_INDEX
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    ours = loss_and_grads(compiled, h, w, b, target)
    # The compiled function runs the op, as op_path does eagerly: the same kernels, the same bits.
    expected = loss_and_grads(op_path, h, w, b, target, reduction=reduction)
    assert torch.equal(ours[0], expected[0])
    for grad, expected_grad in zip(ours[1], expected[1], strict=True):
        assert torch.equal(grad, expected_grad)
    compiled_both = torch.compile(fused_and_fallback, backend="aot_eager", fullgraph=True)
    assert_close_to(
        loss_and_grads(compiled_both, h, w, b, target),
        loss_and_grads(fused_and_fallback, h, w, b, target),
        torch.float16,
    )


def test_compiled_forward_is_the_op_and_backward_plain_math() -> None:
    from torch._dynamo.backends.common import aot_autograd

    code: dict[str, str] = {}

    def keep(name):
        def compiler(gm, example_inputs):
            code[name] = gm.code
            return gm

        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    h, w, b, target = make_problem(4, 8, 11, torch.float16, seed=12)
    torch._dynamo.reset()
    compiled = torch.compile(linear_cross_entropy, backend=backend, fullgraph=True)
    loss_and_grads(compiled, h, w, b, target)
    assert "linear_cross_entropy_rows" in code["forward"]
    assert "amp_fx" not in code["backward"] and "mm" in code["backward"]


def test_opcheck() -> None:
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    h, w, b, target = make_problem(3, 8, 6, torch.float16, seed=13)
    target[1] = IGNORE_INDEX
    args = [t.requires_grad_() for t in (h, w, b)]
    opcheck(linear_cross_entropy_rows.op, (*args, target, IGNORE_INDEX))
    opcheck(linear_cross_entropy_rows.op, (args[0], args[1], None, target, IGNORE_INDEX))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt_sized_head_on_gpu(path, dtype) -> None:
    h, w, _, target = make_problem(64, 768, 50304, dtype, seed=14, bias=False)
    h, w, target = h.cuda(), w.cuda(), target.cuda()
    target[3] = IGNORE_INDEX
    ours = loss_and_grads(PATHS[path], h, w, None, target, upstream=1024.0)
    expected = loss_and_grads(torch_path, h, w, None, target, upstream=1024.0)
    assert_close_to(ours, expected, dtype)


@pytest.mark.gpu
def test_compiles_with_inductor_on_gpu() -> None:
    h, w, b, target = (x.cuda() for x in make_problem(64, 64, 1000, torch.float16, seed=15))
    target[7] = IGNORE_INDEX
    torch._dynamo.reset()
    compiled = torch.compile(fused_and_fallback, fullgraph=True)
    ours = loss_and_grads(compiled, h, w, b, target, upstream=1024.0)
    expected = loss_and_grads(fused_and_fallback, h, w, b, target, upstream=1024.0)
    assert_close_to(ours, expected, torch.float16)
