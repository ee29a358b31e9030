"""torch.compile of converted models: no graph breaks from amp_fx, and the same training as eager.

On CPU the compiled runs use the ``aot_eager`` backend (Dynamo's capture plus AOTAutograd's joint
forward/backward graph, without Inductor's C++ code generation, which takes minutes here); the
GPU test compiles with Inductor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.optim import master_params
from amp_fx.testing import assert_close_normwise, grad_tolerances, tolerances

VOCAB, SEQ, D_MODEL, HEADS, BATCH = 32, 8, 32, 4, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, D_MODEL))


class TinyLM(nn.Module):
    """Embedding, two pre-LayerNorm blocks and a head. The first block's attention is written out
    (scaled_dot_product_attention), the second's is nn.MultiheadAttention, which amp_fx keeps as an
    opaque node (inside an autocast island at O1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.torch_attn = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
        self.ln3 = nn.LayerNorm(D_MODEL)
        self.fc1 = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.fc2 = nn.Linear(4 * D_MODEL, D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        x = x + self.torch_attn(h, h, h, need_weights=False)[0]
        x = x + self.fc2(F.gelu(self.fc1(self.ln3(x))))
        return self.head(x)


def make_model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return TinyLM().to(device)


def make_batches(steps: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(steps)]
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def graph_breaks(model: nn.Module, tokens: torch.Tensor) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(tokens)
    return explanation.graph_break_count, [str(reason.reason) for reason in explanation.break_reasons]


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_converted_model_compiles_without_graph_breaks(opt_level: str) -> None:
    model = make_model("cpu")
    tokens = make_batches(1, "cpu")[0][0]
    original_breaks, _ = graph_breaks(model, tokens)
    assert original_breaks == 0, "the test model itself must compile as one graph"
    converted = amp_fx.convert(model, opt_level, dtype=torch.bfloat16)
    breaks, reasons = graph_breaks(converted, tokens)
    assert breaks == 0, f"amp_fx introduced graph breaks: {reasons}"


def train(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """O2 training with FusedSGD and (for fp16) a LossScaler; returns losses and the FP32 masters'
    updates (master - its initial value).

    SGD, not Adam: Adam's update m / sqrt(v) turns rounding noise in a near-zero gradient into a
    full step of either sign, so Inductor's fused kernels (another rounding than eager's) would
    make the weights differ by more than the model's precision says.
    """
    optimizer = amp_fx.optim.FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
    initial = [m.detach().clone() for m in master_params(optimizer)]
    scaler = amp_fx.LossScaler(init_scale=2.0**10, enabled=dtype == torch.float16)
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.detach())
    return losses, [m.detach() - w0 for m, w0 in zip(master_params(optimizer), initial, strict=True)]


def check_compiled_training_matches_eager(device: str, dtype: torch.dtype, backend: str, steps: int) -> None:
    batches = make_batches(1, device) * steps  # one batch, memorized: the loss must fall
    eager_losses, eager_updates = train(amp_fx.convert(make_model(device), "O2", dtype=dtype), batches, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(
        amp_fx.convert(make_model(device), "O2", dtype=dtype), backend=backend, fullgraph=True
    )
    losses, updates = train(compiled, batches, dtype)
    rtol, atol = tolerances(dtype)
    assert_close_normwise(torch.stack(losses), torch.stack(eager_losses), rtol=rtol, atol=atol, name="losses")
    # The updates, each against its own size: a few steps move a weight by well under its fp16
    # tolerance (the embedding by 0.6% in six steps), so comparing whole weights would pass a
    # compiled copy whose embedding and LayerNorms never got a gradient.
    update_rtol, _ = grad_tolerances(dtype)
    for i, (actual, expected) in enumerate(zip(updates, eager_updates, strict=True)):
        assert expected.any(), f"master {i} did not move in eager training: nothing to compare"
        assert_close_normwise(actual, expected, rtol=update_rtol, atol=0.0, name=f"update of master {i}")
    assert eager_losses[-1] < eager_losses[0], "the comparison is only meaningful if the model trains"


def test_compiled_o2_trains_like_eager_on_cpu() -> None:
    # fp16, so that the LossScaler is part of the compiled training too.
    check_compiled_training_matches_eager("cpu", torch.float16, backend="aot_eager", steps=6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_inductor_compiled_o2_trains_like_eager_on_gpu(dtype: torch.dtype) -> None:
    check_compiled_training_matches_eager("cuda", dtype, backend="inductor", steps=10)


@pytest.mark.gpu
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_converted_model_compiles_without_graph_breaks_on_gpu(opt_level: str) -> None:
    model = make_model("cuda")
    tokens = make_batches(1, "cuda")[0][0]
    breaks, reasons = graph_breaks(amp_fx.convert(model, opt_level, dtype=torch.float16), tokens)
    assert breaks == 0, f"amp_fx introduced graph breaks: {reasons}"


def test_converted_hf_llama_default_call_compiles_to_one_graph() -> None:
    """A converted Hugging Face Llama's default training call, ``model(input_ids=, labels=).loss``,
    is one graph with no break: its output holds a ``DynamicCache``, so the graph is chosen by
    comparing container specs (`amp_fx.core.containers`) and the cache is rebuilt, both in traced
    code. The compiled loss is the uncompiled converted model's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = amp_fx.convert(transformers.LlamaForCausalLM(config), "O2")
    ids = torch.randint(0, config.vocab_size, (2, 8))

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    eager = loss(ids)  # captures the graph: a capture is a graph break (docs/DESIGN.md)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss)(ids)
    reasons = [str(reason.reason) for reason in explanation.break_reasons]
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), reasons
    torch._dynamo.reset()
    # The ``eager`` backend runs Dynamo's graph as traced: the breaks and the value are Dynamo's
    # (AOTAutograd's backward, traced by the other tests here, would add 5 s).
    compiled = torch.compile(loss, backend="eager", fullgraph=True)(ids)
    assert type(compiled) is torch.Tensor and type(eager) is torch.Tensor
    assert torch.equal(compiled, eager), (compiled.item(), eager.item())
