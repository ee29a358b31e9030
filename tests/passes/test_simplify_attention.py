"""simplify_attention drops SDPA masks proved True everywhere, turns masks proved to be the causal
triangle into ``is_causal=True``, keeps every other mask, and gives SDPA grouped-query key/value
heads unrepeated with ``enable_gqa=True``; the attention output and its gradients are unchanged
(against the same graph before the pass), at the captured size and, for graphs with dynamic
shapes, at other sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_fx.capture.export import call_graph, export_graph
from amp_fx.passes.simplify_attention import SDPA, simplify_attention
from tests.models import hf


class Attention(nn.Module):
    def __init__(self, make_mask) -> None:
        super().__init__()
        self.make_mask = make_mask

    def forward(self, q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask = self.make_mask(q, keep)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask.expand(q.shape[0], 1, -1, -1))


def _positions(q: torch.Tensor) -> torch.Tensor:
    return torch.arange(q.shape[-2], device=q.device) + 0


def _q(q: torch.Tensor) -> torch.Tensor:
    return _positions(q)[:, None]


def _kv(q: torch.Tensor) -> torch.Tensor:
    return _positions(q)[None, :]


def _packed_sequence_ids(q: torch.Tensor) -> torch.Tensor:
    # transformers' packed-sequence detection on position ids that are a plain arange: all zeros.
    positions = _positions(q)[None].expand(q.shape[0], -1)
    step = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)
    return (step != 1).cumsum(-1)


def _same_sequence(q: torch.Tensor) -> torch.Tensor:
    ids, batch = _packed_sequence_ids(q), torch.arange(q.shape[0])[:, None, None, None]
    pos = _positions(q)
    return ids[batch, pos[None, None, :, None]] == ids[batch, pos[None, None, None, :]]


ALL_TRUE = {
    "arange >= 0": lambda q, keep: (_positions(q) >= 0)[None, None, None, :],
    "arange > -1": lambda q, keep: (_positions(q) > -1)[None, None, :, None],
    "new_ones & (arange >= 0)": lambda q, keep: (
        q.new_ones((), dtype=torch.bool) & (_positions(q) >= 0)[None, None, None, :]
    ),
    "(arange >= 0) | keep": lambda q, keep: ((_positions(q) >= 0)[None, :] | keep)[:, None, None, :],
    "not (arange < 0)": lambda q, keep: ~(_positions(q) < 0)[None, None, None, :],
    "same packed sequence": lambda q, keep: _same_sequence(q),
}
CAUSAL = {
    "kv <= q": lambda q, keep: (_kv(q) <= _q(q))[None, None],
    "q >= kv": lambda q, keep: (_q(q) >= _kv(q))[None, None],
    "kv < q + 1": lambda q, keep: (_kv(q) < _q(q) + 1)[None, None],
    "not (kv > q)": lambda q, keep: ~(_kv(q) > _q(q))[None, None],
    "causal & same packed sequence": lambda q, keep: (_kv(q) <= _q(q))[None, None] & _same_sequence(q),
}
KEPT = {
    "padding": lambda q, keep: keep[:, None, None, :],
    "arange >= 1": lambda q, keep: (_positions(q) >= 1)[None, None, None, :],
    "padding & (arange >= 0)": lambda q, keep: (keep & (_positions(q) >= 0)[None, :])[:, None, None, :],
    "kv < q (diagonal masked)": lambda q, keep: (_kv(q) < _q(q))[None, None],
    "kv >= q (upper triangle)": lambda q, keep: (_kv(q) >= _q(q))[None, None],
    "causal & padding": lambda q, keep: (_kv(q) <= _q(q))[None, None] & keep[:, None, None, :],
    "sliding window": lambda q, keep: ((_kv(q) <= _q(q)) & (_kv(q) > _q(q) - 2))[None, None],
    "position ids from input": lambda q, keep: (keep.cumsum(-1)[:, None, :] <= keep.cumsum(-1)[:, :, None])[
        :, None
    ],
}


def _inputs(length: int):
    keep = torch.ones(2, length, dtype=torch.bool)
    keep[1, 2] = False
    return torch.randn(2, 1, length, 8), keep


def _export(make_mask, dynamic: bool = False):
    shapes = None
    if dynamic:
        length = torch.export.Dim("length", min=2, max=64)
        shapes = ({2: length}, {1: length})
    return torch.export.export(Attention(make_mask), _inputs(5), dynamic_shapes=shapes, strict=False).module()


def _sdpa_args(node):
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return mask, causal


def _sdpa(gm):
    (node,) = gm.graph.find_nodes(op="call_function", target=SDPA)
    return _sdpa_args(node)


def _check(make_mask, dynamic: bool, expect_mask: bool, expect_causal: bool) -> None:
    gm = _export(make_mask, dynamic)
    sizes = (5, 3, 9) if dynamic else (5,)
    inputs = [_inputs(n) for n in sizes]
    before = [gm(*i) for i in inputs]
    mask, causal = _sdpa(simplify_attention(gm).graph_module)
    assert (mask is not None, causal) == (expect_mask, expect_causal)
    if not expect_mask:
        assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.arange.default)
    for i, expected in zip(inputs, before, strict=True):
        torch.testing.assert_close(gm(*i), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(ALL_TRUE))
def test_all_true_masks_are_dropped(name, dynamic):
    _check(ALL_TRUE[name], dynamic, expect_mask=False, expect_causal=False)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_masks_become_is_causal(name, dynamic):
    _check(CAUSAL[name], dynamic, expect_mask=False, expect_causal=True)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(KEPT))
def test_other_masks_stay(name, dynamic):
    _check(KEPT[name], dynamic, expect_mask=True, expect_causal=False)


def test_a_window_wider_than_the_sequence_is_causal_at_static_sizes_only():
    # Mistral's sliding window (4096) with a shorter sequence: eagerly transformers then sets
    # is_causal. Only a graph whose sizes are fixed can prove the window changes nothing.
    def wide_window(q, keep):
        return ((_kv(q) <= _q(q)) & (_kv(q) > _q(q) - 16))[None, None]

    _check(wide_window, dynamic=False, expect_mask=False, expect_causal=True)
    _check(wide_window, dynamic=True, expect_mask=True, expect_causal=False)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "vit"])
def test_hugging_face_attention_built_while_traced_is_undone(family):
    # Called without a padding mask, eager transformers passes no mask (causal decoders set
    # is_causal, grouped heads enable_gqa); traced, it materialises one and repeats the key/value
    # heads. The pass gives SDPA back what eager code gives it.
    model, make_inputs = hf.MODELS[family]()
    inputs = make_inputs(2, 6)
    inputs.pop("attention_mask", None)
    model.eval()
    # The default call returns a cache, which amp_fx's capture flattens (containers=True).
    gm = export_graph(model, (), inputs, containers=True)
    before = call_graph(gm, (), inputs)
    simplify_attention(gm)
    nodes = gm.graph.find_nodes(op="call_function", target=SDPA)
    assert nodes and all(_sdpa_args(n) == (None, family != "vit") for n in nodes)
    grouped = family in ("llama", "mistral")  # 4 query heads, 2 key/value heads
    assert all(n.kwargs.get("enable_gqa", False) == grouped for n in nodes)
    heads = [(n.args[0].meta["val"].shape[1], n.args[1].meta["val"].shape[1]) for n in nodes]
    assert all(query == key * (2 if grouped else 1) for query, key in heads)
    with torch.no_grad():
        eager = model(**inputs)
    after = call_graph(gm, (), inputs)
    torch.testing.assert_close(after.logits, eager.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(after.logits, before.logits, rtol=0, atol=1e-5)


class GroupedAttention(nn.Module):
    """Two key/value heads for four query heads, the key/value heads repeated as ``repeat``
    does it, with an optional causal mask."""

    def __init__(self, repeat, causal_mask: bool = False) -> None:
        super().__init__()
        self.repeat, self.causal_mask = repeat, causal_mask

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        k, v = self.repeat(kv), self.repeat(kv * 2)
        mask = (_kv(q) <= _q(q))[None, None] if self.causal_mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.causal_mask)


def _repeat_kv(x: torch.Tensor) -> torch.Tensor:
    b, h, s, d = x.shape  # transformers' repeat_kv: head i becomes heads 2i, 2i + 1
    return x[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)


REPEATS = {
    "repeat_kv": (_repeat_kv, True),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=1), False),  # another spelling: kept
    "tiled (heads 0, 1, 0, 1)": (
        lambda x: x[:, None].expand(x.shape[0], 2, *x.shape[1:]).reshape(x.shape[0], -1, *x.shape[2:]),
        False,
    ),
}


def _grouped_inputs(length: int):
    return torch.randn(2, 4, length, 8, requires_grad=True), torch.randn(2, 2, length, 8, requires_grad=True)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("causal_mask", [False, True], ids=["is_causal", "causal mask"])
@pytest.mark.parametrize("name", sorted(REPEATS))
def test_repeated_key_value_heads_become_enable_gqa(name, causal_mask, dynamic):
    repeat, recognised = REPEATS[name]
    shapes = None
    if dynamic:
        length = torch.export.Dim("length", min=2, max=64)
        shapes = ({2: length}, {2: length})
    gm = torch.export.export(
        GroupedAttention(repeat, causal_mask), _grouped_inputs(5), dynamic_shapes=shapes, strict=False
    ).module()
    inputs = [_grouped_inputs(n) for n in ((5, 3, 9) if dynamic else (5,))]
    before = [torch.autograd.functional.vjp(gm, i, torch.ones(2, 4, i[0].shape[2], 8)) for i in inputs]
    (node,) = simplify_attention(gm).graph_module.graph.find_nodes(op="call_function", target=SDPA)
    assert node.kwargs.get("enable_gqa", False) == recognised
    assert (node.args[1].meta["val"].shape[1] == 2) == recognised
    for i, expected in zip(inputs, before, strict=True):
        got = torch.autograd.functional.vjp(gm, i, torch.ones(2, 4, i[0].shape[2], 8))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


class BiasedAttention(nn.Module):
    """A learned (heads, q, kv) bias folded into the mask as transformers'
    ``create_position_bias_mask`` does: ``where(mask, bias, min)``, the mask expanded over the
    batch as traced transformers builds it, or not (``expand=False``) as eager code does."""

    def __init__(self, make_mask, expand: bool = True) -> None:
        super().__init__()
        self.make_mask, self.expand = make_mask, expand
        self.bias = nn.Parameter(torch.randn(1, 2, 1, 1) * torch.randn(9, 9))

    def forward(self, q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask = self.make_mask(q, keep)
        if self.expand:
            mask = mask.expand(q.shape[0], 1, -1, -1)
        n = q.shape[-2]
        combined = torch.where(mask, self.bias[:, :, :n, :n], torch.finfo(torch.bfloat16).min)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=combined.contiguous())


def _biased_inputs(length: int):
    keep = torch.ones(4, length, dtype=torch.bool)
    keep[1, 2] = False
    return torch.randn(4, 2, length, 8, requires_grad=True), keep


def _bias_gradient(model: nn.Module, q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        out = model(q, keep)
    (grad,) = torch.autograd.grad(out.float().sin().sum(), [p for p in model.parameters()])
    return grad


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize(
    "name, unexpanded",
    [("kv <= q", True), ("not (kv > q)", True), ("arange >= 0", True), ("padding", False)],
)
def test_a_bias_folded_into_a_proved_mask_gets_it_unexpanded(name, unexpanded, dynamic):
    # Under autocast the bias's gradient is summed over the batch by SDPA's backward when the mask
    # is not expanded (eager), by the where's backward after a rounding when it is (traced): the
    # graph gets eager's mask and autocast's bits; a mask that reads an input stays.
    make_mask = {**CAUSAL, **ALL_TRUE, **KEPT}[name]
    torch.manual_seed(0)
    eager = BiasedAttention(make_mask, expand=False)
    traced = BiasedAttention(make_mask)
    traced.load_state_dict(eager.state_dict())
    shapes = None
    if dynamic:
        length = torch.export.Dim("length", min=2, max=8)
        shapes = ({2: length}, {1: length})
    gm = torch.export.export(traced, _biased_inputs(5), dynamic_shapes=shapes, strict=False).module()
    simplify_attention(gm)
    (where,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.where.ScalarOther)
    assert (where.meta["val"].shape[0] == 1) == unexpanded
    for length in (5, 3, 7) if dynamic else (5,):
        q, keep = _biased_inputs(length)
        expected = _bias_gradient(eager if unexpanded else traced, q, keep)
        assert torch.equal(_bias_gradient(gm, q, keep), expected)
