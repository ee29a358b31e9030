"""The activation kernels: Triton against the pure-torch reference (one rounding apart at most),
both against float64 and against what torch.autocast computes, forward and backward.

On CPU the Triton kernels run under TRITON_INTERPRET=1; the same checks run on CUDA when marked
`gpu`. Sizes are odd and small; a small launch configuration makes them span several programs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference, triton_ops
from amp_fx.kernels.activations import ACTIVATIONS
from amp_fx.kernels.activations import triton as activations_triton
from amp_fx.kernels.activations.triton import ActivationLaunch
from amp_fx.testing import normwise_error, rounding_tolerances

LOW_DTYPES = [torch.float16, torch.bfloat16]
SMALL = ActivationLaunch(block_elements=64, num_warps=1)


@contextlib.contextmanager
def launch_config(config: ActivationLaunch) -> Iterator[None]:
    saved = activations_triton.LAUNCH
    activations_triton.LAUNCH = config
    try:
        yield
    finally:
        activations_triton.LAUNCH = saved


def make(shape: tuple[int, int], dtype: torch.dtype, seed: int, device: str = "cpu", scale: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)


def act64(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation of float64 ``x``, from its formula (the contract's math)."""
    if activation == "silu":
        return x * torch.sigmoid(x)
    if activation == "gelu":
        return 0.5 * x * (1 + torch.erf(x / 2**0.5))
    return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))


def exact(gate, up, grad_out, activation):
    """(out, grad_gate, grad_up) in float64 by autograd of the formula; up None: the lone activation."""
    g = gate.double().requires_grad_()
    u = up.double().requires_grad_() if up is not None else None
    out = act64(g, activation) * (u if u is not None else 1)
    out.backward(grad_out.double())
    return out.detach(), g.grad, (u.grad if u is not None else None)


def assert_rounding_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *factors: torch.Tensor
) -> None:
    """Within one rounding to ``dtype`` of ``expected``, element-wise, plus fp32's absolute error
    on the largest product of the ``factors`` (the inputs): GELU's ``1 + erf(x)`` cancels in its
    tail, where fp32 keeps an absolute error of its unit roundoff, times x, up and the gradient."""
    rtol, atol = rounding_tolerances(dtype)
    magnitude = 1.0
    for factor in factors:
        magnitude *= 1.0 + factor.abs().amax().item()
    torch.testing.assert_close(
        actual.double(), expected.double().to(actual.device), rtol=rtol, atol=max(atol, 2**-22 * magnitude)
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [*LOW_DTYPES, torch.float32])
def test_triton_matches_reference(device, activation, dtype) -> None:
    gate, up, grad = (make((13, 37), dtype, seed, device) for seed in (1, 2, 3))
    with launch_config(SMALL):
        out = triton_ops.gated_activation_forward(gate, up, activation)
        grads = triton_ops.gated_activation_backward(grad, gate, up, activation)
        lone = triton_ops.activation_forward(gate, activation)
        lone_grad = triton_ops.activation_backward(grad, gate, activation)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == gate.shape
    assert_rounding_close(
        out, reference.gated_activation_forward(gate, up, activation), dtype, gate, up, grad
    )
    for actual, expected in zip(
        grads, reference.gated_activation_backward(grad, gate, up, activation), strict=True
    ):
        assert actual.dtype == dtype and actual.is_contiguous()
        assert_rounding_close(actual, expected, dtype, gate, up, grad)
    assert_rounding_close(lone, reference.activation_forward(gate, activation), dtype, gate, up, grad)
    assert_rounding_close(
        lone_grad, reference.activation_backward(grad, gate, activation), dtype, gate, up, grad
    )


@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_one_rounding_from_float64(device, implementation, activation, dtype) -> None:
    """Every output is float64's exact value rounded once (to within fp32's own error)."""
    kernels = reference if implementation == "reference" else triton_ops
    gate, up, grad = (make((5, 67), dtype, seed, device) for seed in (4, 5, 6))
    out, grad_gate, grad_up = exact(gate, up, grad, activation)
    with launch_config(SMALL):
        assert_rounding_close(
            kernels.gated_activation_forward(gate, up, activation), out, dtype, gate, up, grad
        )
        actual_gate, actual_up = kernels.gated_activation_backward(grad, gate, up, activation)
        assert_rounding_close(actual_gate, grad_gate, dtype, gate, up, grad)
        assert_rounding_close(actual_up, grad_up, dtype, gate, up, grad)
        lone, lone_grad, _ = exact(gate, None, grad, activation)
        assert_rounding_close(kernels.activation_forward(gate, activation), lone, dtype, gate, up, grad)
        assert_rounding_close(
            kernels.activation_backward(grad, gate, activation), lone_grad, dtype, gate, up, grad
        )


