"""Fused ops' outputs can be modified in place by the next op, forward and backward (issue 38).

A fused op computes into the kernels' (rows, width) buffers and gives them the caller's shape;
autograd refuses in-place ops on a view returned by a custom Function, so ``nn.Hardswish(inplace=
True)`` after a fused LayerNorm failed in backward. Every fused kind an O2 conversion makes (norms
with and without the residual add, activations alone and gated, rotary q and k, the language-model
head and loss, BatchNorm + ReLU, max-pool) is followed here by each in-place op torch has, on both
front ends, and the loss and gradients are compared with torch.autocast running the same model
with the in-place op applied to a copy (what the unfused chain's output allows).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.ops import activations, batch_norm, chunked_cross_entropy, cross_entropy, max_pool, norms, rotary
from tests.passes.test_fuse_activations import new_gelu
from tests.passes.test_fuse_norms import assert_close_to, loss_and_grads
from tests.passes.test_fuse_rotary import rotate_half

BF16 = torch.bfloat16
WIDTH, HEADS, DIM, SEQ, VOCAB = 16, 2, 8, 3, 11


def _method(name, *args):
    return lambda x: getattr(x, name)(*args)


def _setitem(x):
    index = (..., slice(None, 1)) if x.dim() else ()  # the first feature; a loss whole
    x[index] = x[index] * 0.5 + 1.0
    return x


def _iadd(x):
    x += 1.0
    return x


# Each in-place op torch has as a module or functional flag, and tensor in-place methods.
IN_PLACE = {
    "ReLU": nn.ReLU(inplace=True),
    "ReLU6": nn.ReLU6(inplace=True),
    "Hardswish": nn.Hardswish(inplace=True),
    "Hardsigmoid": nn.Hardsigmoid(inplace=True),
    "SiLU": nn.SiLU(inplace=True),
    "ELU": nn.ELU(inplace=True),
    "SELU": nn.SELU(inplace=True),
    "CELU": nn.CELU(inplace=True),
    "LeakyReLU": nn.LeakyReLU(0.1, inplace=True),
    "Hardtanh": nn.Hardtanh(inplace=True),
    "Mish": nn.Mish(inplace=True),
    "Threshold": nn.Threshold(0.1, -1.0, inplace=True),
    "RReLU eval": nn.RReLU(inplace=True).eval(),
    "F.dropout": lambda x: F.dropout(x, 0.5, training=True, inplace=True),
    "add_": _method("add_", 1.0),
    "mul_": _method("mul_", 2.0),
    "clamp_": _method("clamp_", -0.5, 0.5),
    "tanh_": _method("tanh_"),
    "+=": _iadd,
    "setitem": _setitem,
}


class Mutate(nn.Module):
    """The in-place op, or (``copy=True``, the reference) the op applied to a copy."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.copy = op, False

    def forward(self, x):
        return self.op(x.clone() if self.copy else x)


