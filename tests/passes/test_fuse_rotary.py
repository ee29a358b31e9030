"""fuse_rotary: rotary position embeddings become one `rotary_embedding` call at O2, found by what
they compute in graphs of both front ends; near misses are left alone.

References: the same conversion with ``fused_rotary=False`` (the torch chain: the fused call must
agree with it within the low dtype's tolerances, closer where the chain runs in fp32), and for the
Hugging Face models torch.autocast (O2 within the suite's tolerances, O1 bit for bit and unfused).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.capture.captured_model import capture_states
from amp_fx.core.node_info import node_info
from amp_fx.ops.rotary import rotary_embedding, rotary_embedding_pair
from amp_fx.testing import grad_tolerances, tolerances, with_autocast
from amp_fx.testing.comparison import assert_close_normwise
from tests.bit_equality import bits_equal

BF16 = torch.bfloat16
HEADS, SEQ, DIM = 3, 5, 8
OUTPUT_TOL = dict(zip(("rtol", "atol"), tolerances(BF16), strict=True))
GRAD_TOL = dict(zip(("rtol", "atol"), grad_tolerances(BF16), strict=True))


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def rotate_chunks(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate_split(x):
    first, second = torch.split(x, x.size(-1) // 2, dim=-1)
    return torch.cat([-second, first], -1)


def rotate_split_sizes(x):
    half = x.shape[-1] // 2
    first, second = torch.split(x, [half, half], dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


# Near misses: each computes something else than a rotation (or is read elsewhere).
def wrong_sign(x):
    return torch.cat((x[..., x.shape[-1] // 2 :], -x[..., : x.shape[-1] // 2]), dim=-1)


def wrong_order(x):
    return torch.cat((x[..., : x.shape[-1] // 2], -x[..., x.shape[-1] // 2 :]), dim=-1)


def wrong_slice(x):
    return torch.cat((-x[..., x.shape[-1] // 4 :], x[..., : x.shape[-1] // 4]), dim=-1)


def wrong_step(x):
    return torch.stack((-x[..., 1::2], x[..., 1::2]), dim=-1).flatten(-2)


def negated_in_place(x):  # neg_ of a view negates x's second half too, before x * cos reads it
    return torch.cat((x[..., x.shape[-1] // 2 :].neg_(), x[..., : x.shape[-1] // 2]), dim=-1)


class Rope(nn.Module):
    """q and k projections rotated as Llama writes it; ``rotary_dim`` rotates the first features only."""

    def __init__(self, rotate=rotate_half, rotary_dim=None, leak=False, mix=False, one_angle=False) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, HEADS * DIM), nn.Linear(16, DIM)
        self.rotate, self.rotary_dim, self.leak, self.mix = rotate, rotary_dim, leak, mix
        self.one_angle = one_angle  # cos and sin of width 1, broadcast over the features

    def rotate_all(self, x, cos, sin, other):
        turned = self.rotate(other if self.mix else x)
        return x * cos + turned * sin, turned

    def embed(self, x, cos, sin, other):
        if self.rotary_dim is None:
            return self.rotate_all(x, cos, sin, other)
        r = self.rotary_dim
        rotated, turned = self.rotate_all(x[..., :r], cos, sin, other[..., :r] if self.mix else None)
        return torch.cat((rotated, x[..., r:]), dim=-1), turned

    def forward(self, h, cos, sin):
        b, s, _ = h.shape
        q = self.q(h).view(b, s, HEADS, DIM).transpose(1, 2)
        k = self.k(h).view(b, s, 1, DIM).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.one_angle:
            cos, sin = cos[..., :1], sin[..., :1]
        q, turned = self.embed(q, cos, sin, k)
        k, _ = self.embed(k, cos, sin, q)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k)
        return out + turned.sum() if self.leak else out


def inputs(rotary_width=DIM, seed=0):
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(2, SEQ, 16, generator=generator)
    angles = torch.randn(2, SEQ, rotary_width // 2, generator=generator)
    angles = torch.cat((angles, angles), -1)
    return h, angles.cos(), angles.sin()


def fused_calls(model) -> list[torch.fx.Node]:
    graphs = [model.graph] if isinstance(model, torch.fx.GraphModule) else [
        graph.graph for _, state in capture_states(model) for graph in state.graphs
    ]  # fmt: skip
    calls = [n for g in graphs for n in g.nodes if n.op == "call_function"]
    single = [n for n in calls if n.target is rotary_embedding]
    pairs = [n for n in calls if n.target is rotary_embedding_pair]
    return single + [output for pair in pairs for output in pair.users]


def check_against_unfused(model, args, expected_calls, front_end="fx") -> None:
    """Convert at O2 with and without the fusion (captured by ``front_end``); the fused model has
    ``expected_calls`` rotary calls and agrees with the chain in outputs and input gradients."""
    torch.manual_seed(0)
    fused = amp_fx.convert(model, "O2", dtype=BF16, front_end=front_end)
    policy = amp_fx.preset("O2", BF16, fused_rotary=False)
    unfused = amp_fx.convert(model, policy=policy, front_end=front_end)
    leaves = [a.clone().requires_grad_(True) for a in args]
    out = fused(*leaves)
    out.float().pow(2).sum().backward()
    reference_leaves = [a.clone().requires_grad_(True) for a in args]
    expected = unfused(*reference_leaves)
    expected.float().pow(2).sum().backward()
    assert len(fused_calls(fused)) == expected_calls
    assert not fused_calls(unfused)
    assert type(out) is torch.Tensor
    assert_close_normwise(out.float(), expected.float(), **OUTPUT_TOL)
    for ours, theirs in zip(leaves, reference_leaves, strict=True):
        assert_close_normwise(ours.grad, theirs.grad, **GRAD_TOL)


@pytest.mark.parametrize(
    "rotate", [rotate_half, rotate_chunks, rotate_split, rotate_split_sizes, rotate_every_two]
)
def test_fx_spellings_fuse(rotate) -> None:
    check_against_unfused(Rope(rotate), inputs(), expected_calls=2)


@pytest.mark.parametrize("rotate", [rotate_half, rotate_every_two])
def test_fx_partial_rotary_fuses_whole(rotate) -> None:
    model = Rope(rotate, rotary_dim=4)
    check_against_unfused(model, inputs(rotary_width=4), expected_calls=2)
    query, key = fused_calls(amp_fx.convert(model, "O2", dtype=BF16))
    pair = query.args[0]  # q and k share cos and sin: one call for both
    assert pair.target is rotary_embedding_pair and key.args[0] is pair
    assert pair.kwargs["rotary_dim"] == 4 and [a.name for a in pair.args[:2]] == ["transpose", "transpose_1"]
    assert "first 4 features rotated" in node_info(query).notes[0]


@pytest.mark.parametrize(
    "model",
    [
        Rope(wrong_sign),
        Rope(wrong_order),
        Rope(wrong_slice),
        Rope(wrong_step),
        Rope(negated_in_place),
        Rope(mix=True),  # q * cos + rotate_half(k) * sin
    ],
    ids=["sign", "order", "slice", "step", "in-place", "other-tensor"],
)
def test_fx_near_misses_are_left_alone(model) -> None:
    check_against_unfused(model, inputs(), expected_calls=0)


@pytest.mark.parametrize(
    ("model", "calls"),
    [
        (Rope(rotate_half), 2),
        (Rope(rotate_chunks), 2),
        (Rope(rotate_split_sizes), 2),
        (Rope(rotate_every_two, rotary_dim=4), 2),
        (Rope(wrong_sign), 0),
        (Rope(wrong_slice), 0),
        (Rope(leak=True), 1),
        (Rope(one_angle=True), 0),
    ],
    ids=[
        "rotate_half",
        "chunks",
        "split-sizes",
        "interleaved-partial",
        "sign",
        "slice",
        "intermediate-read",
        "tables",
    ],
)
def test_export_front_end_spellings_and_near_misses(model, calls) -> None:
    # torch.export's ATen graph: aten.slice/split with static bounds and shapes known, so cos and
    # sin that do not fit the kernel (width 1) leave the chain alone at convert time.
    width = 4 if model.rotary_dim else DIM
    check_against_unfused(model, inputs(rotary_width=width), expected_calls=calls, front_end="export")


def test_fx_tables_that_do_not_fit_run_the_chain() -> None:
    # Without shapes the fx graph is fused; the call sees width-1 tables and computes the chain.
    check_against_unfused(Rope(one_angle=True), inputs(), expected_calls=2)


def test_fx_chain_read_elsewhere_is_left_alone() -> None:
    # rotate_half(q) is read by the output too: q's chain stays, k's (read nowhere else) fuses.
    check_against_unfused(Rope(leak=True), inputs(), expected_calls=1)


def test_o1_and_switch_off_leave_chains() -> None:
    model = Rope()
    assert not fused_calls(amp_fx.convert(model, "O1", dtype=BF16))
    assert amp_fx.preset("O2").fused_rotary and not amp_fx.preset("O1").fused_rotary
    assert amp_fx.preset("O2", device_type="cpu").fused_rotary


# Converts a rotary embedding at O2 on both front ends with shapes known (the pass then asks
# whether the tables fit the kernels), runs each on the CPU, and reports the amp_fx Triton modules
# then loaded and the fused custom op's calls; saves the outputs and the unfused conversion's.
_CONVERT_IN_A_FRESH_PROCESS = """
import json, sys, torch, amp_fx
from torch.utils._python_dispatch import TorchDispatchMode

