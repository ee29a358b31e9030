"""Small models of shapes the front ends must handle: nanoGPT's (a size assert, an optional
target, a tied head) and one whose forward branches on a tensor's value."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.n_head = config.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model.py in small: ``forward(idx, targets=None)`` returns (logits, loss)."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class GatedByValue(nn.Module):
    """Its forward branches on a tensor's value, which no capture can take whole; its layers can
    be captured."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU())
        self.positive = nn.Linear(16, 4)
        self.negative = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        head = self.positive if h.mean() > 0 else self.negative
        return head(h).softmax(-1)


class DtypeReading(nn.Module):
    """Reads its activations' dtype as transformers' eager attention and RMSNorm do: the mask's
    fill value is ``finfo(dtype).min`` of the running dtype, and the norm computes in float32 and
    returns the dtype it was given. Captured at float32 and cast afterwards, the fill value
    (-3.4e38) would round to -inf in bf16 and a fully masked row would become NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.norm_weight = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        input_dtype = h.dtype
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = (h.to(torch.float32) * torch.rsqrt(variance + 1e-6)).to(input_dtype) * self.norm_weight
        scores = h @ self.k(x).transpose(-1, -2)
        scores = scores.masked_fill(~keep[:, None, :], torch.finfo(scores.dtype).min)
        return self.out(scores.softmax(-1) @ h)


class ClippedGradient(torch.autograd.Function):
    """A backward of its own (RecurrentGemma's SqrtBoundDerivative, PhiMoE's sparse mixer, a
    straight-through estimator): not the derivative of the forward's ops."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clamp(-0.1, 0.1)


class WithCustomBackward(nn.Module):
    """A layer whose output goes through `ClippedGradient`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ClippedGradient.apply(self.fc(x))
