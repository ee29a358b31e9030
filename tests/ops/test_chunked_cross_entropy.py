"""chunked_linear_cross_entropy against F.cross_entropy(F.linear(h, W, b).float().view(-1, V), t):
the loss and the gradients of the hidden states, the head's weight and bias, against float64 and
against that low-precision head with a float32 loss (what torch.autocast and O2 compute).

The chunked op rounds the logits' gradient G = softmax - onehot once to the low dtype and
accumulates the matmuls over chunks in float32, so its error against float64 is that of one
low-precision rounding of G and of the logits: at most about the autocast path's own error.
With a softcap the op computes ``c * tanh(logits / c)`` and its derivative in float32, where the
unfused path rounds after each of the division, tanh and product: fewer roundings, the same bounds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import amp_fx.ops.chunked_cross_entropy as chunked_module
from amp_fx.ops.chunked_cross_entropy import (
    chunked_linear_cross_entropy,
    chunked_linear_cross_entropy_sum,
    default_chunk_rows,
)
from amp_fx.testing import grad_tolerances, tolerances
from amp_fx.testing.comparison import normwise_error

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
IGNORE_INDEX = -100


def make_problem(rows: int, dim: int, classes: int, dtype: torch.dtype, seed: int, bias: bool = False):
    """Hidden states (rows, dim), head weight, bias and targets (a few ignored); logits of scale ~3."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=generator).to(dtype)
    w = (torch.randn(classes, dim, generator=generator) * 3 / dim**0.5).to(dtype)
    b = torch.randn(classes, generator=generator).to(dtype) if bias else None
    target = torch.randint(0, classes, (rows,), generator=generator)
    target[::5] = IGNORE_INDEX
    return h, w, b, target


def run(function, h, w, b, target, upstream: float = 1.0, **kwargs):
    """The loss and the gradients of ``upstream * loss`` w.r.t. fresh leaf copies of (h, w, b)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (h, w, b)]
    loss = function(*leaves, target, **kwargs)
    (loss * upstream).backward()
    return loss.detach(), [leaf.grad if leaf is not None else None for leaf in leaves]


def torch_path(h, w, b, target, softcap: float | None = None, **kwargs):
    """The unfused head and loss (autocast's and O2's math); a softcap computed in the logits'
    dtype, as Hugging Face's Gemma2 writes it and O2 runs it."""
    logits = F.linear(h, w, b)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.to(torch.promote_types(logits.dtype, F32))  # float64 stays float64
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1), **kwargs)


def assert_as_accurate_as_autocast(h, w, b, target, upstream: float = 1.0, **kwargs) -> None:
    """Loss and gradients: within the dtype's tolerances of float64, and no further from it than
    twice the unfused low-precision path is."""
    dtype = h.dtype
    loss, grads = run(chunked_linear_cross_entropy, h, w, b, target, upstream, **kwargs)
    chunk_kwargs = {k: v for k, v in kwargs.items() if k != "chunk_rows"}
    ref_loss, ref_grads = run(torch_path, h, w, b, target, upstream, **chunk_kwargs)
    exact = [t.double() if t is not None else None for t in (h, w, b)]
    exact_loss, exact_grads = run(torch_path, *exact, target, upstream, **chunk_kwargs)
    assert loss.dtype == F32
    rtol, atol = tolerances(F32)
    if kwargs.get("softcap") is None:
        # Against the same low-precision logits: float32 summation order only.
        torch.testing.assert_close(loss, ref_loss, rtol=rtol * 10, atol=atol * 10)
    else:  # the unfused path rounds the capped logits three times more: the dtype's tolerances
        torch.testing.assert_close(
            loss, ref_loss, **dict(zip(("rtol", "atol"), tolerances(dtype), strict=True))
        )
    low_rtol, low_atol = tolerances(dtype)
    torch.testing.assert_close(loss.double(), exact_loss, rtol=low_rtol, atol=low_atol)
    grad_rtol, _ = grad_tolerances(dtype)
    for grad, ref, expected in zip(grads, ref_grads, exact_grads, strict=True):
        if expected is None:
            assert grad is None
            continue
        assert grad.dtype == ref.dtype == dtype
        ours, theirs = normwise_error(grad.double(), expected), normwise_error(ref.double(), expected)
        assert ours <= grad_rtol, (ours, theirs)
        assert ours <= 2 * theirs + 2 * torch.finfo(dtype).eps, (ours, theirs)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 23, 64], ids=lambda n: f"chunk{n}")
def test_matches_float64_and_autocast_across_chunk_boundaries(dtype, reduction, chunk_rows):
    # 23 rows: chunks of 4 and 7 leave a short last chunk; 23 and 64 are one chunk.
    h, w, b, target = make_problem(23, 16, 37, dtype, seed=1)
    assert_as_accurate_as_autocast(h, w, b, target, reduction=reduction, chunk_rows=chunk_rows)


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_bias_and_leading_dimensions(dtype):
    h, w, b, target = make_problem(12, 8, 11, dtype, seed=2, bias=True)
    assert_as_accurate_as_autocast(h.view(3, 4, 8), w, b, target.view(3, 4), chunk_rows=5)


