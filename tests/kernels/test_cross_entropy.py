"""The fused cross-entropy kernels: Triton against the pure-torch reference, the reference against
float64.

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same checks run on CUDA when marked
`gpu`. Most cases use a small launch configuration (16 columns per block) so that rows of a few
dozen classes cross block boundaries, with some widths not a multiple of the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.kernels.cross_entropy import triton as cross_entropy_triton
from amp_fx.kernels.cross_entropy.triton import CrossEntropyLaunch
from amp_fx.testing import rounding_tolerances, tolerances

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SMALL = CrossEntropyLaunch(block_size=16, num_warps=1)
# Widths around the small block (16): one column, inside one block, on and across block boundaries.
NUM_CLASSES = [1, 5, 16, 17, 40]
IGNORE_INDEX = -100


@contextlib.contextmanager
def launch_config(config: CrossEntropyLaunch) -> Iterator[None]:
    saved = cross_entropy_triton.LAUNCH
    cross_entropy_triton.LAUNCH = config
    try:
        yield
    finally:
        cross_entropy_triton.LAUNCH = saved


def assert_losses_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Losses and logsumexps: fp32 results that differ in summation order only."""
    assert actual.dtype == torch.float32
    rtol, atol = tolerances(torch.float32)
    torch.testing.assert_close(actual, expected.float(), rtol=rtol, atol=atol, equal_nan=True)