def _autocast_gated(gate, up, grad_out, activation):
    """What torch.autocast computes for the unfused chain: the activation and the product each
    rounded to the low dtype, and their backward likewise."""
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    with torch.autocast(gate.device.type, dtype=gate.dtype):
        act = F.silu(g) if activation == "silu" else F.gelu(g, approximate=approximate)
        out = act * u
    out.backward(grad_out)
    return out.detach(), g.grad, u.grad


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_at_least_as_accurate_as_autocast(device, activation, dtype) -> None:
    """Norm-wise against float64, the fused results are never worse than autocast's unfused chain
    (one rounding where autocast has two), up to a tenth of a unit roundoff."""
    gate, up, grad = (make((7, 129), dtype, seed, device) for seed in (7, 8, 9))
    exact_results = exact(gate, up, grad, activation)
    autocast_results = _autocast_gated(gate.cpu(), up.cpu(), grad.cpu(), activation)
    with launch_config(SMALL):
        fused = (
            triton_ops.gated_activation_forward(gate, up, activation),
            *triton_ops.gated_activation_backward(grad, gate, up, activation),
        )
    slack = torch.finfo(dtype).eps / 10
    for ours, theirs, truth in zip(fused, autocast_results, exact_results, strict=True):
        truth = truth.cpu()
        assert normwise_error(ours.cpu(), truth) <= normwise_error(theirs, truth) + slack


def test_strided_inputs_are_read_in_place(device) -> None:
    """Two halves of one projection (``chunk`` along the last dimension) and a transposed gradient
    give what their contiguous copies give."""
    both = make((9, 2 * 23), torch.bfloat16, 10, device)
    gate, up = both.chunk(2, dim=-1)
    grad = make((23, 9), torch.bfloat16, 11, device).t()
    assert not gate.is_contiguous() and not grad.is_contiguous()
    with launch_config(SMALL):
        out = triton_ops.gated_activation_forward(gate, up, "silu")
        grads = triton_ops.gated_activation_backward(grad, gate, up, "silu")
        expected = triton_ops.gated_activation_forward(gate.contiguous(), up.contiguous(), "silu")
        expected_grads = triton_ops.gated_activation_backward(
            grad.contiguous(), gate.contiguous(), up.contiguous(), "silu"
        )
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


def test_empty_and_single_column(device) -> None:
    empty = torch.empty(0, 5, dtype=torch.float16, device=device)
    assert triton_ops.gated_activation_forward(empty, empty, "gelu").shape == (0, 5)
    column = make((6, 1), torch.float16, 12, device)
    assert_rounding_close(
        triton_ops.activation_forward(column, "gelu_tanh"),
        reference.activation_forward(column, "gelu_tanh"),
        torch.float16,
        column,
    )


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_bad_arguments_are_refused_with_the_fix(implementation) -> None:
    kernels = reference if implementation == "reference" else triton_ops
    x = torch.ones(2, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match="not one of silu, gelu, gelu_tanh"):
        kernels.activation_forward(x, "relu")
    with pytest.raises(ValueError, match="no broadcasting"):
        kernels.gated_activation_forward(x, x[:, :1], "silu")
    with pytest.raises(ValueError, match=r"flatten\(0, -2\)"):
        kernels.activation_forward(x.view(2, 3, 1), "silu")
    with pytest.raises(ValueError, match="supported dtypes"):
        kernels.activation_forward(x.double(), "silu")


@given(
    rows=st.integers(1, 9),
    columns=st.integers(1, 70),
    activation=st.sampled_from(ACTIVATIONS),
    dtype=st.sampled_from(LOW_DTYPES),
    scale=st.sampled_from([0.1, 1.0, 8.0]),
    seed=st.integers(0, 2**16),
)
def test_any_shape_matches_reference(device, rows, columns, activation, dtype, scale, seed) -> None:
    gate, up, grad = (make((rows, columns), dtype, seed + i, device, scale) for i in range(3))
    with launch_config(SMALL):
        out = triton_ops.gated_activation_forward(gate, up, activation)
        grads = triton_ops.gated_activation_backward(grad, gate, up, activation)
    assert_rounding_close(
        out, reference.gated_activation_forward(gate, up, activation), dtype, gate, up, grad
    )
    for actual, expected in zip(
        grads, reference.gated_activation_backward(grad, gate, up, activation), strict=True
    ):
        assert_rounding_close(actual, expected, dtype, gate, up, grad)


@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("gated", [False, True], ids=["alone", "gated"])
@pytest.mark.parametrize("dtype", [*LOW_DTYPES, torch.float32])
def test_the_forward_records_what_record_range_records(device, implementation, gated, dtype) -> None:
    # amp_fx.watch asks the kernel for the range statistics of the output it writes: the same as
    # record_range_ of it (the range_stats reference), the output unchanged. Tiles of several
    # programs; an overflowing product, a NaN and underflowing values among them.
    if implementation == "triton" and triton_ops is None:
        pytest.skip("needs Triton")
    kernels = reference if implementation == "reference" else triton_ops
    gate = make((37, 50), dtype, seed=3, device=device, scale=30.0)
    up = make((37, 50), dtype, seed=4, device=device, scale=1e-3)
    up[0, :3] = torch.finfo(dtype).max
    gate[2, 5] = float("nan")
    amax, counts = torch.full((3,), 0.5, device=device), torch.arange(9, device=device)
    expected = (amax.clone(), counts.clone())
    with launch_config(SMALL):
        if gated:
            out = kernels.gated_activation_forward(gate, up, "silu", (amax, counts, (2,)))
            unrecorded = kernels.gated_activation_forward(gate, up, "silu")
        else:
            out = kernels.activation_forward(gate, "gelu_tanh", (amax, counts, (2,)))
            unrecorded = kernels.activation_forward(gate, "gelu_tanh")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), unrecorded.view(bits))
    reference.record_range_(out, *expected, 2)
    assert torch.equal(amax, expected[0]) and torch.equal(counts, expected[1])
    assert counts[6] > 0 and counts[7] > (3 if gated else 0)  # underflow and inf/NaN are there
