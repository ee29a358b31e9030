"""`cross_entropy_forward_with_grad`: the losses and the unscaled gradient written over the logits,
Triton against the pure-torch reference, the reference against float64 and against the forward +
backward kernels it fuses.

Small launch configuration (16 columns per block) so that rows of a few dozen classes cross block
boundaries; on CPU the Triton kernel runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from tests.kernels.test_cross_entropy import (
    DTYPES,
    IGNORE_INDEX,
    NUM_CLASSES,
    SMALL,
    assert_losses_close,
    assert_rounded_once_close,
    launch_config,
    make_rows,
)

Pair = tuple[torch.Tensor, torch.Tensor]


def run_both(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[Pair, Pair]:
    """((losses, gradient) from Triton with the small launch, the same from the reference), each
    on its own copy of the logits."""
    ours, theirs = logits.clone(), logits.clone()
    with launch_config(SMALL):
        losses = triton_ops.cross_entropy_forward_with_grad(ours, target, ignore_index)
    ref_losses = reference.cross_entropy_forward_with_grad(theirs, target, ignore_index)
    return (losses, ours), (ref_losses, theirs)


def assert_matches(ours: Pair, expected: Pair) -> None:
    assert_losses_close(ours[0], expected[0])
    assert_rounded_once_close(ours[1], expected[1])


@given(
    dtype=st.sampled_from(DTYPES),
    num_rows=st.integers(1, 4),
    num_classes=st.sampled_from(NUM_CLASSES),
    ignored=st.lists(st.booleans(), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_triton_matches_reference(device, dtype, num_rows, num_classes, ignored, seed) -> None:
    logits, target, _ = make_rows(num_rows, num_classes, dtype, seed, device)
    target[torch.tensor(ignored[:num_rows], device=device)] = IGNORE_INDEX
    ours, expected = run_both(logits, target)
    assert_matches(ours, expected)
    ignored_rows = target == IGNORE_INDEX
    assert torch.all(ours[0][ignored_rows] == 0)
    assert torch.all(ours[1][ignored_rows] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_forward_then_backward_with_unit_gradient(device, dtype) -> None:
    # The production launch (one masked block of 512 for 300 classes), against the two kernels it fuses.
    logits, target, _ = make_rows(3, 300, dtype, 0, device)
    target[1] = IGNORE_INDEX
    losses, lse = triton_ops.cross_entropy_forward(logits, target, IGNORE_INDEX)
    grad = triton_ops.cross_entropy_backward(torch.ones_like(losses), logits, target, lse, IGNORE_INDEX)
    overwritten = logits.clone()
    fused = triton_ops.cross_entropy_forward_with_grad(overwritten, target, IGNORE_INDEX)
    assert torch.equal(fused, losses)
    assert torch.equal(overwritten, grad)


def test_out_of_range_target_gives_a_nan_row(device) -> None:
    logits, _, _ = make_rows(5, 17, torch.float16, 1, device)
    # Past the end, negative, far past the end, a valid one, and a valid class used as ignore_index.
    target = torch.tensor([17, -1, 10**9, 3, 0], device=device)
    ours, expected = run_both(logits, target, ignore_index=0)
    assert_matches(ours, expected)
    losses, grad = ours
    assert losses[:3].isnan().all() and grad[:3].isnan().all()
    assert losses[3].isfinite() and grad[3].isfinite().all()
    assert losses[4] == 0 and torch.all(grad[4] == 0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on -inf - -inf
def test_non_finite_logits(device) -> None:
    logits, target, _ = make_rows(3, 20, torch.bfloat16, 2, device)
    logits[0, 3] = float("-inf")  # a masked-out class: finite loss, zero gradient there
    target[0] = 4
    logits[1, 7] = float("nan")  # an ignored row: loss and gradient exactly 0 whatever it holds
    target[1] = IGNORE_INDEX
    logits[2, 0:17] = float("-inf")  # the first block is all -inf
    target[2] = 18
    ours, expected = run_both(logits, target)
    assert_matches(ours, expected)
    losses, grad = ours
    assert losses[0].isfinite() and grad[0, 3] == 0
    assert losses[1] == 0 and torch.all(grad[1] == 0)
    assert losses[2].isfinite() and grad[2].isfinite().all()


def test_strided_target(device) -> None:
    logits, target, _ = make_rows(3, 40, torch.float16, 3, device)
    strided = torch.stack([target, target], dim=1)[:, 0]  # stride 2
    ours, expected = run_both(logits, strided)
    assert_matches(ours, expected)
    dense, _ = run_both(logits, target.contiguous())
    assert torch.equal(ours[0], dense[0]) and torch.equal(ours[1], dense[1])


def test_no_rows(device) -> None:
    logits = torch.zeros(0, 7, dtype=torch.float16, device=device)
    target = torch.zeros(0, dtype=torch.int64, device=device)
    losses = triton_ops.cross_entropy_forward_with_grad(logits, target, IGNORE_INDEX)
    assert losses.shape == (0,) and losses.dtype == torch.float32


def test_non_contiguous_logits_raise_before_writing() -> None:
    logits, target, _ = make_rows(3, 40, torch.float16, 4, "cpu")
    view = logits[:, :17]
    before = logits.clone()
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match="logits.contiguous"):
            implementation.cross_entropy_forward_with_grad(view, target, IGNORE_INDEX)
        with pytest.raises(ValueError, match="target.long"):
            implementation.cross_entropy_forward_with_grad(logits, target.int(), IGNORE_INDEX)
    assert torch.equal(logits, before)


@given(
    dtype=st.sampled_from(DTYPES),
    num_rows=st.integers(1, 5),
    num_classes=st.sampled_from(NUM_CLASSES),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_float64(dtype, num_rows, num_classes, seed) -> None:
    logits, target, _ = make_rows(num_rows, num_classes, dtype, seed, "cpu")
    target[0] = IGNORE_INDEX
    x = logits.double()
    losses = reference.cross_entropy_forward_with_grad(logits, target, IGNORE_INDEX)

    log_probs = torch.log_softmax(x, dim=1)
    valid = target != IGNORE_INDEX
    safe_target = torch.where(valid, target, 0)
    expected_losses = torch.where(valid, -log_probs.gather(1, safe_target[:, None])[:, 0], 0.0)
    onehot = torch.nn.functional.one_hot(safe_target, num_classes).double()
    expected_grad = (log_probs.exp() - onehot) * valid[:, None]
    assert_losses_close(losses, expected_losses)
    assert_rounded_once_close(logits, expected_grad.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpt_sized_rows_on_gpu(dtype) -> None:
    logits, target, _ = make_rows(16, 50304, dtype, 4, "cuda")
    target[5] = IGNORE_INDEX
    ours, expected = run_both(logits, target)
    assert_matches(ours, expected)


@pytest.mark.gpu
def test_losses_of_the_default_launch_over_many_rows() -> None:
    # Every warp of a row reads the target's logit for the loss and one of them overwrites it with
    # its gradient. Without a barrier in between, about 2 rows in a million got the gradient's value
    # in their loss on an H200 (32000 classes, kernel as at 2c6b620); 200 x 16384 rows catch that
    # almost surely, in about a second.
    generator = torch.Generator("cuda").manual_seed(7)
    logits = (3 * torch.randn(16384, 32000, device="cuda", generator=generator)).half()
    target = torch.randint(0, 32000, (16384,), device="cuda", generator=generator)
    target[::7] = IGNORE_INDEX
    expected, _ = triton_ops.cross_entropy_forward(logits, target, IGNORE_INDEX)
    overwritten = torch.empty_like(logits)
    for _ in range(200):
        overwritten.copy_(logits)
        losses = triton_ops.cross_entropy_forward_with_grad(overwritten, target, IGNORE_INDEX)
        assert_losses_close(losses, expected)