def assert_rounded_once_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Gradients in the logits' dtype, each side rounded once from fp32 math (or float64)."""
    assert actual.dtype == expected.dtype
    rtol, atol = rounding_tolerances(actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def make_rows(
    num_rows: int, num_classes: int, dtype: torch.dtype, seed: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of scale 4 (softmax neither uniform nor one-hot), targets and upstream gradients."""
    generator = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(num_rows, num_classes, generator=generator)).to(dtype)
    target = torch.randint(0, num_classes, (num_rows,), generator=generator)
    grad_losses = torch.rand(num_rows, generator=generator) + 0.5
    return logits.to(device), target.to(device), grad_losses.to(device)


def run_both(
    logits: torch.Tensor, target: torch.Tensor, grad_losses: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(losses, lse, grad) from the Triton kernels (small launch) and from the reference."""
    with launch_config(SMALL):
        losses, lse = triton_ops.cross_entropy_forward(logits, target, ignore_index)
        grad = triton_ops.cross_entropy_backward(grad_losses, logits, target, lse, ignore_index)
    ref_losses, ref_lse = reference.cross_entropy_forward(logits, target, ignore_index)
    ref_grad = reference.cross_entropy_backward(grad_losses, logits, target, ref_lse, ignore_index)
    return (losses, lse, grad), (ref_losses, ref_lse, ref_grad)


def assert_matches(ours: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    losses, lse, grad = ours
    ref_losses, ref_lse, ref_grad = expected
    assert_losses_close(losses, ref_losses)
    assert_losses_close(lse, ref_lse)
    assert_rounded_once_close(grad, ref_grad)


@given(
    dtype=st.sampled_from(DTYPES),
    num_rows=st.integers(1, 4),
    num_classes=st.sampled_from(NUM_CLASSES),
    ignored=st.lists(st.booleans(), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference(device, dtype, num_rows, num_classes, ignored, seed) -> None:
    logits, target, grad_losses = make_rows(num_rows, num_classes, dtype, seed, device)
    target[torch.tensor(ignored[:num_rows], device=device)] = IGNORE_INDEX
    ours, expected = run_both(logits, target, grad_losses)
    assert_matches(ours, expected)
    ignored_rows = target == IGNORE_INDEX
    assert torch.all(ours[0][ignored_rows] == 0)
    assert torch.all(ours[2][ignored_rows] == 0)


def test_production_launch_and_wide_rows(device) -> None:
    # The production configuration: a 300-class row is one masked block of 512.
    logits, target, grad_losses = make_rows(3, 300, torch.float16, 0, device)
    losses, lse = triton_ops.cross_entropy_forward(logits, target, IGNORE_INDEX)
    grad = triton_ops.cross_entropy_backward(grad_losses, logits, target, lse, IGNORE_INDEX)
    ref_losses, ref_lse = reference.cross_entropy_forward(logits, target, IGNORE_INDEX)
    ref_grad = reference.cross_entropy_backward(grad_losses, logits, target, ref_lse, IGNORE_INDEX)
    assert_matches((losses, lse, grad), (ref_losses, ref_lse, ref_grad))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_over_the_logits(device, dtype) -> None:
    # out=logits: the gradient overwrites the logits, each element read before it is written.
    logits, target, grad_losses = make_rows(3, 40, dtype, seed=5, device=device)
    target[1] = IGNORE_INDEX
    _, lse = reference.cross_entropy_forward(logits, target, IGNORE_INDEX)
    expected = reference.cross_entropy_backward(grad_losses, logits, target, lse, IGNORE_INDEX)
    for implementation in (reference, triton_ops):
        overwritten = logits.clone()
        with launch_config(SMALL):
            grad = implementation.cross_entropy_backward(
                grad_losses, overwritten, target, lse, IGNORE_INDEX, out=overwritten
            )
        assert grad.data_ptr() == overwritten.data_ptr()
        assert_rounded_once_close(overwritten, expected)


def test_backward_out_must_match_the_logits() -> None:
    logits, target, grad_losses = make_rows(2, 5, torch.float16, seed=1, device="cpu")
    _, lse = reference.cross_entropy_forward(logits, target, IGNORE_INDEX)
    with pytest.raises(ValueError, match="out must be a contiguous torch.float16 tensor"):
        reference.cross_entropy_backward(grad_losses, logits, target, lse, IGNORE_INDEX, out=logits.float())
    with pytest.raises(ValueError, match="not contiguous"):
        reference.cross_entropy_backward(
            grad_losses, logits, target, lse, IGNORE_INDEX, out=torch.empty(5, 2, dtype=torch.float16).t()
        )
    # Rows 1-2 of a buffer whose rows 0-1 are the logits: row 1 would be overwritten while read.
    buffer = torch.cat([logits, logits])
    with pytest.raises(ValueError, match="overlaps the logits"):
        reference.cross_entropy_backward(grad_losses, buffer[:2], target, lse, IGNORE_INDEX, out=buffer[1:3])
    # Rows 2-3, beside the logits in the same buffer, and out=logits (in place) are fine.
    for out in (buffer[2:], buffer[:2]):
        reference.cross_entropy_backward(grad_losses, buffer[:2], target, lse, IGNORE_INDEX, out=out)


def test_out_of_range_target_gives_a_nan_row(device) -> None:
    logits, _, grad_losses = make_rows(5, 17, torch.float16, 1, device)
    # Past the end, negative, far past the end, a valid one, and a valid class used as ignore_index.
    target = torch.tensor([17, -1, 10**9, 3, 0], device=device)
    ours, expected = run_both(logits, target, grad_losses, ignore_index=0)
    assert_matches(ours, expected)
    losses, lse, grad = ours
    assert losses[:3].isnan().all() and grad[:3].isnan().all()
    assert losses[3].isfinite() and grad[3].isfinite().all()
    assert losses[4] == 0 and torch.all(grad[4] == 0)
    assert lse.isfinite().all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on -inf - -inf
def test_non_finite_logits(device) -> None:
    logits, target, grad_losses = make_rows(4, 20, torch.bfloat16, 2, device)
    logits[0, 3] = float("-inf")  # a masked-out class: finite loss, zero gradient there
    target[0] = 4
    logits[1] = float("-inf")  # every class -inf: lse -inf, loss NaN (torch's log_softmax gives NaN too)
    logits[2, 7] = float("nan")  # an ignored row's logits are never read for the gradient
    target[2] = IGNORE_INDEX
    logits[3, 0:17] = float("-inf")  # the first block is all -inf, the running max stays -inf
    target[3] = 18
    ours, expected = run_both(logits, target, grad_losses)
    assert_matches(ours, expected)
    losses, lse, grad = ours
    assert losses[0].isfinite() and grad[0, 3] == 0
    assert lse[1] == float("-inf") and losses[1].isnan()
    assert losses[2] == 0 and torch.all(grad[2] == 0)
    assert losses[3].isfinite() and grad[3].isfinite().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(device, dtype) -> None:
    wide, target, grad_losses = make_rows(3, 40, dtype, 3, device)
    logits = wide[:, 5:22]  # row stride 40, rows contiguous
    transposed = logits.t().contiguous().t()  # columns strided: the wrappers copy
    targets = torch.stack([target % 17, target], dim=1)[:, 0]  # stride 2
    expanded = grad_losses[:1].expand(3)  # stride 0, as a mean's backward hands it over
    for x in (logits, transposed):
        ours, expected = run_both(x, targets, expanded)
        assert_matches(ours, expected)
        dense, _ = run_both(x.contiguous(), targets.contiguous(), expanded.contiguous())
        for a, b in zip(ours, dense, strict=True):
            assert torch.equal(a, b)
        assert ours[2].is_contiguous() and expected[2].is_contiguous()


def test_no_rows(device) -> None:
    logits = torch.zeros(0, 7, dtype=torch.float16, device=device)
    target = torch.zeros(0, dtype=torch.int64, device=device)
    losses, lse = triton_ops.cross_entropy_forward(logits, target, IGNORE_INDEX)
    grad = triton_ops.cross_entropy_backward(losses, logits, target, lse, IGNORE_INDEX)
    assert losses.shape == lse.shape == (0,) and grad.shape == (0, 7) and grad.dtype == torch.float16


@pytest.mark.parametrize(
    ("logits", "target", "error", "message"),
    [
        (torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.int64), ValueError, "2-D"),
        (torch.zeros(2, 0), torch.zeros(2, dtype=torch.int64), ValueError, "at least one class"),
        (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.int64), ValueError, "float64"),
        (torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32), ValueError, "target.long()"),
        (torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64), ValueError, "shape \\(2,\\)"),
    ],
)
def test_bad_arguments_raise_the_same_errors(logits, target, error, message) -> None:
    for implementation in (reference, triton_ops):
        with pytest.raises(error, match=message):
            implementation.cross_entropy_forward(logits, target, IGNORE_INDEX)
    lse = torch.zeros(2, dtype=torch.float16)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match="lse must be float32"):
            implementation.cross_entropy_backward(
                torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), lse, IGNORE_INDEX
            )


