"""On a CPU an eager call of a fused norm, activation or rotary op computes its torch expression
(`amp_fx.kernels.kernels_run_for`): the kernels there would be their pure-torch reference, the same
math with more host time. What a user gets by default (AMP_FX_FORCE_TRITON unset) is compared here
with the reference kernels (AMP_FX_FORCE_TRITON=0, what the rest of the suite runs): the same values
and gradients without a fused autograd node, the custom op for tracers, and a converted Hugging Face
Llama that trains to the same loss and gradients and whose watch records the same ranges.
"""

from __future__ import annotations

import copy

import pytest
import torch

import amp_fx
from amp_fx.kernels import FORCE_TRITON_ENV
from amp_fx.ops import norms
from amp_fx.testing import assert_close_normwise, grad_tolerances, tolerances
from tests.models.hf import VOCAB, causal_lm_without_dropout
from tests.ops.test_inplace_after_fused import FUSED_CALLS, _autograd_nodes
from tests.passes.test_fuse_norms import assert_close_to, loss_and_grads

BF16 = torch.bfloat16
# The functions the converted graphs call for these three families (not their custom ops, which
# are the kernels' own entry points).
EXPRESSION_FUNCTIONS = [
    "rms_norm_fp32",
    "layer_norm_fp32",
    "add_rms_norm_fp32",
    "add_layer_norm_fp32",
    "fp32_activation",
    "fp32_gated_activation",
    "rotary_embedding",
    "rotary_embedding_pair",
]


def _outputs_and_grads(name: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """The call's outputs, its leaves' gradients (of the outputs weighted by a ramp) and its
    autograd nodes, from fixed seeds."""
    torch.manual_seed(0)
    outputs = FUSED_CALLS[name]()
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    nodes = _autograd_nodes(tuple(outputs))
    # The two paths' graphs list the leaves in different orders: sorted by what they hold.
    leaves = sorted(
        (node.variable for node in nodes if hasattr(node, "variable")),
        key=lambda leaf: (str(leaf.dtype), tuple(leaf.shape), leaf.detach().double().sum().item()),
    )
    loss = sum((t.float() * torch.linspace(-1, 1, t.numel()).view(t.shape)).sum() for t in outputs)
    loss.backward()
    return [t.detach() for t in outputs], [leaf.grad for leaf in leaves], nodes


def _fused_nodes(nodes: list) -> list[str]:
    return [type(node).__name__ for node in nodes if "amp_fx" in type(node).__name__]


@pytest.mark.parametrize("name", EXPRESSION_FUNCTIONS)
def test_an_eager_cpu_call_computes_the_expression_with_the_kernels_values(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    kernel_outputs, kernel_grads, kernel_nodes = _outputs_and_grads(name)
    assert _fused_nodes(kernel_nodes), "the reference kernels ran through no fused autograd node"
    monkeypatch.delenv(FORCE_TRITON_ENV)
    outputs, grads, nodes = _outputs_and_grads(name)
    assert not _fused_nodes(nodes), f"{name} ran its kernels on a CPU: {_fused_nodes(nodes)}"
    rtol, atol = tolerances(BF16)
    for output, expected in zip(outputs, kernel_outputs, strict=True):
        assert type(output) is torch.Tensor and output.dtype == expected.dtype
        assert_close_normwise(output.float(), expected.float(), rtol=rtol, atol=atol, name=f"{name} output")
    rtol, atol = grad_tolerances(BF16)
    assert len(grads) == len(kernel_grads)
    for grad, expected in zip(grads, kernel_grads, strict=True):
        assert grad.dtype == expected.dtype
        assert_close_normwise(grad.float(), expected.float(), rtol=rtol, atol=atol, name=f"{name} grad")


def test_tracers_still_get_the_custom_op_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)

    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return norms.rms_norm_fp32(x, self.weight, 1e-6, out_dtype=BF16)

    exported = torch.export.export(Norm(), (torch.randn(2, 8, dtype=BF16),))
    targets = [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]
    assert any("amp_fx.fused_norm" in target for target in targets), targets


def _tiny_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    pytest.importorskip("transformers")
    return causal_lm_without_dropout("llama", tied=False), torch.randint(0, VOCAB, (2, 8))


def _converted(model: torch.nn.Module) -> torch.nn.Module:
    return amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16)


def _fused_nodes_of_a_step(converted: torch.nn.Module, tokens: torch.Tensor) -> list[str]:
    loss = converted(input_ids=tokens, labels=tokens).loss
    return _fused_nodes(_autograd_nodes((loss,)))


def test_a_converted_llama_trains_the_same_on_the_expressions(monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokens = _tiny_llama()
    monkeypatch.setenv(FORCE_TRITON_ENV, "0")
    converted = _converted(model)
    assert _fused_nodes_of_a_step(converted, tokens), "the graph holds no fused call to compare"
    expected = loss_and_grads(converted, input_ids=tokens, labels=tokens)
    monkeypatch.delenv(FORCE_TRITON_ENV)
    converted = _converted(model)
    # The same graph: the fused calls of its norms, activations and rotary compute their
    # expressions (the head and loss stays a fused op on every device).
    fused = _fused_nodes_of_a_step(converted, tokens)
    assert not [name for name in fused if "norm" in name or "activation" in name or "rotary" in name], fused
    assert_close_to(loss_and_grads(converted, input_ids=tokens, labels=tokens), expected)


def test_a_watch_records_the_expressions_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels record their outputs in their own launch; the expressions' values are recorded
    by the graph's `record_range` calls instead, into the same nodes' slots."""
    model, tokens = _tiny_llama()
    recorded = {}
    for setting in ("0", None):
        if setting is None:
            monkeypatch.delenv(FORCE_TRITON_ENV)
        else:
            monkeypatch.setenv(FORCE_TRITON_ENV, setting)
        converted = _converted(model)
        with amp_fx.watch(converted, every=1) as watch:
            loss_and_grads(converted, input_ids=tokens, labels=tokens)
            recorded[setting] = {(row.graph, row.node): row for row in watch.ranges()}
    assert recorded["0"].keys() == recorded[None].keys()
    norms_seen = 0
    for key, row in recorded[None].items():
        expected = recorded["0"][key]
        norms_seen += "norm" in key[1]
        for direction in ("forward", "backward"):
            ours, theirs = getattr(row, direction), getattr(expected, direction)
            assert (ours.numel, ours.nonfinite) == (theirs.numel, theirs.nonfinite), (key, direction)
            assert ours.amax == pytest.approx(theirs.amax, rel=1e-2), (key, direction)
    assert norms_seen, "no fused norm was watched"