class Rope(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)
    def forward(self, h, cos, sin):
        q = self.q(h)
        half = q.shape[-1] // 2
        return q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin

class Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))

torch.manual_seed(0)
model, h = Rope(), torch.randn(2, 5, 16)
angles = torch.randn(5, 8).repeat(1, 2)
args = (h, angles.cos(), angles.sin())
unfused = amp_fx.preset("O2", torch.bfloat16, fused_rotary=False)
results, calls = {}, {}
for front_end in ("fx", "export"):
    options = {"example_inputs": args} if front_end == "fx" else {}
    converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16, front_end=front_end, **options)
    converted(*args)  # the torch.export front end captures at the first call
    with Calls() as seen:
        out = converted(*args)
    calls[front_end] = seen.names
    expected = amp_fx.convert(model, policy=unfused, front_end=front_end, **options)(*args)
    results[front_end] = (out, expected)
torch.save(results, sys.argv[1])
triton = sorted(m for m in sys.modules if m.startswith("amp_fx.kernels") and "triton" in m)
print(json.dumps({"triton_modules": triton, "calls": calls}))
"""


def test_converting_and_running_on_cpu_loads_no_triton_kernels(tmp_path) -> None:
    """The pass asks the kernels' argument checks whether tables fit; neither that nor convert
    may load amp_fx's Triton kernels (nor need Triton): they are chosen when a call runs, and a CPU
    call runs the reference. The converted model still runs the fused op, with the chain's value."""
    env = {k: v for k, v in os.environ.items() if k != "AMP_FX_FORCE_TRITON"}
    saved = tmp_path / "outputs.pt"
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT_IN_A_FRESH_PROCESS, str(saved)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["triton_modules"] == []
    for front_end, (out, expected) in torch.load(saved).items():
        assert report["calls"][front_end].count("amp_fx.rotary_embedding.default") == 1, front_end
        assert type(out) is torch.Tensor
        assert_close_normwise(out.float(), expected.float(), **OUTPUT_TOL)


