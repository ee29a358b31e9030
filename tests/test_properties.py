"""Property tests of `amp_fx.convert` on random models (`amp_fx.testing.models_and_inputs`).

What must hold for every model hypothesis draws:
- O0 is the identity: outputs and gradients bit-identical to the original.
- O1/O2/O3, fp16 and bf16: outputs and gradients agree with FP32 within `amp_fx.testing`'s
  tolerances (with the CPU and the CUDA op lists; both run on this CPU); for models with
  kinked activations (relu, ...) outputs only, their gradients being discontinuous.
- Dtype discipline, observed by running the converted graph with a recording `fx.Interpreter`:
  every LOWER op receives low-precision floating inputs, every FP32 op fp32 inputs, and no cast
  node is a no-op (its input dtype differs from its output dtype).
- Idempotence: converting a converted graph inserts nothing and computes the same bits.
- The O1 oracle: on CPU, O1 is bit-identical to running the model under ``torch.autocast``
  (outputs and gradients).
- The O3 oracle: O3 is bit-identical to Apex's O3, the model cast to fp16/bf16 (``model.half()``).

The CI profile (tests/conftest.py) bounds each test to 15 examples.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule
from amp_fx.testing import (
    SEQUENCE_LAYERS,
    SMOOTH_ACTIVATIONS,
    SPATIAL_LAYERS,
    assert_equivalent,
    low_precision_copy,
    models_and_inputs,
    with_autocast,
)

LOW_DTYPES = (torch.float16, torch.bfloat16)
LOW_LEVELS = ("O1", "O2", "O3")

random_models = models_and_inputs(max_layers=4)
# The CUDA op lists are checked on this CPU too, except for opaque nodes: their autocast islands
# are torch.autocast("cuda"), which does nothing without a CUDA device.
_TRACEABLE_LAYERS = [k for k in (*SEQUENCE_LAYERS, *SPATIAL_LAYERS) if k != "multihead_attention"]


def _with_device_types(**kwargs: Any) -> st.SearchStrategy:
    return st.one_of(
        st.tuples(models_and_inputs(max_layers=4, **kwargs), st.just("cpu")),
        st.tuples(models_and_inputs(max_layers=4, layers=_TRACEABLE_LAYERS, **kwargs), st.just("cuda")),
    )


models_and_device_types = _with_device_types()
# Gradients are compared with FP32 only for models without kinks (relu, leaky_relu, hardswish):
# at a kink, a rounding error that moves an input across it changes the gradient by O(1).
smooth_models_and_device_types = _with_device_types(activations=SMOOTH_ACTIVATIONS)


def _pinned_example(
    features: int, fill: float, alternate_signs: bool = False
) -> tuple[torch.nn.Module, tuple]:
    """A small smooth model (LayerNorm first, so that inputs near fp16's largest value stay
    representable downstream) and an input of ``features`` values ``fill`` (signs alternating)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(features), torch.nn.Linear(features, 3), torch.nn.GELU(), torch.nn.Linear(3, 2)
    )
    x = torch.full((2, features), fill)
    if alternate_signs:
        x[..., 1::2] *= -1
    return model, (x,)


# Edge cases that every run checks besides the drawn ones: an all-zero input, a single feature,
# and magnitudes near fp16's largest value (65504).
ZEROS = _pinned_example(4, 0.0)
SINGLE = _pinned_example(1, 0.5)
NEAR_FP16_MAX = _pinned_example(4, 6.0e4, alternate_signs=True)


def _casts(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if node_info(n).is_cast)


def _calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))


def _floating_dtypes(values: Any) -> list[torch.dtype]:
    return [
        v.dtype for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]