def test_loss_scale_and_num_items_in_batch():
    """Hugging Face's ``sum / num_items_in_batch`` under a loss scale of 2**14: the scale reaches
    the float32 gradients before the one rounding to fp16, as on the unfused path."""
    h, w, b, target = make_problem(40, 16, 29, F16, seed=3)
    num_items = torch.tensor(57)  # counted over every micro-batch of the step, as Trainer passes it

    def divided(function):
        return lambda *a, **k: function(*a, reduction="sum", **k) / num_items

    loss, grads = run(divided(chunked_linear_cross_entropy), h, w, b, target, 2.0**14, chunk_rows=16)
    ref_loss, ref_grads = run(divided(torch_path), h, w, b, target, 2.0**14)
    torch.testing.assert_close(loss, ref_loss, **dict(zip(("rtol", "atol"), tolerances(F32), strict=True)))
    for grad, ref in zip(grads[:2], ref_grads[:2], strict=True):
        assert torch.isfinite(grad).all()
        assert normwise_error(grad.double(), ref.double()) <= grad_tolerances(F16)[0]


def test_all_rows_ignored():
    """As torch: a mean over no rows is NaN with zero gradients, a sum is 0."""
    h, w, b, target = make_problem(9, 8, 13, BF16, seed=4, bias=True)
    target[:] = IGNORE_INDEX
    loss, grads = run(chunked_linear_cross_entropy, h, w, b, target, chunk_rows=4)
    ref_loss, _ = run(torch_path, h, w, b, target)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    loss, grads = run(chunked_linear_cross_entropy, h, w, b, target, reduction="sum", chunk_rows=4)
    assert loss == 0 and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_tied_head_weight_sums_both_gradients():
    """A head tied to the embedding: the weight's gradient is the head's plus the embedding's."""
    generator = torch.Generator().manual_seed(5)
    table = (torch.randn(31, 16, generator=generator) / 4).requires_grad_()
    ids = torch.randint(0, 31, (2, 9), generator=generator)
    target = torch.randint(0, 31, (18,), generator=generator)

    def model(loss_function, weight):
        hidden = torch.tanh(F.embedding(ids, weight))
        return loss_function(hidden.to(BF16), weight.to(BF16), None, target)

    loss = model(lambda *a: chunked_linear_cross_entropy(*a, chunk_rows=8), table)
    (grad,) = torch.autograd.grad(loss, table)
    exact_table = table.detach().double().requires_grad_()
    exact = torch_path(torch.tanh(F.embedding(ids, exact_table)), exact_table, None, target)
    (exact_grad,) = torch.autograd.grad(exact, exact_table)
    assert grad.dtype == F32
    assert normwise_error(grad.double(), exact_grad) <= grad_tolerances(BF16)[0]


def test_without_gradients_only_the_loss():
    h, w, b, target = make_problem(10, 8, 13, BF16, seed=6)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h.requires_grad_(), w, b, target, chunk_rows=3)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, torch_path(h.detach(), w, b, target))
    _, _, grad_input, grad_weight, _ = chunked_linear_cross_entropy_sum(
        h.detach(), w, None, target, IGNORE_INDEX, 3, False, False, False
    )
    assert grad_input.numel() == grad_weight.numel() == 0


def test_calls_the_chunks_cannot_compute_are_torchs():
    """reduction="none" (no scalar to take the gradient of in the forward): exactly torch's."""
    h, w, b, target = make_problem(6, 8, 13, F16, seed=7)
    expected = torch_path(h, w, b, target, reduction="none")
    assert torch.equal(chunked_linear_cross_entropy(h, w, b, target, reduction="none"), expected)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        chunked_linear_cross_entropy(h, w, b, target, chunk_rows=0)


def test_another_ignore_index():
    h, w, b, target = make_problem(12, 8, 13, BF16, seed=7)
    target[target == IGNORE_INDEX] = 3
    assert_as_accurate_as_autocast(h, w, b, target, ignore_index=3, chunk_rows=5)


