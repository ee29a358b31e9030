"""What every optimizer kernel shares (``amp_fx.kernels.optimizer_step`` and the launch rules): an
overflow skips everything, bit for bit; one launch per dtype group, whatever the number of tensors;
bad input refused alike, before any write; the production launch configuration; and on a GPU, a
step that never syncs with the host and replays in a CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import optimizer_step, reference, triton_ops
from amp_fx.kernels.adam import triton as adam_triton
from amp_fx.kernels.overflow_check import triton as overflow_check_triton
from amp_fx.kernels.sgd import triton as sgd_triton
from tests.kernels.optimizer_problems import (
    KERNEL_DTYPES,
    SMALL,
    all_tensors,
    assert_bit_identical,
    assert_matches_reference,
    bits,
    clone_problem,
    launch_config,
    make_problem,
    scalar,
    sgd_arguments,
    sizes_strategy,
)


@given(
    sizes=sizes_strategy,
    data=st.data(),
    bad_value=st.sampled_from([math.inf, -math.inf, math.nan]),
    optimizer=st.sampled_from(["adam", "sgd"]),
    seed=st.integers(0, 2**16),
)
def test_overflow_skips_everything(device, sizes, data, bad_value, optimizer, seed) -> None:
    dtypes = data.draw(st.lists(st.sampled_from(KERNEL_DTYPES), min_size=len(sizes), max_size=len(sizes)))
    states = ("exp_avgs", "exp_avg_sqs") if optimizer == "adam" else ("momentum_buffers",)
    problem = make_problem(sizes, dtypes, device, seed, states)
    # One bad element at a random place; the last element of the last tensor half of the time.
    if data.draw(st.booleans()):
        tensor_index, element = len(sizes) - 1, sizes[-1] - 1
    else:
        tensor_index = data.draw(st.integers(0, len(sizes) - 1))
        element = data.draw(st.integers(0, sizes[tensor_index] - 1))
    problem["grads"][tensor_index][element] = bad_value
    found_inf, sq_norm, step = scalar(0.0, device), scalar(0.0, device), scalar(3.0, device)
    before = [t.clone() for t in all_tensors(problem)] + [step.clone()]
    with launch_config(SMALL):
        triton_ops.check_finite_and_norm_(problem["grads"], found_inf, sq_norm_out=sq_norm)
        assert found_inf.item() == 1.0
        if optimizer == "adam":
            triton_ops.adam_step_(
                *problem.values(),
                step,
                lr=0.1,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.1,
                adam_w_mode=True,
                found_inf=found_inf,
            )
        else:
            triton_ops.sgd_step_(
                *sgd_arguments(problem),
                step,
                lr=0.1,
                momentum=0.9,
                dampening=0.0,
                weight_decay=0.1,
                nesterov=True,
                found_inf=found_inf,
            )
        triton_ops.advance_step_(step, found_inf)
    assert_bit_identical(before, all_tensors(problem) + [step])
    assert not math.isfinite(sq_norm.item())
    assert all(torch.isfinite(m).all() for m in problem["masters"] if m is not None)


def test_production_configuration_across_block_and_chunk_boundaries(device) -> None:
    block, chunk = adam_triton.LAUNCH.block_size, adam_triton.LAUNCH.chunk_size
    sizes = [1, block - 1, block + 1, chunk + 1]
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float16]
    for optimizer, states in (("adam", ("exp_avgs", "exp_avg_sqs")), ("sgd", ("momentum_buffers",))):
        ours = make_problem(sizes, dtypes, device, 0, states)
        expected = clone_problem(ours)
        found_inf, sq_norm, step = scalar(0.0, device), scalar(0.0, device), scalar(1.0, device)
        triton_ops.check_finite_and_norm_(ours["grads"], found_inf, sq_norm_out=sq_norm)
        if optimizer == "adam":
            kwargs = dict(
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                adam_w_mode=True,
                found_inf=found_inf,
            )
            triton_ops.adam_step_(*ours.values(), step, **kwargs)
            reference.adam_step_(*expected.values(), step, **kwargs)
        else:
            kwargs = dict(
                lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False, found_inf=found_inf
            )
            triton_ops.sgd_step_(*sgd_arguments(ours), step, **kwargs)
            reference.sgd_step_(*sgd_arguments(expected), step, **kwargs)
        assert found_inf.item() == 0.0
        expected_norm = sum(float(g.double().square().sum()) for g in ours["grads"])
        assert sq_norm.item() == pytest.approx(expected_norm, rel=1e-5)
        assert_matches_reference(ours, expected)


class CountingLauncher:
    """Stands in for a @triton.jit kernel and counts `kernel[grid](...)` launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("num_tensors", [1, 3, 16])
