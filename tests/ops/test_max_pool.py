"""`amp_fx.ops.max_pool.max_pool2d` against `F.max_pool2d`: values, gradients, layout, fallbacks, the
custom ops (opcheck, tracing with a dispatch mode) and torch.compile.

The eager path runs the pure-torch reference on CPU, and the Triton kernels on CUDA or, with
``AMP_FX_FORCE_TRITON=1``, on CPU under TRITON_INTERPRET=1 (the `device` fixture's "cpu").
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from amp_fx.kernels import FORCE_TRITON_ENV, reference
from amp_fx.ops import max_pool as max_pool_op
from amp_fx.ops.max_pool import max_pool2d, max_pool2d_backward, max_pool2d_forward

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (kernel_size, stride, padding, dilation, ceil_mode) in F.max_pool2d's accepted forms.
CALLS = [
    (3, 2, 1, 1, False),  # ResNet's stem
    ((2, 3), None, 0, 1, True),
    (2, [], (1, 0), (1, 2), False),
    ((3,), 1, 1, 2, True),
]


@pytest.fixture(autouse=True)
def fuse_every_size(monkeypatch):
    """This file's small inputs take the fused path (by default only large ones do)."""
    monkeypatch.setattr(max_pool_op, "MIN_FUSED_ELEMENTS", 0)


def make_input(dtype: torch.dtype, device: str = "cpu", shape=(2, 5, 7, 9), seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, shape, generator=generator).to(dtype)  # ties
    x[0, 0, 0, 0] = float("nan")
    return x.to(device).contiguous(memory_format=torch.channels_last)


