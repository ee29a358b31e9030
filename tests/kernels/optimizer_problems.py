"""What the optimizer kernels' tests share: random problems (params, grads, masters, states), the
small launch configuration that crosses block and chunk boundaries with a few dozen elements, and
the comparisons of the Triton kernels with the reference.

On CPU the kernels run under TRITON_INTERPRET=1 (set by `make test`); the same checks run on CUDA
when marked `gpu`. Sizes stay small because the interpreter is slow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from hypothesis import strategies as st

from amp_fx.kernels.adam import triton as adam_triton
from amp_fx.kernels.overflow_check import triton as overflow_check_triton
from amp_fx.kernels.pointer_table import LaunchConfig
from amp_fx.kernels.sgd import triton as sgd_triton
from amp_fx.testing import tolerances

KERNEL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]
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


def fp32_problem(seed: int, shapes=((3, 5), (7,), (1,))) -> tuple[list, list]:
    """fp32 params and five steps of grads, for comparing the reference with torch.optim."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in shapes]
    grads_per_step = [[torch.randn(s, generator=generator) for s in shapes] for _ in range(5)]
    return params, grads_per_step
