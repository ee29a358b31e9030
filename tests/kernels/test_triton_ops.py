"""The Triton kernels against the pure-torch reference (amp_fx.kernels.reference).

On CPU the kernels run under TRITON_INTERPRET=1 (set by `make test`); the same checks run on CUDA
when marked `gpu`. Sizes stay small because the interpreter is slow; most examples use a small
launch configuration (block 16, chunk 32) so that block and chunk boundaries are crossed with a few
dozen elements, and one test uses the production configuration.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.kernels.adam import triton as adam_triton
from amp_fx.kernels.overflow_check import triton as overflow_check_triton
from amp_fx.kernels.pointer_table import LaunchConfig
from amp_fx.kernels.sgd import triton as sgd_triton
from amp_fx.testing import tolerances

PARAM_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SMALL = LaunchConfig(block_size=16, chunk_size=32, num_warps=1)
# Sizes around the small configuration's block (16) and chunk (32) boundaries.
SMALL_SIZES = [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 47, 64, 65]


@contextlib.contextmanager
def launch_config(config: LaunchConfig | None) -> Iterator[None]:
    """Run all three kernels with `config` (None: their production configuration)."""
    modules = (adam_triton, sgd_triton, overflow_check_triton)
    saved = [m.LAUNCH for m in modules]
    try:
        for m in modules:
            m.LAUNCH = config or m.LAUNCH
        yield
    finally:
        for m, launch in zip(modules, saved, strict=True):
            m.LAUNCH = launch


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def assert_bit_identical(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        assert torch.equal(bits(old), bits(new)), f"tensor {i} changed"


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Triton vs reference. Both compute in fp32 and differ only in operation order and FMA
    contraction: fp32 results within amp_fx.testing's fp32 tolerance; a param updated without a
    master is that fp32 result rounded by both sides, so within one unit in the last place."""
    if actual.dtype == torch.float32:
        rtol, atol = tolerances(torch.float32)
    else:
        rtol, atol = torch.finfo(actual.dtype).eps, 1e-5
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def make_problem(
    sizes: list[int],
    dtypes: list[torch.dtype],
    device: str,
    seed: int,
    state_names: tuple[str, ...],
    with_masters: bool = True,
) -> dict[str, list]:
    """Random params/grads/masters/states; low-precision params get fp32 masters, fp32 params none."""
    generator = torch.Generator().manual_seed(seed)

    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, generator=generator)

    params = [randn(n).to(dtype) for n, dtype in zip(sizes, dtypes, strict=True)]
    problem = {
        "params": params,
        "grads": [randn(n).to(dtype) for n, dtype in zip(sizes, dtypes, strict=True)],
        # Masters a little off their params, so that a missed master write or a param written from
        # the wrong source shows.
        "masters": [
            (p.float() + 1e-3 * randn(p.numel())) if with_masters and p.dtype != torch.float32 else None
            for p in params
        ],
    }
    for name in state_names:
        problem[name] = [randn(n).abs() if name == "exp_avg_sqs" else randn(n) for n in sizes]
    return {k: [None if t is None else t.to(device) for t in v] for k, v in problem.items()}


def clone_problem(problem: dict[str, list]) -> dict[str, list]:
    return {k: [None if t is None else t.clone() for t in v] for k, v in problem.items()}


def all_tensors(problem: dict[str, list]) -> list[torch.Tensor]:
    return [t for v in problem.values() for t in v if t is not None]


def assert_matches_reference(ours: dict[str, list], expected: dict[str, list]) -> None:
    for name in ours:
        if name in ("params", "grads"):
            continue
        for mine, theirs in zip(ours[name], expected[name], strict=True):
            if mine is not None:
                assert_close(mine, theirs)
    for param, master, theirs in zip(ours["params"], ours["masters"], expected["params"], strict=True):
        if master is not None:
            # The low-precision param is exactly its master rounded to nearest.
            assert torch.equal(bits(param), bits(master.to(param.dtype)))
        else:
            assert_close(param, theirs)
    assert_bit_identical(ours["grads"], expected["grads"])


sizes_strategy = st.lists(st.sampled_from(SMALL_SIZES), min_size=1, max_size=5)
multiplier_strategy = st.one_of(st.none(), st.floats(1e-5, 2.0))
step_strategy = st.sampled_from([0.0, 1.0, 6.0, 999.0])


def sgd_arguments(problem: dict[str, list]) -> list:
    return [problem["params"], problem["grads"], problem["masters"], problem.get("momentum_buffers")]


def scalar(value: float, device: str) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


