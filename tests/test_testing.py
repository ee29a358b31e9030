"""Tests of amp_fx.testing: the tolerances, the comparison and `assert_equivalent` itself.

The reference for "a low-precision model within tolerance" is the same model run in pure
fp16/bf16 (`low_precision_copy`: parameters and inputs cast, outputs back to FP32), the least
accurate thing mixed precision does; it must pass, and a deliberately wrong model must not.
"""

from __future__ import annotations

import copy

import hypothesis
import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from amp_fx.testing import (
    ACTIVATIONS,
    FAMILIES,
    SEQUENCE_LAYERS,
    SMOOTH_ACTIVATIONS,
    SPATIAL_LAYERS,
    assert_close_normwise,
    assert_equivalent,
    compare_tensors,
    forward_backward,
    grad_tolerances,
    infer_dtype,
    low_precision_copy,
    models_and_inputs,
    normwise_error,
    tolerances,
    with_autocast,
)
from amp_fx.testing.random_models import (
    Activation,
    ChannelsFirst,
    Concat,
    RandomModel,
    Reduction,
    Residual,
    SoftmaxGate,
)

LOW_DTYPES = [torch.float16, torch.bfloat16]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 5)
    )


def test_tolerances_grow_with_unit_roundoff() -> None:
    fp32, fp16, bf16 = (tolerances(d) for d in (torch.float32, torch.float16, torch.bfloat16))
    assert fp32[0] < fp16[0] < bf16[0]
    for dtype in (torch.float32, *LOW_DTYPES):
        rtol, atol = tolerances(dtype)
        grad_rtol, grad_atol = grad_tolerances(dtype)
        assert grad_rtol >= rtol and grad_atol >= atol
        # Never tighter than the format can represent: at least a few unit roundoffs.
        assert rtol >= 2 * torch.finfo(dtype).eps / 2


@pytest.mark.parametrize("fn", [tolerances, grad_tolerances])
def test_tolerances_reject_unknown_dtypes(fn) -> None:
    with pytest.raises(ValueError, match="torch.int32"):
        fn(torch.int32)
    with pytest.raises(TypeError, match="torch.dtype"):
        fn("float16")


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("seed", range(5))
def test_pure_low_precision_model_is_within_tolerance(dtype: torch.dtype, seed: int) -> None:
    model = _mlp(seed)
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(seed))
    assert_equivalent(model, low_precision_copy(model, dtype), (x,), dtype=dtype, measure="fixed")


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_fp32_tolerance_rejects_low_precision_rounding(dtype: torch.dtype) -> None:
    model = _mlp()
    with pytest.raises(AssertionError, match="norm-wise error"):
        assert_equivalent(model, low_precision_copy(model, dtype), (torch.randn(3, 16),), dtype=torch.float32)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_wrong_weight_is_caught_in_outputs_and_gradients(dtype: torch.dtype) -> None:
    model = _mlp()
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong[5].weight.mul_(1.5)  # a 50% error in the last layer
    with pytest.raises(AssertionError) as info:
        assert_equivalent(model, wrong, (torch.randn(3, 16),), dtype=dtype)
    message = str(info.value)
    assert "output[0]" in message and "grad of parameter '0.weight'" in message


def test_wrong_gradient_alone_is_caught() -> None:
    class DetachedLayerNorm(nn.Module):
        """Same forward as the original, but no gradient flows into the first layer."""

        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model[1:](self.model[0](x).detach())

    model = nn.Sequential(_mlp())
    converted = nn.Sequential(DetachedLayerNorm(copy.deepcopy(model[0])))
    x = torch.randn(3, 16)
    assert_equivalent(model, converted, (x,), dtype=torch.float32, check_grads=False)
    with pytest.raises(AssertionError, match=r"'0\.model\.0\.weight'|grad of input\[0\]"):
        assert_equivalent(model, converted, (x,), dtype=torch.float32)


def test_missing_parameter_is_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    renamed = nn.Sequential(nn.Identity(), copy.deepcopy(model[0]))
    with pytest.raises(AssertionError, match="'0.weight': the converted model has no parameter of that name"):
        assert_equivalent(model, renamed, (torch.randn(2, 4),), dtype=torch.float32)


def test_overflow_is_a_failure_not_averaged_away() -> None:
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(1.0e4)
        model.bias.zero_()
    x = torch.full((2, 4), 3.0)  # 1.2e5 overflows float16 (max 65504)
    with pytest.raises(AssertionError, match="inf/NaN"):
        assert_equivalent(model, low_precision_copy(model, torch.float16), (x,), dtype=torch.float16)


def test_output_structure_must_match() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor):
            return x * 2, x + 1

    class Single(nn.Module):
        def forward(self, x: torch.Tensor):
            return (x * 2,)

    with pytest.raises(AssertionError, match="output structure"):
        assert_equivalent(Pair(), Single(), (torch.randn(3),))


