"""batch_norm_act against ``F.relu(F.batch_norm(x, ..., training=True) + residual)``.

The fused path must give the float64 result rounded once (outputs, input and residual gradients),
the parameter gradients up to fp32 summation order, torch's own low-precision result within the
mixed-precision tolerances, and running statistics updated as F.batch_norm updates them. Every
call it does not fuse must give exactly torch's result.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from amp_fx.kernels import reference
from amp_fx.ops import batch_norm as batch_norm_op
from amp_fx.ops.batch_norm import batch_norm_act, batch_norm_act_backward, batch_norm_act_forward
from amp_fx.testing import assert_close_normwise, grad_tolerances, rounding_tolerances, tolerances

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
PARAMS = ["float32", "input dtype", "none"]
SHAPE = (3, 6, 3, 4)
MOMENTUM = 0.1
EPS = 1e-5


def assert_rounded_once_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Results in the input's dtype, each side rounded once from fp32 math (or float64): one unit
    in the last place of that dtype (eps, relative), plus fp32's absolute tolerance for entries
    near 0; fp32 results: fp32 tolerance (amp_fx.testing's `rounding_tolerances`)."""
    assert actual.dtype == expected.dtype
    rtol, atol = rounding_tolerances(actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


def assert_channel_sums_close(actual: torch.Tensor, expected: torch.Tensor, scale: float) -> None:
    """Parameter gradients: per-channel fp32 sums whose error is relative to ``scale``, the sum of
    the magnitudes of their terms (the rule of tests/kernels/test_batch_norm.py)."""
    rtol, atol = rounding_tolerances(actual.dtype)
    assert_close_normwise(actual, expected, rtol=rtol, atol=atol, scale=scale, name="channel sums")


def make_inputs(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    params: str,
    with_residual: bool,
    seed: int,
    device: str = "cpu",
    memory_format: torch.memory_format = torch.channels_last,
) -> dict:
    """Leaf tensors for one call: input, parameters, running statistics (their dtype), residual
    and the upstream gradient."""
    generator = torch.Generator().manual_seed(seed)
    num_channels = shape[1]

    def activation(scale: float, offset: float) -> torch.Tensor:
        values = (scale * torch.randn(shape, generator=generator) + offset).to(dtype).to(device)
        if values.dim() == 4:
            values = values.contiguous(memory_format=memory_format)
        return values

    param_dtype = dtype if params == "input dtype" else torch.float32
    return {
        "input": activation(2.0, 3.0).requires_grad_(True),
        "weight": None
        if params == "none"
        else (torch.rand(num_channels, generator=generator) + 0.5)
        .to(param_dtype)
        .to(device)
        .requires_grad_(),
        "bias": None
        if params == "none"
        else torch.randn(num_channels, generator=generator).to(param_dtype).to(device).requires_grad_(),
        "running_mean": torch.randn(num_channels, generator=generator).to(param_dtype).to(device),
        "running_var": (torch.rand(num_channels, generator=generator) + 0.5).to(param_dtype).to(device),
        "residual": activation(1.0, 0.0).requires_grad_(True) if with_residual else None,
        "grad_out": activation(1.0, 0.0),
    }


def torch_expression(input, weight, bias, running_mean, running_var, momentum, eps, residual=None, relu=True):
    out = F.batch_norm(
        input, running_mean, running_var, weight, bias, training=True, momentum=momentum, eps=eps
    )
    if residual is not None:
        out = out + residual
    return F.relu(out) if relu else out


def run(fn, inputs: dict, relu: bool = True, cast=None) -> dict:
    """Call ``fn`` like batch_norm_act on copies of ``inputs`` (cast by ``cast`` when given), run
    the backward; return the output, the leaves' gradients and the running statistics after."""

    def copy(t):
        if t is None:
            return None
        c = t.detach().clone() if cast is None else cast(t.detach())
        return c.requires_grad_(t.requires_grad)

    args = {k: copy(v) for k, v in inputs.items() if k != "grad_out"}
    out = fn(
        args["input"],
        args["weight"],
        args["bias"],
        args["running_mean"],
        args["running_var"],
        MOMENTUM,
        EPS,
        args["residual"],
        relu,
    )
    out.backward(inputs["grad_out"] if cast is None else cast(inputs["grad_out"]))
    result = {"out": out.detach(), "running_mean": args["running_mean"], "running_var": args["running_var"]}
    for name in ("input", "weight", "bias", "residual"):
        result[f"grad_{name}"] = None if args[name] is None else args[name].grad
    return result


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """Records the fused calls batch_norm_act makes: "eager" (the autograd.Function calling the
    kernels) or "custom op" (the amp_fx::batch_norm_act_forward op, for traced tensors)."""
    calls: list[str] = []
    eager_apply = batch_norm_op._BatchNormAct.apply

    def counted_eager(*args):
        calls.append("eager")
        return eager_apply(*args)

    def counted_op(*args):
        calls.append("custom op")
        return batch_norm_act_forward(*args)

    monkeypatch.setattr(batch_norm_op._BatchNormAct, "apply", counted_eager)
    monkeypatch.setattr(batch_norm_op, "batch_norm_act_forward", counted_op)
    return calls


def to_float64(t: torch.Tensor) -> torch.Tensor:
    return t.double()


def assert_matches_float64(ours: dict, inputs: dict, relu: bool) -> None:
    dtype = inputs["input"].dtype
    expected = run(torch_expression, inputs, relu=relu, cast=to_float64)
    assert ours["out"].dtype == dtype
    assert ours["out"].is_contiguous(memory_format=torch.channels_last)
    assert_rounded_once_close(ours["out"], expected["out"].to(dtype))
    assert_rounded_once_close(ours["grad_input"], expected["grad_input"].to(dtype))
    if inputs["residual"] is not None:
        assert torch.equal(ours["grad_residual"], expected["grad_residual"].to(dtype))
    grad_out = inputs["grad_out"].double()
    magnitude = (4 * grad_out.abs()).sum(dim=(0, 2, 3)).max().item()  # |x_hat| < 4 here
    for name in ("grad_weight", "grad_bias"):
        if ours[name] is None:
            assert expected[name] is None
            continue
        assert ours[name].dtype == inputs[name.removeprefix("grad_")].dtype
        assert_channel_sums_close(ours[name], expected[name], magnitude)


def assert_running_stats_like_torch(ours: dict, inputs: dict, relu: bool) -> None:
    """The running statistics after the call equal F.batch_norm's update of copies of them: to
    fp32 tolerance for fp32 buffers. torch on CPU updates fp16/bf16 buffers with statistics it
    rounds to their dtype first, so there: one rounding from the float64 update, and torch's
    result within the mixed-precision tolerances."""
    expected = run(torch_expression, inputs, relu=relu)
    x = inputs["input"].detach().double()
    var, mean = torch.var_mean(x, dim=[d for d in range(x.dim()) if d != 1], correction=1)
    batch_stats = {"running_mean": mean, "running_var": var}
    for name in ("running_mean", "running_var"):
        assert ours[name].dtype == expected[name].dtype
        assert not torch.equal(ours[name], inputs[name])
        if ours[name].dtype == torch.float32:
            rtol, atol = tolerances(torch.float32)
            torch.testing.assert_close(ours[name], expected[name], rtol=rtol, atol=atol)
            continue
        exact = (1 - MOMENTUM) * inputs[name].double() + MOMENTUM * batch_stats[name]
        assert_rounded_once_close(ours[name], exact.to(ours[name].dtype))
        rtol, atol = tolerances(ours[name].dtype)
        torch.testing.assert_close(ours[name], expected[name], rtol=rtol, atol=atol)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_and_updates_running_stats(dtype, params, with_residual, relu, fused_calls) -> None:
    inputs = make_inputs(SHAPE, dtype, params, with_residual, seed=7)
    ours = run(batch_norm_act, inputs, relu=relu)
    assert fused_calls == ["eager"]
    assert_matches_float64(ours, inputs, relu)
    assert_running_stats_like_torch(ours, inputs, relu)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_close_to_torchs_low_precision_result(dtype, with_residual, fused_calls) -> None:
    # torch rounds the normalized value before adding the residual; the fused path rounds once.
    inputs = make_inputs(SHAPE, dtype, "float32", with_residual, seed=11)
    ours = run(batch_norm_act, inputs)
    expected = run(torch_expression, inputs)
    rtol, atol = tolerances(dtype)
    assert_close_normwise(ours["out"], expected["out"], rtol=rtol, atol=atol, name="out")
    rtol, atol = grad_tolerances(dtype)
    for name in ("grad_input", "grad_weight", "grad_bias", "grad_residual"):
        if expected[name] is not None:
            assert ours[name].dtype == expected[name].dtype
            assert_close_normwise(ours[name], expected[name], rtol=rtol, atol=atol, name=name)
    assert len(fused_calls) == 1


def test_without_running_stats(fused_calls) -> None:
    inputs = make_inputs(SHAPE, torch.float16, "float32", True, seed=3)
    inputs["running_mean"] = inputs["running_var"] = None
    ours = run(batch_norm_act, inputs)
    assert len(fused_calls) == 1
    assert_matches_float64(ours, inputs, relu=True)


def test_only_parameter_gradients(fused_calls) -> None:
    # An input that needs no gradient (the first layer's): the parameters still get theirs.
    inputs = make_inputs(SHAPE, torch.bfloat16, "float32", False, seed=4)
    inputs["input"].requires_grad_(False)
    ours = run(batch_norm_act, inputs)
    expected = run(torch_expression, inputs, cast=to_float64)
    assert ours["grad_input"] is None
    magnitude = (4 * inputs["grad_out"].double().abs()).sum(dim=(0, 2, 3)).max().item()
    assert_channel_sums_close(ours["grad_weight"], expected["grad_weight"], magnitude)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("with_residual", [True, False])
def test_dispatches_to_triton(triton_calls, with_residual, fused_calls) -> None:
    inputs = make_inputs((2, 5, 3, 3), torch.float16, "float32", with_residual, seed=5)
    ours = run(batch_norm_act, inputs)
    assert len(fused_calls) == 1
    assert_matches_float64(ours, inputs, relu=True)
    assert_running_stats_like_torch(ours, inputs, relu=True)
    # The Triton kernels ran (the reference gives the same numbers), once each way.
    assert triton_calls == {"batch_norm_act_forward": 1, "batch_norm_act_backward": 1}


def test_never_reads_a_value_on_the_host(kernels, fused_calls, no_host_reads) -> None:
    # On CPU what test_no_host_synchronization_on_gpu checks: statistics, running-stat updates and
    # gradients stay on the device, forward and backward.
    inputs = make_inputs((2, 5, 3, 3), torch.float16, "float32", True, seed=15)
    with no_host_reads():
        ours = run(batch_norm_act, inputs)
    assert fused_calls == ["eager"]
    assert_matches_float64(ours, inputs, relu=True)
    assert_running_stats_like_torch(ours, inputs, relu=True)


class PassThroughMode(TorchDispatchMode):
    """A dispatch mode that changes nothing (as a tracer's would see the ops)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_residual", [True, False])
def test_calls_under_a_dispatch_mode_use_the_custom_ops(with_residual, fused_calls) -> None:
    # Tracers (make_fx, torch.export, fake tensors) need the ops' fake implementations: with a
    # dispatch mode active the call goes through the custom ops, with the same results.
    inputs = make_inputs(SHAPE, torch.bfloat16, "float32", with_residual, seed=13)
    with PassThroughMode():
        ours = run(batch_norm_act, inputs)
    assert fused_calls == ["custom op"]
    assert_matches_float64(ours, inputs, relu=True)
    assert_running_stats_like_torch(ours, inputs, relu=True)


class RecordedLaunches:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records its name and launches nothing."""

    def __init__(self, name: str, launches: list[str]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(self.name)


def test_eager_call_launches_three_kernels_each_way_and_no_torch_op(monkeypatch) -> None:
    # The host cost of a call: its Triton launches and nothing else that would be a device kernel
    # (every per-channel value is computed by the finalize kernels; only allocations remain).
    pytest.importorskip("triton")
    from amp_fx.kernels.batch_norm import triton as batch_norm

    monkeypatch.setenv("AMP_FX_FORCE_TRITON", "1")
    launches: list[str] = []
    for name in [name for name in vars(batch_norm) if name.endswith("_kernel")]:  # the launched ones
        monkeypatch.setattr(batch_norm, name, RecordedLaunches(name, launches))
    inputs = make_inputs(SHAPE, torch.float16, "float32", True, seed=14)
    leaves = [inputs[k] for k in ("input", "weight", "bias", "residual")]
    arguments = [inputs[k] for k in ("input", "weight", "bias", "running_mean", "running_var")]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = batch_norm_act(*arguments, MOMENTUM, EPS, inputs["residual"], True)
        forward_launches = list(launches)
        torch.autograd.grad(out, leaves, inputs["grad_out"])
    assert forward_launches == ["_statistics_kernel", "_statistics_finalize_kernel", "_apply_kernel"]
    assert launches[3:] == ["_backward_reduce_kernel", "_backward_finalize_kernel", "_backward_input_kernel"]
    ops = {event.name for event in prof.events() if event.name.startswith("aten::")}
    assert ops <= {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty"}, ops


FALLBACKS = ["NCHW input", "2-D input", "3-D input", "5-D input", "NCHW residual", "float64 input"]


@pytest.mark.parametrize("case", FALLBACKS)
def test_other_calls_are_exactly_the_torch_expression(case, fused_calls) -> None:
    shape = {"2-D input": (6, 4), "3-D input": (3, 4, 5), "5-D input": (2, 4, 2, 3, 2)}.get(
        case, (2, 4, 3, 3)
    )
    dtype = torch.float64 if case == "float64 input" else torch.float16
    memory_format = torch.contiguous_format if case == "NCHW input" else torch.channels_last
    params = "input dtype" if dtype == torch.float64 else "float32"
    inputs = make_inputs(shape, dtype, params, True, seed=6, memory_format=memory_format)
    if case == "NCHW residual":
        inputs["residual"] = inputs["residual"].detach().contiguous().requires_grad_(True)
    ours = run(batch_norm_act, inputs)
    expected = run(torch_expression, inputs)
    assert not fused_calls
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name
        assert ours[name].stride() == value.stride(), name


def test_errors_of_the_torch_expression(fused_calls) -> None:
    # One value per channel: F.batch_norm's error, not a division by M - 1 = 0.
    x = torch.randn(1, 3, 1, 1).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        batch_norm_act(x, None, None, torch.zeros(3), torch.ones(3), MOMENTUM, EPS)
    with pytest.raises(RuntimeError, match="weight should contain 3 elements not 4"):
        batch_norm_act(torch.randn(2, 3, 2, 2), torch.ones(4), None, None, None, MOMENTUM, EPS)
    assert not fused_calls


@pytest.mark.parametrize(
    ("input_dtype", "param_dtype"), [(torch.float32, torch.float16), (torch.float16, torch.bfloat16)]
)
def test_parameter_dtypes_torch_rejects_get_torchs_error(input_dtype, param_dtype, fused_calls) -> None:
    # Parameters are float32 or of the input's dtype; other mixes are torch's to refuse.
    x = torch.randn(2, 4, 3, 3, dtype=input_dtype).to(memory_format=torch.channels_last)
    weight = torch.ones(4, dtype=param_dtype)
    with pytest.raises(RuntimeError) as expected:
        F.batch_norm(x, None, None, weight, None, training=True)
    with pytest.raises(RuntimeError) as ours:
        batch_norm_act(x, weight, None, None, None, MOMENTUM, EPS)
    assert str(ours.value) == str(expected.value)
    assert not fused_calls


def test_double_backward_raises_instead_of_dropping_terms(fused_calls) -> None:
    # The kernels' gradient is not differentiable again: a gradient penalty must fail loudly.
    inputs = make_inputs(SHAPE, torch.float32, "float32", False, seed=3)
    arguments = [inputs[k] for k in ("input", "weight", "bias", "running_mean", "running_var")]
    out = batch_norm_act(*arguments, MOMENTUM, EPS)
    assert fused_calls == ["eager"]
    (grad,) = torch.autograd.grad(out.square().sum(), inputs["input"], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


def test_compiles_without_graph_breaks(fused_calls) -> None:
    # Under torch.compile batch_norm_act is the torch expression (Inductor fuses it itself).
    compiled = torch.compile(batch_norm_act, backend="aot_eager", fullgraph=True)
    inputs = make_inputs(SHAPE, torch.float16, "float32", True, seed=8)
    ours = run(compiled, inputs)
    assert not fused_calls
    expected = run(torch_expression, inputs)
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value)


def test_opcheck() -> None:
    opcheck = getattr(torch.library, "opcheck", None)
    if opcheck is None:
        pytest.skip("torch.library.opcheck needs torch >= 2.4")
    inputs = make_inputs((2, 5, 2, 3), torch.float16, "float32", True, seed=9)
    x, weight, bias, residual = (inputs[k].detach() for k in ("input", "weight", "bias", "residual"))
    for relu in (True, False):
        opcheck(batch_norm_act_forward, (x, weight.requires_grad_(), bias, residual, EPS, relu))
        opcheck(batch_norm_act_forward, (x.requires_grad_(), None, None, None, EPS, relu))
        x = x.detach()
    out, mean, invstd, _ = reference.batch_norm_act_forward(x, weight.detach(), bias, residual, EPS, True)
    grad_out = inputs["grad_out"]
    opcheck(batch_norm_act_backward, (grad_out, x, weight.detach(), bias, mean, invstd, out, True, True))
    opcheck(batch_norm_act_backward, (grad_out, x, None, None, mean, invstd, None, False, True))


@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [False, True])
def test_resnet_sized_on_gpu(with_residual, fused_calls) -> None:
    # ResNet-50's stage 1 BatchNorm at batch 256: 256 x 64 x 56 x 56 fp16 channels_last, fp32 params.
    inputs = make_inputs((256, 64, 56, 56), torch.float16, "float32", with_residual, seed=10, device="cuda")
    ours = run(batch_norm_act, inputs)
    expected = run(torch_expression, inputs)
    assert len(fused_calls) == 1
    rtol, atol = tolerances(torch.float16)
    assert_close_normwise(ours["out"], expected["out"], rtol=rtol, atol=atol, name="out")
    rtol, atol = grad_tolerances(torch.float16)
    for name in ("grad_input", "grad_weight", "grad_bias", "grad_residual"):
        if expected[name] is not None:
            assert_close_normwise(ours[name], expected[name], rtol=rtol, atol=atol, name=name)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_no_host_synchronization_on_gpu() -> None:
    inputs = make_inputs((8, 128, 7, 7), torch.float16, "float32", True, seed=12, device="cuda")
    run(batch_norm_act, inputs)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(batch_norm_act, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _positional_names(function) -> list[str]:
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_custom_ops_take_the_kernel_contracts_arguments(direction) -> None:
    # The contract (amp_fx.kernels.batch_norm) is written once; the custom op and its fake repeat
    # its positional arguments, name for name.
    expected = _positional_names(getattr(reference, f"batch_norm_act_{direction}"))
    schema = getattr(torch.ops.amp_fx, f"batch_norm_act_{direction}").default._schema
    assert [argument.name for argument in schema.arguments] == expected
    assert _positional_names(getattr(batch_norm_op, f"_batch_norm_act_{direction}_fake")) == expected