def test_launch_count_does_not_grow_with_tensor_count(device, num_tensors, monkeypatch) -> None:
    launchers = {}
    for module, name in (
        (adam_triton, "_adam_kernel"),
        (sgd_triton, "_sgd_kernel"),
        (overflow_check_triton, "_check_finite_and_norm_kernel"),
    ):
        launchers[name] = CountingLauncher(getattr(module, name))
        monkeypatch.setattr(module, name, launchers[name])
    sizes = [1 + i % 5 for i in range(num_tensors)]
    for dtypes, expected_launches in (
        ([torch.float16] * num_tensors, 1),
        ([(torch.float16, torch.bfloat16)[i % 2] for i in range(num_tensors)], min(2, num_tensors)),
    ):
        for launcher in launchers.values():
            launcher.launches = 0
        adam_problem = make_problem(sizes, dtypes, device, 0, ("exp_avgs", "exp_avg_sqs"))
        sgd_problem = make_problem(sizes, dtypes, device, 0, ("momentum_buffers",))
        found_inf, step = scalar(0.0, device), scalar(0.0, device)
        with launch_config(SMALL):
            triton_ops.check_finite_and_norm_(
                adam_problem["grads"], found_inf, sq_norm_out=scalar(0.0, device)
            )
            triton_ops.adam_step_(
                *adam_problem.values(),
                step,
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.0,
                adam_w_mode=True,
                found_inf=found_inf,
            )
            triton_ops.sgd_step_(
                *sgd_arguments(sgd_problem),
                step,
                lr=1e-3,
                momentum=0.9,
                dampening=0.0,
                weight_decay=0.0,
                nesterov=False,
                found_inf=found_inf,
            )
        assert {name: launcher.launches for name, launcher in launchers.items()} == {
            name: expected_launches for name in launchers
        }


def test_bad_input_is_refused_like_the_reference(device) -> None:
    p = torch.ones(3, device=device)
    for implementation in (reference, triton_ops):
        with pytest.raises(ValueError, match="masters\\[0\\] has dtype"):
            implementation.adam_step_(
                [p.half()],
                [p.half()],
                [p.half()],
                [p],
                [p],
                scalar(0.0, device),
                lr=0.1,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.0,
                adam_w_mode=True,
            )
        with pytest.raises(ValueError, match="not dense"):
            implementation.check_finite_and_norm_(
                [torch.ones(4, 4, device=device)[:, ::2]], scalar(0.0, device)
            )


# On a CPU the reference reads the flag and returns before any write; on a GPU it keeps the bits
# with torch.where, never reading the flag on the host (`optimizer_step.skip_flag`).
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_skip_leaves_everything_bit_identical(device: str) -> None:
    torch.manual_seed(0)
    params = [torch.randn(4).half(), torch.randn(3).half()]
    masters = [
        p.float() + 1e-4 for p in params
    ]  # masters that do not round to the params: a write would show
    grads = [torch.randn(4).half(), torch.tensor([1.0, float("nan"), 2.0]).half()]
    exp_avgs = [torch.randn(4), torch.randn(3)]
    exp_avg_sqs = [torch.rand(4), torch.rand(3)]
    params, masters, grads, exp_avgs, exp_avg_sqs = (
        [t.to(device) for t in tensors] for tensors in (params, masters, grads, exp_avgs, exp_avg_sqs)
    )
    step = torch.full((1,), 3.0, device=device)
    found_inf = torch.zeros(1, device=device)
    reference.check_finite_and_norm_(grads, found_inf)
    assert found_inf.item() == 1.0
    before = [t.clone() for t in [*params, *masters, *exp_avgs, *exp_avg_sqs, step]]
    reference.adam_step_(
        params,
        grads,
        masters,
        exp_avgs,
        exp_avg_sqs,
        step,
        lr=0.1,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.01,
        adam_w_mode=True,
        found_inf=found_inf,
    )
    reference.advance_step_(step, found_inf)
    after = [*params, *masters, *exp_avgs, *exp_avg_sqs, step]
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8))