def run(
    function, x: torch.Tensor, call: tuple, grad_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(output, input gradient, name of the output's grad_fn) of function(x, *call), with a random
    upstream gradient of values representable in ``grad_dtype`` (default: x's dtype)."""
    kernel_size, stride, padding, dilation, ceil_mode = call
    leaf = x.detach().clone().requires_grad_()
    out = function(leaf, kernel_size, stride, padding, dilation, ceil_mode)
    generator = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=generator).to(grad_dtype or x.dtype).to(x.dtype)
    out.backward(grad_out.to(x.device))
    return out.detach(), leaf.grad, type(out.grad_fn).__name__


def torch_expected(x: torch.Tensor, call: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """F.max_pool2d's output, and its gradient from float32 sums rounded once (torch's CPU backward
    sums fp16/bf16 in their own dtype; ours sums in fp32)."""
    out, _, _ = run(F.max_pool2d, x, call)
    _, grad32, _ = run(F.max_pool2d, x.float(), call, grad_dtype=x.dtype)
    return out, grad32.to(x.dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.stride() == expected.stride()
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("call", CALLS)
def test_matches_torch_on_the_reference(call, dtype) -> None:
    x = make_input(dtype)
    out, grad, grad_fn = run(max_pool2d, x, call)
    assert grad_fn == "_MaxPool2dBackward"
    expected_out, expected_grad = torch_expected(x, call)
    assert_same(out, expected_out)
    assert_same(grad, expected_grad)


@pytest.mark.parametrize("call", CALLS[:2])
def test_matches_torch_on_the_triton_kernels(device, call, monkeypatch) -> None:
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    x = make_input(torch.float16, device)
    out, grad, grad_fn = run(max_pool2d, x, call)
    assert grad_fn == "_MaxPool2dBackward"
    expected_out, expected_grad = torch_expected(x.cpu(), call)
    assert_same(out.cpu(), expected_out)
    assert_same(grad.cpu(), expected_grad)


@pytest.mark.parametrize(
    ("x", "call"),
    [
        (make_input(torch.float32).contiguous(), CALLS[0]),  # not channels_last
        (make_input(torch.float64), CALLS[0]),  # dtype the kernels do not take
        (make_input(torch.float32)[0], CALLS[0]),  # 3-D
        (make_input(torch.float32, shape=(1, 1, 7, 9)), CALLS[0]),  # channels_last and contiguous
        (make_input(torch.float32, shape=(1, 2, 20, 20)), (17, 1, 0, 1, False)),  # > 256 taps
    ],
    ids=["contiguous", "float64", "3d", "one-channel", "large-window"],
)
def test_falls_back_to_torch(x, call) -> None:
    out, grad, grad_fn = run(max_pool2d, x, call)
    assert grad_fn.startswith("MaxPool2DWithIndicesBackward")
    expected_out, _, _ = run(F.max_pool2d, x, call)
    _, expected_grad, _ = run(F.max_pool2d, x, call)
    assert_same(out, expected_out)
    assert_same(grad, expected_grad)


def test_bad_arguments_raise_torch_errors() -> None:
    x = make_input(torch.float32)
    for bad in [(3, 2, 2, 1, False), (3, 0, 1, 1, False), (20, 1, 0, 1, False)]:
        with pytest.raises(RuntimeError) as expected:
            F.max_pool2d(x, *bad)
        with pytest.raises(RuntimeError) as ours:
            max_pool2d(x, *bad)
        assert str(ours.value) == str(expected.value)


def test_without_grad() -> None:
    x = make_input(torch.bfloat16)
    with torch.no_grad():
        out = max_pool2d(x, 3, 2, 1)
    assert out.grad_fn is None
    assert_same(out, F.max_pool2d(x, 3, 2, 1))


def test_custom_ops_pass_opcheck() -> None:
    # No NaN: opcheck compares results with NaN != NaN.
    x = make_input(torch.float16).nan_to_num().requires_grad_()
    window = ([3, 3], [2, 2], [1, 1], [1, 1])
    torch.library.opcheck(max_pool2d_forward, (x, *window, False))
    out, offsets = max_pool2d_forward(x.detach(), *window, False)
    torch.library.opcheck(max_pool2d_backward, (torch.randn_like(out), offsets, list(x.shape), *window))


def test_tracing_with_a_dispatch_mode_uses_the_custom_ops() -> None:
    x = make_input(torch.float32)
    graph = make_fx(lambda t: max_pool2d(t, 3, 2, 1))(x)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert any("amp_fx.max_pool2d_forward" in target for target in targets), targets
    assert_same(graph(x), F.max_pool2d(x, 3, 2, 1))
    # Autograd through the custom op (not the eager Function) under a dispatch mode.
    leaf = x.clone().requires_grad_()
    out, grad, _ = run(max_pool2d, x, CALLS[0])
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        traced_out = max_pool2d(leaf, 3, 2, 1)
    assert type(traced_out.grad_fn).__name__ != "_MaxPool2dBackward"
    generator = torch.Generator().manual_seed(1)
    traced_out.backward(torch.randn(traced_out.shape, generator=generator))
    assert_same(traced_out.detach(), out)
    assert_same(leaf.grad, grad)


def test_compiles_to_torch_max_pool_without_graph_breaks() -> None:
    x = make_input(torch.float32)
    compiled = torch.compile(
        lambda t: max_pool2d(t, 3, 2, 1).square().sum(), fullgraph=True, backend="aot_eager"
    )
    leaf = x.clone().requires_grad_()
    compiled(leaf).backward()
    expected_leaf = x.clone().requires_grad_()
    F.max_pool2d(expected_leaf, 3, 2, 1).square().sum().backward()
    torch.testing.assert_close(leaf.grad, expected_leaf.grad, equal_nan=True)


def test_inputs_with_more_pixels_than_the_kernels_index_run_torchs_max_pool() -> None:
    # The kernels index N * H * W with int32: beyond that F.max_pool2d, not an error.
    def window(batch: int):
        x = torch.empty(batch, 2, 256, 256, device="meta").to(memory_format=torch.channels_last)
        return max_pool_op._window_if_fused(x, 3, 2, 1, 1, False)

    assert window(2**14) is not None
    assert window(2**15) is None


def test_inputs_below_the_size_threshold_run_torchs_max_pool(monkeypatch) -> None:
    x = make_input(torch.float16).requires_grad_()
    monkeypatch.setattr(max_pool_op, "MIN_FUSED_ELEMENTS", x.numel() + 1)
    assert type(max_pool2d(x, 3, 2, 1).grad_fn).__name__ == "MaxPool2DWithIndicesBackward0"
    monkeypatch.setattr(max_pool_op, "MIN_FUSED_ELEMENTS", x.numel())
    assert type(max_pool2d(x, 3, 2, 1).grad_fn).__name__ == "_MaxPool2dBackward"


def test_never_reads_a_value_on_the_host(kernels, no_host_reads) -> None:
    # On CPU what test_no_host_synchronization checks on a GPU, forward and backward.
    x = make_input(torch.float16)
    with no_host_reads():
        out, grad, grad_fn = run(max_pool2d, x, CALLS[0])
    assert grad_fn == "_MaxPool2dBackward"
    expected_out, expected_grad = torch_expected(x, CALLS[0])
    assert_same(out, expected_out)
    assert_same(grad, expected_grad)


@pytest.mark.gpu
def test_no_host_synchronization() -> None:
    x = make_input(torch.float16, "cuda", shape=(4, 64, 32, 32)).requires_grad_()
    max_pool2d(x, 3, 2, 1).sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = max_pool2d(x, 3, 2, 1)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _positional_names(function) -> list[str]:
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_custom_ops_take_the_kernel_contracts_arguments(direction) -> None:
    # The contract (amp_fx.kernels.max_pool) is written once; the custom op and its fake repeat its
    # positional arguments, name for name.
    expected = _positional_names(getattr(reference, f"max_pool2d_{direction}"))
    schema = getattr(torch.ops.amp_fx, f"max_pool2d_{direction}").default._schema
    assert [argument.name for argument in schema.arguments] == expected
    assert _positional_names(getattr(max_pool_op, f"_max_pool2d_{direction}_fake")) == expected