transformers = pytest.importorskip("transformers")


def _hf(name: str) -> nn.Module:
    common = {"vocab_size": 64, "max_position_embeddings": 32}
    if name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, **common,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    if name == "phi":  # partial rotary: 4 of 8 features
        config = transformers.PhiConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            partial_rotary_factor=0.5, **common,
        )  # fmt: skip
        return transformers.PhiForCausalLM(config)
    # GPT-J: interleaved pairs, partial (rotary_dim 4 of 8), heads third
    config = transformers.GPTJConfig(
        n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, vocab_size=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPTJForCausalLM(config)


@pytest.mark.parametrize(("name", "pairs"), [("llama", 2), ("phi", 2), ("gptj", 0)])
def test_hugging_face_models_fuse_at_o2_and_match_autocast(name, pairs) -> None:
    # GPT-J computes its tables (repeat_interleave) once for q and once for k: no shared node to pair on.
    torch.manual_seed(0)
    model = _hf(name)
    ids = torch.randint(0, 64, (2, 8))
    reference = with_autocast(model, "cpu", BF16)(input_ids=ids, labels=ids)
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    out = converted(input_ids=ids, labels=ids)
    assert type(out.loss) is torch.Tensor
    calls = fused_calls(converted)
    assert len(calls) == 4  # q and k of each of the 2 layers
    assert len({c.args[0] for c in calls if c.target is not rotary_embedding}) == pairs
    assert all("fused rotary embedding" in node_info(c).notes[0] for c in calls)
    assert all(": replaces " in node_info(c).notes[0] for c in calls)  # names the nodes it replaced
    assert out.logits is None  # training with labels=: the head and loss run chunked at O2
    assert_close_normwise(out.loss, reference.loss.float(), **OUTPUT_TOL)
    out.loss.backward()
    assert all(p.grad is not None for p in converted.parameters() if p.requires_grad and p.dim() == 2)


def test_hugging_face_o1_is_unfused_and_bit_equal_to_autocast() -> None:
    torch.manual_seed(0)
    model = _hf("llama")
    ids = torch.randint(0, 64, (2, 8))
    reference = with_autocast(model, "cpu", BF16)(input_ids=ids, labels=ids)
    converted = amp_fx.convert(model, "O1", dtype=BF16)
    out = converted(input_ids=ids, labels=ids)
    assert not fused_calls(converted)
    assert bits_equal(out.logits, reference.logits) and bits_equal(out.loss, reference.loss)