def test_model_state_is_restored() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    before = copy.deepcopy(model.state_dict())
    assert_equivalent(model, model, (torch.randn(5, 4),))  # shared parameters: runs one at a time
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0))
    assert model[0].bias.grad is None
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_dropout_sees_the_same_randomness() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    assert_equivalent(model, copy.deepcopy(model), (torch.randn(4, 8),), dtype=torch.float32)


def test_integer_inputs_and_outputs_are_compared_exactly() -> None:
    class ArgMax(nn.Module):
        def __init__(self, offset: int) -> None:
            super().__init__()
            self.embedding = nn.Embedding(10, 4)
            self.offset = offset

        def forward(self, tokens: torch.Tensor):
            h = self.embedding(tokens)
            return h, h.sum(-1).argmax(-1) + self.offset

    tokens = torch.randint(10, (2, 5))
    torch.manual_seed(0)
    same = ArgMax(0)
    assert_equivalent(same, copy.deepcopy(same), (tokens,))
    shifted = copy.deepcopy(same)
    shifted.offset = 1
    with pytest.raises(AssertionError, match=r"output\[1\]: torch.int64 values differ"):
        assert_equivalent(same, shifted, (tokens,))


def test_compare_tensors_measures() -> None:
    e = torch.tensor([3.0, 4.0])
    assert normwise_error(torch.tensor([3.0, 4.5]), e) == pytest.approx(0.1)
    assert compare_tensors(torch.tensor([3.0, 4.5]), e, rtol=0.11, atol=0.0) is None
    assert compare_tensors(torch.tensor([3.0, 4.5]), e, rtol=0.09, atol=0.0) is not None
    # atol is a floor on the RMS error, for tensors that are zero in FP32.
    assert compare_tensors(torch.tensor([1e-4, -1e-4]), torch.zeros(2), rtol=0.1, atol=1e-3) is None
    assert compare_tensors(torch.tensor([1e-2, -1e-2]), torch.zeros(2), rtol=0.1, atol=1e-3) is not None
    nan = torch.tensor([float("nan"), 1.0])
    assert compare_tensors(nan.clone(), nan, rtol=0.0, atol=0.0) is None
    assert compare_tensors(torch.tensor([0.0, 1.0]), nan, rtol=0.0, atol=0.0) is not None
    assert "shape" in compare_tensors(torch.zeros(2, 1), torch.zeros(2), rtol=0.0, atol=0.0).message
    with pytest.raises(AssertionError, match="half: norm-wise error"):
        assert_close_normwise(e.half() + 1, e, rtol=1e-3, atol=0.0, name="half")


def test_infer_dtype_from_parameters() -> None:
    assert infer_dtype(nn.Linear(2, 2)) == torch.float32
    assert infer_dtype(nn.Linear(2, 2).to(torch.bfloat16)) == torch.bfloat16


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="tuple of positional arguments"):
        assert_equivalent(nn.Identity(), nn.Identity(), torch.randn(2))


# --- the strategies ---------------------------------------------------------------------------

_BLOCK_TYPES = {
    "linear": nn.Linear,
    "layer_norm": nn.LayerNorm,
    "group_norm": (ChannelsFirst, nn.GroupNorm),
    "activation": Activation,
    "residual_mlp": Residual,
    "sdpa_attention": Residual,
    "softmax_attention": Residual,
    "multihead_attention": Residual,
    "concat": Concat,
    "softmax": SoftmaxGate,
    "reduction": Reduction,
    "conv": (nn.Conv1d, nn.Conv2d),
    "residual_conv": Residual,
}


@pytest.mark.parametrize("kind", sorted(set(SEQUENCE_LAYERS) | set(SPATIAL_LAYERS)))
@settings(max_examples=5)
@given(data=st.data())
def test_each_layer_kind_is_drawn_and_runs(kind: str, data: st.DataObject) -> None:
    families = [
        f for f in FAMILIES if kind in (SPATIAL_LAYERS if f in ("image", "signal") else SEQUENCE_LAYERS)
    ]
    model, inputs = data.draw(models_and_inputs(max_layers=2, families=families, layers=[kind]))
    expected = _BLOCK_TYPES.get(kind)
    for block in model.blocks:
        if kind == "batch_norm":
            # Train-mode BatchNorm over too few values is replaced by GroupNorm (ill-conditioned).
            assert isinstance(block, ChannelsFirst | nn.modules.batchnorm._BatchNorm | nn.GroupNorm)
        else:
            assert isinstance(block, expected), (kind, block)
    if kind == "multihead_attention":
        assert any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    out = model(*inputs)
    logits = out[0] if isinstance(out, tuple) else out
    assert logits.shape[0] == inputs[0].shape[0]
    # Numerically tame: O(1) activations, finite, and a gradient reaches every parameter.
    assert torch.isfinite(logits).all() and logits.abs().max() < 1e3
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@settings(max_examples=10)
@given(models_and_inputs(max_layers=3))
def test_drawn_models_trace_with_torch_fx(model_and_inputs) -> None:
    model, inputs = model_and_inputs
    assert isinstance(model, RandomModel) and model.family in FAMILIES
    gm = torch.fx.GraphModule(model, _LeafMultiheadAttention().trace(model))
    expected, actual = model(*inputs), gm(*inputs)
    for a, e in zip(
        torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected), strict=True
    ):
        assert torch.equal(a, e)