class DtypeRecorder(torch.fx.Interpreter):
    """Runs a GraphModule and records, per node, the floating dtypes it receives and returns.

    A call_module node "receives" its module's own parameters and buffers too: under O2 a LOWER
    Linear must hold fp16 weights, not only see an fp16 input.
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.inputs: dict[str, list[torch.dtype]] = {}
        self.outputs: dict[str, list[torch.dtype]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        received = _floating_dtypes((args, kwargs))
        if n.op == "call_module":
            module = self.module.get_submodule(n.target)
            received += _floating_dtypes([*module.parameters(), *module.buffers()])
        self.inputs[n.name] = received
        result = super().run_node(n)
        self.outputs[n.name] = _floating_dtypes(result)
        return result


def _check_dtype_discipline(gm: torch.fx.GraphModule, inputs: tuple[Any, ...], exact_dtypes: bool) -> None:
    policy = gm.meta["amp_fx_policy"]
    recorder = DtypeRecorder(gm)
    with torch.no_grad():
        recorder.run(*copy.deepcopy(inputs))
    for node in gm.graph.nodes:
        info = node_info(node)
        received = recorder.inputs.get(node.name)
        if received is None:
            continue
        where = f"{node.name} ({info.op}, {info.rule}) received {received}\n{gm.code}"
        if info.is_cast:
            value = node.args[0]
            before = recorder.outputs[value.name] if isinstance(value, torch.fx.Node) else []
            after = recorder.outputs[node.name]
            # Without example inputs, convert assumes floating inputs are fp32 and cannot know what
            # an opaque node returns: a cast there is guarded and may pass a non-floating value
            # (token ids) or an already-cast one through unchanged. With example inputs, or where
            # the dtype was known, a cast must change the dtype.
            guarded = not exact_dtypes and (not before or info.in_dtypes[:1] in ((), (None,)))
            if not guarded:
                assert before != after, f"cast {node.name} is a no-op: {before} -> {after}\n{gm.code}"
        elif info.rule is Rule.LOWER:
            assert received and all(d == policy.dtype for d in received), where
        elif info.rule is Rule.FP32:
            assert all(d == torch.float32 for d in received), where


@given(random_models)
@example(ZEROS)
@example(SINGLE)
@example(NEAR_FP16_MAX)
def test_o0_is_bit_identical(model_and_inputs) -> None:
    model, inputs = model_and_inputs
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for dtype in LOW_DTYPES:
        gm = amp_fx.convert(model, "O0", dtype=dtype, device_type="cpu")
        assert _casts(gm) == 0
        assert_equivalent(model, gm, inputs, exact=True)
    # convert never touches the input model.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


# Each example draws its level and dtype (the oracle runs 7 batches and a reference per check, so
# every combination on every model would take minutes); the examples below name all six once.
@given(smooth_models_and_device_types, st.sampled_from(LOW_LEVELS), st.sampled_from(LOW_DTYPES))
@example((ZEROS, "cpu"), "O1", torch.float16)
@example((SINGLE, "cuda"), "O2", torch.bfloat16)
@example((NEAR_FP16_MAX, "cpu"), "O3", torch.float16)
@example((SINGLE, "cpu"), "O1", torch.bfloat16)
@example((NEAR_FP16_MAX, "cuda"), "O2", torch.float16)
@example((ZEROS, "cuda"), "O3", torch.bfloat16)
def test_converted_models_agree_with_fp32(model_inputs_device, level: str, dtype: torch.dtype) -> None:
    (model, inputs), device_type = model_inputs_device
    gm = amp_fx.convert(model, level, dtype=dtype, device_type=device_type)
    assert_equivalent(model, gm, inputs, dtype=dtype)


@given(models_and_device_types, st.sampled_from(LOW_LEVELS), st.sampled_from(LOW_DTYPES))
@example((ZEROS, "cuda"), "O1", torch.bfloat16)
@example((SINGLE, "cpu"), "O2", torch.float16)
@example((NEAR_FP16_MAX, "cuda"), "O3", torch.bfloat16)
@example((SINGLE, "cuda"), "O1", torch.float16)
@example((NEAR_FP16_MAX, "cpu"), "O2", torch.bfloat16)
@example((ZEROS, "cpu"), "O3", torch.float16)
def test_converted_models_with_kinks_agree_with_fp32_in_outputs(
    model_inputs_device, level: str, dtype: torch.dtype
) -> None:
    (model, inputs), device_type = model_inputs_device
    gm = amp_fx.convert(model, level, dtype=dtype, device_type=device_type)
    assert_equivalent(model, gm, inputs, dtype=dtype, check_grads=False)


@given(models_and_device_types, st.sampled_from(LOW_LEVELS), st.booleans())
@example((ZEROS, "cpu"), "O1", True)
@example((SINGLE, "cuda"), "O2", False)
@example((NEAR_FP16_MAX, "cpu"), "O3", True)
def test_dtype_discipline(model_inputs_device, level: str, with_examples: bool) -> None:
    (model, inputs), device_type = model_inputs_device
    examples = inputs if with_examples else None
    for dtype in LOW_DTYPES:
        gm = amp_fx.convert(model, level, dtype=dtype, device_type=device_type, example_inputs=examples)
        _check_dtype_discipline(gm, inputs, exact_dtypes=with_examples)


@given(random_models, st.sampled_from(["O0", *LOW_LEVELS]), st.sampled_from(LOW_DTYPES))
@example(ZEROS, "O1", torch.float16)
@example(SINGLE, "O2", torch.bfloat16)
@example(NEAR_FP16_MAX, "O3", torch.float16)
def test_convert_is_idempotent(model_and_inputs, level: str, dtype: torch.dtype) -> None:
    model, inputs = model_and_inputs
    once = amp_fx.convert(model, level, dtype=dtype, device_type="cpu")
    twice = amp_fx.convert(once, level, dtype=dtype, device_type="cpu")
    assert _casts(twice) == _casts(once), f"second conversion inserted casts:\n{once.code}\n{twice.code}"
    assert _calls(twice) == _calls(once), f"second conversion changed the graph:\n{once.code}\n{twice.code}"
    assert_equivalent(once, twice, inputs, exact=True)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
@given(model_and_inputs=random_models)
@example(model_and_inputs=ZEROS)
@example(model_and_inputs=SINGLE)
@example(model_and_inputs=NEAR_FP16_MAX)
def test_o1_on_cpu_is_bit_identical_to_autocast(model_and_inputs, dtype: torch.dtype) -> None:
    model, inputs = model_and_inputs
    gm = amp_fx.convert(model, "O1", dtype=dtype, device_type="cpu")
    reference = with_autocast(model, "cpu", dtype)
    # Outputs and gradients: the backward of the same casts and ops is the same computation.
    assert_equivalent(reference, gm, inputs, exact=True)
    with torch.no_grad():
        expected = _floating_dtypes(reference(*copy.deepcopy(inputs)))
        actual = _floating_dtypes(gm(*copy.deepcopy(inputs)))
    assert actual == expected, "O1 outputs must come back in autocast's dtypes"


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
@given(model_and_inputs=random_models)
@example(model_and_inputs=ZEROS)
@example(model_and_inputs=SINGLE)
@example(model_and_inputs=NEAR_FP16_MAX)
def test_o3_is_bit_identical_to_the_model_cast_to_low_precision(model_and_inputs, dtype: torch.dtype) -> None:
    model, inputs = model_and_inputs
    gm = amp_fx.convert(model, "O3", dtype=dtype, device_type="cpu")
    assert_equivalent(low_precision_copy(model, dtype), gm, inputs, exact=True)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["fp16", "bf16"])
def test_o2_cuda_lists_group_norm_after_promotion(dtype: torch.dtype) -> None:
    class Gate(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (0.5 + x.softmax(-1))  # softmax is an FP32 island at O2: mul promotes to fp32

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(8, 4)
            self.gate = Gate()
            self.norm = torch.nn.GroupNorm(1, 4)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.norm(self.gate(self.embedding(tokens)).transpose(1, 2))

    torch.manual_seed(0)
    model, tokens = Model(), torch.tensor([[7, 1, 3]])
    gm = amp_fx.convert(model, "O2", dtype=dtype, device_type="cuda")
    assert_equivalent(model, gm, (tokens,), dtype=dtype)


def test_o1_sums_the_gradients_of_a_shared_activation_like_autocast() -> None:
    class SharedActivation(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 1.0  # an activation (autocast caches casts of leaf tensors only)
            return self.a(h) + self.b(h)

    model = SharedActivation()
    with torch.no_grad():
        for layer in (model.a, model.b):
            layer.weight.fill_(100.0)  # each branch's input gradient is 40000, their sum 80000
            layer.bias.zero_()
    gm = amp_fx.convert(model, "O1", dtype=torch.float16, device_type="cpu")
    grads = []
    for candidate in (with_autocast(model, "cpu", torch.float16), gm):
        x = torch.ones(2, 4, requires_grad=True)
        (candidate(x).float() * 100).sum().backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[0]).all()
    assert torch.equal(grads[1], grads[0])