def test_a_skip_flag_on_a_device_keeps_bits_with_where() -> None:
    # What the reference does with a flag it does not read (on a GPU), run here with the flag a
    # tensor: working copies apart from the originals, and no write where the flag is set.
    targets = [torch.randn(3).half(), torch.randn(2)]
    before = [t.clone() for t in targets]
    for skip, expected in ((torch.tensor(True), before), (torch.tensor(False), None)):
        work = optimizer_step.working_copies(targets, skip)
        assert all(w is not t and w.dtype == torch.float32 for w, t in zip(work, targets, strict=True))
        torch._foreach_add_(work, 1.0)
        optimizer_step.write_unless_skipped(targets, work, skip)
        expected = expected or [(b.float() + 1.0).to(b.dtype) for b in before]
        for target, value in zip(targets, expected, strict=True):
            assert torch.equal(target.view(torch.uint8), value.view(torch.uint8))


def test_bad_input_is_refused_before_any_write() -> None:
    p = torch.ones(3)
    with pytest.raises(ValueError, match="grads\\[0\\] has shape"):
        reference.adam_step_(
            [p],
            [torch.ones(4)],
            None,
            [torch.zeros(3)],
            [torch.zeros(3)],
            torch.zeros(1),
            lr=0.1,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adam_w_mode=True,
        )
    with pytest.raises(ValueError, match="beta2"):
        reference.adam_step_(
            [p],
            [p.clone()],
            None,
            [torch.zeros(3)],
            [torch.zeros(3)],
            torch.zeros(1),
            lr=0.1,
            beta1=0.9,
            beta2=1.0,
            eps=1e-8,
            weight_decay=0.0,
            adam_w_mode=True,
        )
    with pytest.raises(ValueError, match="momentum_buffers"):
        reference.sgd_step_(
            [p],
            [p.clone()],
            None,
            None,
            torch.zeros(1),
            lr=0.1,
            momentum=0.9,
            dampening=0.0,
            weight_decay=0.0,
            nesterov=False,
        )
    with pytest.raises(ValueError, match="float32 tensor of one element"):
        reference.check_finite_and_norm_([p], torch.zeros(1, dtype=torch.float64))
    assert torch.equal(p, torch.ones(3))


def _o2_adam_step(problem: dict[str, list], step, found_inf, sq_norm, grad_multiplier) -> None:
    """One O2 step as the optimizers run it: check (+ norm), update, advance; all on the device."""
    found_inf.zero_()
    sq_norm.zero_()
    triton_ops.check_finite_and_norm_(
        problem["grads"], found_inf, grad_multiplier=grad_multiplier, sq_norm_out=sq_norm
    )
    hyperparameters = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adam_w_mode=True)
    triton_ops.adam_step_(
        *problem.values(), step, grad_multiplier=grad_multiplier, found_inf=found_inf, **hyperparameters
    )
    triton_ops.advance_step_(step, found_inf)


@pytest.mark.gpu
def test_step_never_syncs_with_the_host() -> None:
    problem = make_problem([3000, 17, 1], [torch.float16, torch.bfloat16, torch.float32], "cuda", 0,
                           ("exp_avgs", "exp_avg_sqs"))  # fmt: skip
    step, found_inf, sq_norm, multiplier = (scalar(v, "cuda") for v in (0.0, 0.0, 0.0, 0.5))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # the first builds and uploads the tables, the second reuses them
            _o2_adam_step(problem, step, found_inf, sq_norm, multiplier)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.item() == 2.0


@pytest.mark.gpu
def test_step_replays_in_a_cuda_graph() -> None:
    shapes_dtypes = ([3000, 17, 1], [torch.float16, torch.bfloat16, torch.float32])
    graphed = make_problem(*shapes_dtypes, "cuda", 0, ("exp_avgs", "exp_avg_sqs"))
    eager = clone_problem(graphed)
    # (step, found_inf, sq_norm, grad_multiplier) for the graphed and the eager run
    scalars = [[scalar(v, "cuda") for v in (0.0, 0.0, 0.0, 0.5)] for _ in range(2)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph: compiles kernels, caches tables
        _o2_adam_step(graphed, *scalars[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _o2_adam_step(graphed, *scalars[0])
    graph.replay()
    graph.replay()
    for _ in range(3):
        _o2_adam_step(eager, *scalars[1])
    for mine, theirs in zip(all_tensors(graphed), all_tensors(eager), strict=True):
        assert torch.equal(bits(mine), bits(theirs))
    assert scalars[0][0].item() == scalars[1][0].item() == 3.0
    assert scalars[0][2].item() == scalars[1][2].item() > 0.0