class _LeafMultiheadAttention(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return isinstance(m, nn.MultiheadAttention) or super().is_leaf_module(m, qualified_name)


def test_a_hypothesis_seed_rebuilds_the_same_models() -> None:
    def draw_models() -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        drawn = []

        @hypothesis.seed(1234)
        @settings(max_examples=5, database=None, derandomize=False)
        @given(models_and_inputs(max_layers=3))
        def collect(model_and_inputs) -> None:
            model, (x,) = model_and_inputs
            drawn.append((model.state_dict(), x))

        collect()
        return drawn

    rng_before = torch.get_rng_state()
    first, second = draw_models(), draw_models()
    assert torch.equal(torch.get_rng_state(), rng_before), "drawing models must not touch torch's global RNG"
    assert len(first) == len(second) > 0
    for (state_a, x_a), (state_b, x_b) in zip(first, second, strict=True):
        assert torch.equal(x_a, x_b)
        assert state_a.keys() == state_b.keys()
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_layers": 0}, "max_layers"),
        ({"families": ("audio",)}, "families"),
        ({"layers": ("lstm",)}, "unknown layers"),
        ({"activations": ("swish",)}, "activations"),
    ],
)
def test_strategy_rejects_bad_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        models_and_inputs(**kwargs).example()


def test_smooth_activations_have_no_kinks() -> None:
    assert set(SMOOTH_ACTIVATIONS) < set(ACTIVATIONS)
    x = torch.linspace(-4, 4, 8001, dtype=torch.float64, requires_grad=True)
    for kind in SMOOTH_ACTIVATIONS:
        (grad,) = torch.autograd.grad(Activation(kind)(x).sum(), x)
        assert grad.diff().abs().max() < 1e-2, kind  # the derivative is continuous: no jump


# --- the references ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_references_keep_parameter_names(dtype: torch.dtype) -> None:
    model = _mlp()
    x = torch.randn(3, 16)
    autocast = with_autocast(model, "cpu", dtype)
    low = low_precision_copy(model, dtype)
    names = [n for n, _ in model.named_parameters()]
    assert [n for n, _ in autocast.named_parameters()] == names == [n for n, _ in low.named_parameters()]
    assert all(p.dtype == torch.float32 for p in autocast.parameters())
    assert all(p.dtype == dtype for p in low.parameters())
    with torch.no_grad():
        assert autocast(x).dtype == dtype  # the last op, a Linear, runs in low precision
        assert low(x).dtype == torch.float32
        assert low_precision_copy(model, dtype, output_dtype=None)(x).dtype == dtype
        with torch.autocast("cpu", dtype=dtype):
            assert torch.equal(autocast(x), model(x))
    assert next(model.parameters()).dtype == torch.float32  # the model itself is untouched


def test_forward_backward_reports_outputs_and_gradients() -> None:
    model = _mlp()
    x = torch.randn(3, 16)
    run = forward_backward(model, (x,))
    assert set(run.param_grads) == {n for n, _ in model.named_parameters()}
    assert run.input_grads[0].shape == x.shape and torch.equal(run.outputs[0], model(x).detach())
    assert forward_backward(model, (x,), check_grads=False).param_grads == {}


def test_forward_backward_restores_buffers_and_leaves_the_callers_graph_usable() -> None:
    """Running statistics it moved are put back; buffers it left alone are not written, so an
    output the caller computed before it (a graph that saved such a buffer) still backpropagates."""

    class Reindexed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("ids", torch.tensor([3, 1, 0, 2]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).index_select(1, self.ids)

    model = Reindexed()
    x = torch.randn(5, 4, requires_grad=True)
    pending = model(x)  # index_select saved `ids` for its backward
    forward_backward(model, (torch.randn(5, 4),))
    pending.sum().backward()
    assert x.grad is not None

    norm = nn.BatchNorm1d(4)
    forward_backward(norm, (torch.randn(5, 4) + 3,))
    assert torch.equal(norm.running_mean, torch.zeros(4)) and int(norm.num_batches_tracked) == 0