@pytest.mark.parametrize("dtype", [F16, F32])
def test_products_of_an_unaligned_vocabulary_are_padded(dtype, monkeypatch):
    """13 classes (GPT-2's 50257 alike) are padded to 16 bytes a row for every matmul, as Inductor
    pads them (cuBLAS runs unaligned products several times slower); the result is unchanged."""
    shapes = []

    def recorded(function):
        def call(*args):
            shapes.extend(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            return function(*args)

        return call

    monkeypatch.setattr(chunked_module, "matmul_fp32", recorded(chunked_module.matmul_fp32))
    monkeypatch.setattr(F, "linear", recorded(F.linear))
    h, w, b, target = make_problem(10, 8, 13, dtype, seed=9, bias=True)
    loss, grads = run(chunked_linear_cross_entropy, h, w, b, target, chunk_rows=4)
    assert shapes and not any(13 in shape for shape in shapes), shapes
    assert any(16 in shape for shape in shapes), shapes
    assert [g.shape for g in grads] == [h.shape, w.shape, b.shape]
    monkeypatch.undo()
    assert_as_accurate_as_autocast(h, w, b, target, chunk_rows=4)


def test_a_target_among_the_padding_classes_is_still_out_of_range():
    """Unpadded, a target in [V, V + padding) is out of range: its loss stays NaN, not inf."""
    h, w, b, target = make_problem(6, 8, 13, BF16, seed=10)
    target[2] = 14
    assert torch.isnan(chunked_linear_cross_entropy(h, w, b, target, chunk_rows=4))


def test_default_chunk_rows_bound_the_logits():
    assert default_chunk_rows(32000, BF16) * 32000 * 2 <= 256 * 2**20
    assert default_chunk_rows(10**9, F32) == 1


def test_the_op_registration_is_consistent():
    """Fake implementation, autograd and schema agree (torch.library's own checks)."""
    h, w, b, target = make_problem(5, 8, 7, F32, seed=8, bias=True)
    arguments = (
        h.requires_grad_(),
        w.requires_grad_(),
        b.requires_grad_(),
        target,
        IGNORE_INDEX,
        2,
        True,
        True,
        True,
    )
    for softcap in (None, 4.0):
        torch.library.opcheck(
            chunked_linear_cross_entropy_sum.op,
            (*arguments, softcap),
            test_utils=("test_schema", "test_faketensor"),
        )


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64], ids=lambda n: f"chunk{n}")
def test_softcap_matches_float64_and_autocast(dtype, reduction, chunk_rows):
    """Gemma2's final logit softcapping, c * tanh(logits / c), at a cap the logits reach (~3 of
    scale against c = 5: tanh's derivative well below 1) and at Gemma2's 30; with a bias, an
    unaligned vocabulary (padding classes: masked after the cap) and a short last chunk."""
    h, w, b, target = make_problem(23, 16, 37, dtype, seed=11, bias=True)
    for softcap in (5.0, 30.0):
        assert_as_accurate_as_autocast(
            h, w, b, target, reduction=reduction, chunk_rows=chunk_rows, softcap=softcap
        )


def test_softcap_no_grad_leading_dimensions_and_fallback():
    h, w, b, target = make_problem(12, 8, 13, BF16, seed=12)
    assert_as_accurate_as_autocast(h.view(3, 4, 8), w, b, target.view(3, 4), chunk_rows=5, softcap=2.0)
    with torch.no_grad():
        loss = chunked_linear_cross_entropy(h, w, b, target, chunk_rows=3, softcap=2.0)
    expected = torch_path(h.double(), w.double(), None, target, softcap=2.0)
    torch.testing.assert_close(
        loss.double(), expected, **dict(zip(("rtol", "atol"), tolerances(BF16), strict=True))
    )
    # reduction="none" is torch's expression, the cap in float32.
    none = chunked_linear_cross_entropy(h, w, b, target, reduction="none", softcap=2.0)
    logits = torch.tanh(F.linear(h, w).float() / 2.0) * 2.0
    assert torch.equal(none, F.cross_entropy(logits, target, reduction="none"))
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="softcap must be a positive finite number"):
            chunked_linear_cross_entropy(h, w, b, target, softcap=bad)


@given(
    dtype=st.sampled_from([F16, BF16]),
    rows=st.integers(1, 20),
    classes=st.integers(2, 40),
    chunk_rows=st.integers(1, 24),
    reduction=st.sampled_from(["mean", "sum"]),
    softcap=st.sampled_from([None, 1.0, 3.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_any_sizes(dtype, rows, classes, chunk_rows, reduction, softcap, seed):
    h, w, b, target = make_problem(rows, 8, classes, dtype, seed, bias=seed % 2 == 0)
    target[0] = min(classes - 1, 1)  # at least one row counted: a mean over none is NaN
    assert_as_accurate_as_autocast(
        h, w, b, target, reduction=reduction, chunk_rows=chunk_rows, softcap=softcap
    )


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_triton_kernel_path(kernels, dtype):
    """The same through the Triton cross-entropy kernel (CPU under TRITON_INTERPRET=1)."""
    h, w, b, target = make_problem(10, 16, 33, dtype, seed=9)
    assert_as_accurate_as_autocast(h, w, b, target, chunk_rows=4)
    assert_as_accurate_as_autocast(h, w, b, target, chunk_rows=3, softcap=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_on_cuda(dtype):
    """cuBLAS with float32 outputs and the Triton kernel, at a vocabulary wider than a kernel block."""
    h, w, b, target = (
        t.cuda() if t is not None else None for t in make_problem(300, 64, 5003, dtype, seed=10)
    )
    assert_as_accurate_as_autocast(h, w, b, target, chunk_rows=128)
    assert_as_accurate_as_autocast(h, w, b, target, reduction="sum", chunk_rows=300)
    assert_as_accurate_as_autocast(h, w, b, target, chunk_rows=128, softcap=30.0)