@given(
    dtype=st.sampled_from(DTYPES),
    num_rows=st.integers(1, 5),
    num_classes=st.sampled_from(NUM_CLASSES),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_float64(dtype, num_rows, num_classes, seed) -> None:
    logits, target, grad_losses = make_rows(num_rows, num_classes, dtype, seed, "cpu")
    target[0] = IGNORE_INDEX
    losses, lse = reference.cross_entropy_forward(logits, target, IGNORE_INDEX)
    grad = reference.cross_entropy_backward(grad_losses, logits, target, lse, IGNORE_INDEX)

    x = logits.double()
    log_probs = torch.log_softmax(x, dim=1)
    valid = target != IGNORE_INDEX
    safe_target = torch.where(valid, target, 0)
    expected_losses = torch.where(valid, -log_probs.gather(1, safe_target[:, None])[:, 0], 0.0)
    onehot = torch.nn.functional.one_hot(safe_target, num_classes).double()
    expected_grad = grad_losses.double()[:, None] * (log_probs.exp() - onehot) * valid[:, None]
    assert_losses_close(losses, expected_losses)
    assert_losses_close(lse, torch.logsumexp(x, dim=1))
    assert_rounded_once_close(grad, expected_grad.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt_sized_rows_on_gpu(dtype) -> None:
    # GPT-2's padded vocabulary; one row ignored and the mean's expanded upstream gradient.
    logits, target, _ = make_rows(16, 50304, dtype, 4, "cuda")
    target[5] = IGNORE_INDEX
    grad_losses = torch.full((1,), 1 / 15, device="cuda").expand(16)
    losses, lse = triton_ops.cross_entropy_forward(logits, target, IGNORE_INDEX)
    grad = triton_ops.cross_entropy_backward(grad_losses, logits, target, lse, IGNORE_INDEX)
    ref_losses, ref_lse = reference.cross_entropy_forward(logits, target, IGNORE_INDEX)
    ref_grad = reference.cross_entropy_backward(grad_losses, logits, target, ref_lse, IGNORE_INDEX)
    assert_matches((losses, lse, grad), (ref_losses, ref_lse, ref_grad))