@given(
    sizes=sizes_strategy,
    data=st.data(),
    lr=st.floats(1e-4, 1e-1),
    beta1=st.sampled_from([0.0, 0.5, 0.9]),
    beta2=st.sampled_from([0.9, 0.999]),
    eps=st.sampled_from([1e-8, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    adam_w_mode=st.booleans(),
    multiplier=multiplier_strategy,
    step_value=step_strategy,
    with_found_inf=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adam_matches_reference(
    device,
    sizes,
    data,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    adam_w_mode,
    multiplier,
    step_value,
    with_found_inf,
    seed,
) -> None:
    dtypes = data.draw(st.lists(st.sampled_from(PARAM_DTYPES), min_size=len(sizes), max_size=len(sizes)))
    with_masters = data.draw(st.booleans())
    ours = make_problem(sizes, dtypes, device, seed, ("exp_avgs", "exp_avg_sqs"), with_masters)
    expected = clone_problem(ours)
    kwargs = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adam_w_mode=adam_w_mode,
        grad_multiplier=None if multiplier is None else scalar(multiplier, device),
        found_inf=scalar(0.0, device) if with_found_inf else None,
    )
    step = scalar(step_value, device)
    with launch_config(SMALL):
        triton_ops.adam_step_(*ours.values(), step, **kwargs)
    reference.adam_step_(*expected.values(), step, **kwargs)
    assert_matches_reference(ours, expected)
    assert step.item() == step_value


@given(
    sizes=sizes_strategy,
    data=st.data(),
    lr=st.floats(1e-4, 1e-1),
    momentum_setting=st.sampled_from(
        [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.0, True), (0.5, 0.3, False)]
    ),
    weight_decay=st.sampled_from([0.0, 0.01]),
    multiplier=multiplier_strategy,
    step_value=step_strategy,
    seed=st.integers(0, 2**16),
)
def test_sgd_matches_reference(
    device, sizes, data, lr, momentum_setting, weight_decay, multiplier, step_value, seed
) -> None:
    momentum, dampening, nesterov = momentum_setting
    dtypes = data.draw(st.lists(st.sampled_from(PARAM_DTYPES), min_size=len(sizes), max_size=len(sizes)))
    # Without momentum the buffers may be left out (None).
    states = () if momentum == 0.0 and data.draw(st.booleans()) else ("momentum_buffers",)
    ours = make_problem(sizes, dtypes, device, seed, states, data.draw(st.booleans()))
    expected = clone_problem(ours)
    kwargs = dict(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        grad_multiplier=None if multiplier is None else scalar(multiplier, device),
        found_inf=scalar(0.0, device),
    )
    step = scalar(step_value, device)
    with launch_config(SMALL):
        triton_ops.sgd_step_(*sgd_arguments(ours), step, **kwargs)
    reference.sgd_step_(*sgd_arguments(expected), step, **kwargs)
    assert_matches_reference(ours, expected)


@given(
    sizes=sizes_strategy,
    dtype=st.sampled_from(PARAM_DTYPES),
    multiplier=multiplier_strategy,
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_squared_norm_matches_float64(device, sizes, dtype, multiplier, scale, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    grads = [(scale * torch.randn(n, generator=generator)).to(dtype).to(device) for n in sizes]
    found_inf = scalar(0.0, device)
    sq_norm = scalar(0.5, device)  # accumulates onto what is there
    grad_multiplier = None if multiplier is None else scalar(multiplier, device)
    with launch_config(SMALL):
        triton_ops.check_finite_and_norm_(
            grads, found_inf, grad_multiplier=grad_multiplier, sq_norm_out=sq_norm
        )
    factor = 1.0 if multiplier is None else float(torch.tensor(multiplier, dtype=torch.float32))
    expected = 0.5 + sum(float((g.double() * factor).square().sum()) for g in grads)
    assert found_inf.item() == 0.0
    assert sq_norm.item() == pytest.approx(expected, rel=1e-5)


@given(
    sizes=sizes_strategy,
    data=st.data(),
    bad_value=st.sampled_from([math.inf, -math.inf, math.nan]),
    optimizer=st.sampled_from(["adam", "sgd"]),
    seed=st.integers(0, 2**16),
)
def test_overflow_skips_everything(device, sizes, data, bad_value, optimizer, seed) -> None:
    dtypes = data.draw(st.lists(st.sampled_from(PARAM_DTYPES), min_size=len(sizes), max_size=len(sizes)))
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


def test_found_inf_is_never_cleared(device) -> None:
    found_inf = scalar(1.0, device)
    triton_ops.check_finite_and_norm_([torch.ones(5, device=device)], found_inf)
    assert found_inf.item() == 1.0


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


def test_unaligned_views_are_updated_correctly(device) -> None:
    """Tensors at odd offsets: the table is marked unaligned and the kernels must not assume 16 bytes."""
    storage = torch.randn(4, 70, device=device)
    params = [storage[0, 1:40].half(), storage[1, 3:].clone()[2:]]  # the second: fp32 view at an odd offset
    ours = {
        "params": params,
        "grads": [torch.randn(70, device=device).half()[1:40], torch.randn(70, device=device)[5:]],
        "masters": [params[0].float(), None],
        "exp_avgs": [torch.zeros(70, device=device)[1:40], torch.zeros(70, device=device)[5:]],
        "exp_avg_sqs": [torch.zeros(70, device=device)[1:40], torch.zeros(70, device=device)[5:]],
    }
    expected = clone_problem(ours)
    kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adam_w_mode=True)
    triton_ops.adam_step_(*ours.values(), scalar(0.0, device), **kwargs)
    reference.adam_step_(*expected.values(), scalar(0.0, device), **kwargs)
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