class Transformer(nn.Module):
    """A decoder block in which each fused op's output is mutated in place by ``op``."""

    def __init__(self, op) -> None:
        super().__init__()
        self.mutate = Mutate(op)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.ln, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.o = (
            nn.Linear(WIDTH, HEADS * DIM),
            nn.Linear(WIDTH, DIM),
            nn.Linear(HEADS * DIM, WIDTH),
        )
        self.gate, self.up, self.down = nn.Linear(WIDTH, 32), nn.Linear(WIDTH, 32), nn.Linear(32, WIDTH)
        self.fc, self.fc2 = nn.Linear(WIDTH, 32), nn.Linear(32, WIDTH)
        self.rms_weight = nn.Parameter(1 + 0.1 * torch.randn(WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def rms_norm(self, h):  # Llama's
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.rms_weight * x.to(h.dtype)

    def forward(self, ids, cos, sin, targets):
        h = self.embed(ids)
        n = self.mutate(self.ln(h))  # LayerNorm
        b, s, _ = n.shape
        q = self.q(n).view(b, s, HEADS, DIM).transpose(1, 2)
        k = self.k(n).view(b, s, 1, DIM).transpose(1, 2)
        q = self.mutate(q * cos + rotate_half(q) * sin)  # rotary, q and k
        k = self.mutate(k * cos + rotate_half(k) * sin)
        attention = F.scaled_dot_product_attention(q, k, k).transpose(1, 2).reshape(b, s, HEADS * DIM)
        h = h + self.o(attention)
        n = self.mutate(self.ln2(h))  # the residual add and LayerNorm
        h = h + self.down(self.mutate(F.silu(self.gate(n)) * self.up(n)))  # gated activation
        # The activation alone fuses only where its result is cast right away, so not before an
        # in-place op (which reads the float32 result): test_fused_functions_... covers it.
        h = h + self.fc2(new_gelu(self.fc(n)))
        n = self.mutate(self.rms_norm(h))  # RMSNorm
        loss = F.cross_entropy(self.head(n).view(-1, VOCAB), targets.view(-1))  # the head
        return self.mutate(loss)


def _transformer_inputs():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    angles = torch.randn(2, 1, SEQ, DIM // 2, generator=generator)
    angles = torch.cat((angles, angles), -1)
    return ids, angles.cos(), angles.sin(), torch.randint(0, VOCAB, (2, SEQ), generator=generator)


def _fused_targets(model: nn.Module) -> list[str]:
    return sorted(
        getattr(n.target, "__name__", str(n.target))
        for gm in amp_fx.report(model).graphs.values()
        for n in gm.graph.nodes
        if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("amp_fx.ops")
    )


def _check(model: nn.Module, args: tuple, front_end: str, **flags) -> list[str]:
    """Converts ``model`` at O2 and checks its loss and gradients with the in-place ops against
    autocast's with the ops on copies; returns the fused calls it made and the converted model."""
    policy = amp_fx.preset("O2", BF16, "cpu", **flags)
    converted = amp_fx.convert(copy.deepcopy(model), policy=policy, front_end=front_end)
    ours = loss_and_grads(converted, *args)
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, Mutate):
            module.copy = True
    assert_close_to(ours, loss_and_grads(amp_fx.testing.with_autocast(reference, "cpu", BF16), *args))
    return _fused_targets(converted), converted


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("op", IN_PLACE.values(), ids=IN_PLACE.keys())
def test_transformer_fused_ops_are_safe_to_mutate_after(op, front_end: str) -> None:
    torch.manual_seed(0)
    fused, _ = _check(Transformer(op), _transformer_inputs(), front_end)
    norms_and_more = {"layer_norm_fp32", "add_layer_norm_fp32", "add_rms_norm_fp32"}
    assert norms_and_more | {"fp32_gated_activation", "rotary_embedding_pair"} <= set(fused)
    assert {"fp32_cross_entropy", "chunked_linear_cross_entropy"} & set(fused)


class LinearHead(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.mutate, self.embed, self.head = Mutate(op), nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, targets):
        return self.mutate(F.cross_entropy(self.head(self.embed(ids)).view(-1, VOCAB), targets.view(-1)))


class ConvNet(nn.Module):
    """BatchNorm + ReLU and a max-pool (fused at O2 on CUDA, here by the policy's flags), each
    mutated in place. (After a BatchNorm + add + ReLU, as after torch's ReLU, an in-place op breaks
    the backward: both keep their output for it.)"""

    def __init__(self, op) -> None:
        super().__init__()
        self.mutate, self.conv, self.bn = Mutate(op), nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = self.mutate(F.relu(self.bn(self.conv(x))))
        return self.conv2(self.mutate(F.max_pool2d(y, 2)))


# Representatives of IN_PLACE for the slower conversions (test_fused_functions_... takes each).
SOME_IN_PLACE = {name: IN_PLACE[name] for name in ("ReLU", "Hardswish", "F.dropout", "add_", "setitem")}


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("op", SOME_IN_PLACE.values(), ids=SOME_IN_PLACE.keys())
def test_linear_head_is_safe_to_mutate_after(op, front_end: str) -> None:
    torch.manual_seed(0)
    args = _transformer_inputs()[::3]
    flags = {"fused_linear_loss": True, "fused_chunked_linear_loss": False}
    fused, _ = _check(LinearHead(op), args, front_end, **flags)
    assert "linear_cross_entropy" in fused


# The export front end leaves BatchNorm modules unfused (and torch's ReLU keeps its output).
@pytest.mark.parametrize("front_end", ["fx"])
@pytest.mark.parametrize("op", SOME_IN_PLACE.values(), ids=SOME_IN_PLACE.keys())
def test_batch_norm_and_max_pool_are_safe_to_mutate_after(op, front_end: str) -> None:
    torch.manual_seed(0)
    model = ConvNet(op).to(memory_format=torch.channels_last)
    images = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    fused, converted = _check(model, (images,), front_end, fused_batch_norm=True, fused_max_pool=True)
    assert "max_pool2d" in fused
    assert any(isinstance(m, batch_norm.FusedBatchNormAct) for m in converted.modules())


# ---- each fused function and custom op, called directly -----------------------------------------


def _leaf(*shape, dtype=BF16, channels_last=False):
    x = torch.randn(*shape, dtype=torch.float32).to(dtype)
    return (x.to(memory_format=torch.channels_last) if channels_last else x).requires_grad_()


def _vector(width=8):
    return (1 + 0.1 * torch.randn(width)).requires_grad_()


def _tables():
    angles = torch.randn(3, 4)
    angles = torch.cat((angles, angles), -1)
    return angles.cos(), angles.sin()


def _targets(rows=6, classes=5):
    return torch.randint(0, classes, (rows,))


# name -> a call of a fused function (or its custom op) on fresh leaves, returning its outputs.
FUSED_CALLS = {
    "rms_norm_fp32": lambda: norms.rms_norm_fp32(_leaf(2, 3, 8), _vector(), 1e-6),
    "layer_norm_fp32": lambda: norms.layer_norm_fp32(_leaf(2, 3, 8), (8,), _vector(), _vector()),
    "add_rms_norm_fp32": lambda: norms.add_rms_norm_fp32(
        _leaf(2, 3, 8), _leaf(2, 3, 8, dtype=torch.float32), _vector(), 1e-6, out_dtype=BF16
    )[1],
    "add_layer_norm_fp32": lambda: norms.add_layer_norm_fp32(
        _leaf(3, 8), _leaf(3, 8, dtype=torch.float32), (8,), _vector(), _vector()
    )[1],
    "fp32_activation": lambda: activations.fp32_activation(_leaf(2, 3, 8), "gelu_tanh"),
    "fp32_gated_activation": lambda: activations.fp32_gated_activation(_leaf(2, 3, 8), _leaf(2, 3, 8)),
    "amp_fx::activation": lambda: activations.fused_activation(_leaf(2, 3, 8), "gelu"),
    "amp_fx::gated_activation": lambda: activations.fused_gated_activation(
        _leaf(2, 3, 8), _leaf(2, 3, 8), "silu"
    ),
    "rotary_embedding": lambda: rotary.rotary_embedding(_leaf(2, 2, 3, 8), *_tables(), dtype=BF16),
    "rotary_embedding_pair": lambda: rotary.rotary_embedding_pair(
        _leaf(2, 2, 3, 8), _leaf(2, 1, 3, 8), *_tables(), dtypes=(BF16, torch.float32)
    ),
    "fp32_cross_entropy": lambda: cross_entropy.fp32_cross_entropy(_leaf(6, 5), _targets(), reduction="none"),
    "linear_cross_entropy": lambda: cross_entropy.linear_cross_entropy(
        _leaf(2, 3, 4), _leaf(5, 4), _leaf(5), _targets().view(2, 3), reduction="none"
    ),
    "amp_fx::linear_cross_entropy_rows": lambda: cross_entropy.linear_cross_entropy_rows(
        _leaf(6, 4), _leaf(5, 4), None, _targets(), -100
    )[0],
    "chunked_linear_cross_entropy": lambda: chunked_cross_entropy.chunked_linear_cross_entropy(
        _leaf(6, 4), _leaf(5, 4), None, _targets(), chunk_rows=4
    ),
    "batch_norm_act": lambda: batch_norm.batch_norm_act(
        _leaf(2, 4, 3, 3, channels_last=True), _vector(4), _vector(4), None, None, 0.1, 1e-5
    ),
    "amp_fx::batch_norm_act_forward": lambda: batch_norm.batch_norm_act_forward(
        _leaf(2, 4, 3, 3, channels_last=True), _vector(4), _vector(4), None, 1e-5, True
    )[0],
    "max_pool2d": lambda: max_pool.max_pool2d(_leaf(2, 4, 4, 4, channels_last=True), 2),
    "amp_fx::max_pool2d_forward": lambda: max_pool.max_pool2d_forward(
        _leaf(2, 4, 4, 4, channels_last=True), [2, 2], [2, 2], [0, 0], [1, 1], False
    )[0],
}

# The autograd nodes of amp_fx's fused ops: a call that fell back to torch ops has none.
_FUSED_NODE = ("amp_fx", "_Fused", "_BatchNormAct", "_MaxPool2d")


def _autograd_nodes(outputs: tuple[torch.Tensor, ...]) -> list:
    """Every node of the outputs' autograd graph."""
    seen, stack = {}, [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = node
            stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen.values())


def _mutated_loss_and_grads(call, op, on_copy: bool):
    """The loss and leaf gradients of ``call``'s outputs, each modified by ``op`` (on a copy)."""
    torch.manual_seed(0)
    outputs = call()
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    nodes = _autograd_nodes(outputs)
    assert any(fused in type(node).__name__ for node in nodes for fused in _FUSED_NODE)
    leaves = [node.variable for node in nodes if hasattr(node, "variable")]
    torch.manual_seed(1)
    mutated = [op(t.clone() if on_copy else t) for t in outputs]
    loss = sum((m.float() * torch.linspace(-1, 1, m.numel()).view(m.shape)).sum() for m in mutated)
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


@pytest.fixture(autouse=True)
def fuse_every_size(monkeypatch):
    """The fused BatchNorm and max-pool run at these sizes too (by default only large ones)."""
    monkeypatch.setattr(batch_norm, "MIN_FUSED_ELEMENTS", 0)
    monkeypatch.setattr(max_pool, "MIN_FUSED_ELEMENTS", 0)


@pytest.mark.parametrize("op", IN_PLACE.values(), ids=IN_PLACE.keys())
@pytest.mark.parametrize("call", FUSED_CALLS.values(), ids=FUSED_CALLS.keys())
def test_fused_functions_are_safe_to_mutate_after(call, op) -> None:
    # The same values and gradients as with the op applied to a copy, bit for bit.
    ours, expected = _mutated_loss_and_grads(call, op, False), _mutated_loss_and_grads(call, op, True)
    assert torch.equal(ours[0], expected[0])
    assert len(ours[1]) == len(expected[1]) > 0
    for grad, expected_grad in zip(ours[1], expected[1], strict=True):
        assert type(grad) is torch.Tensor and torch.equal(grad, expected_grad)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("call", FUSED_CALLS.values(), ids=FUSED_CALLS.keys())
def test_triton_outputs_are_safe_to_mutate_after(call, monkeypatch) -> None:
    # AMP_FX_FORCE_TRITON=1 runs the Triton kernels on CPU tensors, under the interpreter.
    monkeypatch.setenv("AMP_FX_FORCE_TRITON", "1")
    op = IN_PLACE["Hardswish"]
    ours, expected = _mutated_loss_and_grads(call, op, False), _mutated_loss_and_grads(call, op, True)
    assert torch.equal(ours[0], expected[0])
    for grad, expected_grad in zip(ours[1], expected[1], strict=True):
        assert torch.equal(grad, expected_grad)
