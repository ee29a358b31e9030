"""Models the training benchmark runs: a plainly written GPT-2-small and torchvision's ResNet-50.

The GPT is nanoGPT's architecture written out by hand (pre-LayerNorm blocks, causal
`F.scaled_dot_product_attention`, GELU MLP, tied input and output embeddings), so every variant
of the benchmark (torch.autocast, `.half()`, amp_fx O1-O3) trains the same plain `nn.Module`.
Each builder returns a `Workload`: the model, a batch on the device and a loss function, at the
full benchmark size or, with ``small=True``, at a size that trains in milliseconds on a CPU::

    >>> work = build_workload("gpt", torch.device("cpu"), small=True)
    >>> loss = work.loss_fn(work.model(work.inputs), work.targets)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.resnet import Bottleneck, ResNet


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 for the tensor cores
    seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768


GPT2_SMALL = GPTConfig()
GPT_TINY = GPTConfig(vocab_size=512, seq_len=32, n_layer=2, n_head=2, d_model=64)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_head
        q, k, v = self.qkv(x).split(d_model, dim=2)
        q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq, d_model)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, 4 * config.d_model)
        self.fc2 = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 language model: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied, as in GPT-2: 124 M parameters
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


class WithLoss(nn.Module):
    """``model`` and its loss as one module: ``WithLoss(model, loss_fn)(inputs, targets)`` is the loss.

    This is how amp_fx sees the whole forward: converted at O2, the loss reads the model's
    low-precision logits (amp_fx.ops.losses.fp32_cross_entropy) instead of a float32 copy of them.
    """

    def __init__(
        self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(inputs), targets)


@dataclass
class Workload:
    """One benchmark model with a fixed batch: ``loss_fn(model(inputs), targets)`` is a training loss."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Optimizer family and hyperparameters shared by every variant of this workload.
    optimizer: str  # "adamw" or "sgd"
    lr: float
    # Memory format the model and its image inputs use (channels_last for the ResNet).
    memory_format: torch.memory_format = torch.contiguous_format


def build_gpt(device: torch.device, small: bool = False, batch_size: int | None = None) -> Workload:
    """GPT-2 small (12 layers, d=768, 12 heads, vocab 50304) on a batch of 16 x 1024 random tokens."""
    config = GPT_TINY if small else GPT2_SMALL
    batch = batch_size or (2 if small else 16)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=generator)
    # Built on the device: initializing 124 M parameters on the host would dominate a short run.
    with torch.device(device):
        model = GPT(config)
    return Workload(
        name="gpt",
        model=model,
        inputs=tokens[:, :-1].to(device),
        targets=tokens[:, 1:].to(device),
        loss_fn=gpt_loss,
        optimizer="adamw",
        lr=3e-4,
    )


def build_resnet50(device: torch.device, small: bool = False, batch_size: int | None = None) -> Workload:
    """torchvision ResNet-50 (weights=None) on 256 random 224x224 images, channels_last.

    ``small=True`` builds the same Bottleneck ResNet with one block per stage and narrow bottlenecks
    on 16x16 images: ResNet-50 itself takes seconds per step on a CPU.
    """
    if small:
        model: nn.Module = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=16)
        batch, size, classes = batch_size or 2, 16, 10
    else:
        model = torchvision.models.resnet50(weights=None)
        batch, size, classes = batch_size or 256, 224, 1000
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=generator)
    labels = torch.randint(0, classes, (batch,), generator=generator)
    return Workload(
        name="resnet50",
        model=model.to(device, memory_format=torch.channels_last),
        inputs=images.to(device, memory_format=torch.channels_last),
        targets=labels.to(device),
        loss_fn=classification_loss,
        optimizer="sgd",
        lr=0.1,
        memory_format=torch.channels_last,
    )


BUILDERS: dict[str, Callable[..., Workload]] = {"gpt": build_gpt, "resnet50": build_resnet50}


def build_workload(
    name: str, device: torch.device, small: bool = False, batch_size: int | None = None
) -> Workload:
    """Build the named workload ("gpt" or "resnet50") with a fresh, seeded model."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(BUILDERS)}")
    torch.manual_seed(0)
    return BUILDERS[name](device, small=small, batch_size=batch_size)
