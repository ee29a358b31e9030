"""Models the training benchmark runs: a plainly written GPT-2-small, torchvision's ResNet-50 and
Hugging Face transformers causal LMs built from configs (random weights, no download).

The GPT is nanoGPT's architecture written out by hand (pre-LayerNorm blocks, causal
`F.scaled_dot_product_attention`, GELU MLP, tied input and output embeddings), so every variant
of the benchmark (torch.autocast, `.half()`, amp_fx O1-O3) trains the same plain `nn.Module`.
``hf_gpt2`` is transformers' ``GPT2LMHeadModel(GPT2Config())`` (124M), ``hf_llama`` a
``LlamaForCausalLM`` of 0.67B parameters (hidden 2048, 12 layers, 16 heads / 4 KV heads, vocab
32000), ``hf_llama_liger`` the Llama of Liger-Kernel's comparison (hidden 1536, intermediate
4096, 16 layers, 12 heads / 4 KV heads, vocab 32000; 8 x 2048 tokens), ``hf_llama32_1b`` the
Llama-3.2-1B shape (hidden 2048, intermediate 8192, 16 layers, 32 heads / 8 KV heads, vocab
128256, tied embeddings, 1.24B; 4 x 4096 tokens; issue 41), ``hf_mixtral`` a
``MixtralForCausalLM`` (hidden 1024, 8 layers, 16 heads / 8 KV heads, 8 experts top 2, expert
FFN 3584, vocab 32000; 8 x 2048 tokens); they compute their own
loss from ``labels=`` and amp_fx converts them with its torch.export front end
(`amp_fx.capture.captured_model`). Each builder returns a `Workload`: the model, a batch on the device and
a loss function (None: the model's own), at the full benchmark size or, with ``small=True``, at a
size that trains in milliseconds on a CPU::

    >>> work = build_workload("gpt", torch.device("cpu"), small=True)
    >>> loss = with_loss(work.model, work.loss_fn)(work.inputs, work.targets)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    low-precision logits (amp_fx.ops.cross_entropy.fp32_cross_entropy) instead of a float32 copy of them.
    """

    def __init__(
        self, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(inputs), targets)


class LabelsLoss(nn.Module):
    """A Hugging Face causal LM as ``(inputs, targets) -> loss``: the model computes its loss itself,
    from ``labels=`` (it shifts them by one position), as a transformers training loop calls it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs, labels=targets).loss


def with_loss(
    model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
) -> nn.Module:
    """``model`` as ``(inputs, targets) -> loss``: with ``loss_fn``, or with its own loss (None)."""
    return LabelsLoss(model) if loss_fn is None else WithLoss(model, loss_fn)


@dataclass
class Workload:
    """One benchmark model with a fixed batch: ``with_loss(model, loss_fn)(inputs, targets)`` is a
    training loss (``loss_fn`` None: the model computes it from ``labels=targets``)."""

    name: str
    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    # Optimizer family and hyperparameters shared by every variant of this workload.
    optimizer: str  # "adamw" or "sgd"
    lr: float
    # Memory format the model and its image inputs use (channels_last for the ResNet).
    memory_format: torch.memory_format = torch.contiguous_format


# (batch, sequence length) of each token model: at full size, and with small=True.
TOKEN_SHAPES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "gpt": ((16, 1024), (2, 32)),
    "hf_gpt2": ((16, 1024), (2, 32)),
    "hf_llama": ((8, 2048), (2, 32)),
    "hf_llama_liger": ((8, 2048), (2, 32)),
    "hf_llama32_1b": ((4, 4096), (2, 32)),
    "hf_mixtral": ((8, 2048), (2, 32)),
}


def token_shape(name: str, small: bool, batch_size: int | None, seq_len: int | None) -> tuple[int, int]:
    """The batch size and sequence length a token model trains on: the defaults, or the overrides."""
    batch, seq = TOKEN_SHAPES[name][1 if small else 0]
    return batch_size or batch, seq_len or seq


def build_gpt(
    device: torch.device, small: bool = False, batch_size: int | None = None, seq_len: int | None = None
) -> Workload:
    """GPT-2 small (12 layers, d=768, 12 heads, vocab 50304) on a batch of 16 x 1024 random tokens."""
    batch, seq = token_shape("gpt", small, batch_size, seq_len)
    config = dataclasses.replace(GPT_TINY if small else GPT2_SMALL, seq_len=seq)
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


def build_resnet50(
    device: torch.device, small: bool = False, batch_size: int | None = None, seq_len: int | None = None
) -> Workload:
    """torchvision ResNet-50 (weights=None) on 256 random 224x224 images, channels_last.

    ``small=True`` builds the same Bottleneck ResNet with one block per stage and narrow bottlenecks
    on 16x16 images: ResNet-50 itself takes seconds per step on a CPU.
    """
    if seq_len is not None:
        raise ValueError("resnet50 takes images, not token sequences: leave the sequence length out")
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


# LlamaConfig sizes of the Llama workloads. hf_llama: Llama's MLP width 4 * 2/3 * hidden rounded up
# to a multiple of 256 (as TinyLlama's 5632); 12 layers land at 0.67B parameters, head dim 128.
# hf_llama_liger: the model of Liger-Kernel's published Llama comparison (issue 25), 0.50B, head dim
# 128. hf_llama32_1b: Llama-3.2-1B's shape (issue 41), head dim 64, its LM head the embedding table;
# the rotary frequencies are LlamaConfig's default (Llama 3.2's theta and scaling change no FLOP and
# no byte). "small": all at their CPU size; a model with tied embeddings keeps them there.
LLAMA_SIZES: dict[str, dict[str, int]] = {
    "hf_llama": {
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 12,
        "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000,
    },
    "hf_llama_liger": {
        "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 16,
        "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
    },
    "hf_llama32_1b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "small": {
        "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    },
}  # fmt: skip

# MixtralConfig sizes of hf_mixtral, the mixture-of-experts workload of issue 37: 8 experts, top 2,
# expert FFN 3584, on transformers' default experts implementation (grouped_mm); "small": its CPU
# size (16-byte aligned rows, which _grouped_mm's CPU kernel needs).
MIXTRAL_SIZES: dict[str, dict[str, int]] = {
    "hf_mixtral": {
        "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "small": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "num_local_experts": 4, "num_experts_per_tok": 2,
    },
}  # fmt: skip


def hf_config(name: str, small: bool, seq_len: int) -> Any:
    """The transformers config of a Hugging Face workload (``hf_gpt2``, a Llama, ``hf_mixtral``),
    with position embeddings for at least ``seq_len`` tokens; ``use_cache`` is the config's default, as people
    train."""
    import transformers

    if name == "hf_gpt2":
        if small:
            return transformers.GPT2Config(
                vocab_size=512, n_embd=64, n_layer=2, n_head=2, n_positions=seq_len,
                bos_token_id=0, eos_token_id=0,  # GPT-2's 50256 is outside the tiny vocabulary
            )  # fmt: skip
        return transformers.GPT2Config(n_positions=max(1024, seq_len))
    if name == "hf_mixtral":
        sizes = MIXTRAL_SIZES["small" if small else name]
        return transformers.MixtralConfig(**sizes, max_position_embeddings=max(2048, seq_len))
    sizes = LLAMA_SIZES[name]
    if small:
        sizes = {**LLAMA_SIZES["small"], "tie_word_embeddings": sizes.get("tie_word_embeddings", False)}
    return transformers.LlamaConfig(**sizes, max_position_embeddings=max(2048, seq_len))


HF_MODEL_CLASSES = {
    "hf_gpt2": "GPT2LMHeadModel",
    "hf_llama": "LlamaForCausalLM",
    "hf_llama_liger": "LlamaForCausalLM",
    "hf_llama32_1b": "LlamaForCausalLM",
    "hf_mixtral": "MixtralForCausalLM",
}


def hf_model_type(name: str) -> str | None:
    """transformers' ``model_type`` of a Hugging Face workload (``"llama"``), None for the others.

    >>> hf_model_type("hf_llama_liger"), hf_model_type("gpt")
    ('llama', None)
    """
    if name not in HF_MODEL_CLASSES:
        return None
    return hf_config(name, small=True, seq_len=32).model_type


def hf_model(name: str, config: Any) -> nn.Module:
    """A freshly initialized transformers model (random weights) of ``config``, on the current device."""
    import transformers

    return getattr(transformers, HF_MODEL_CLASSES[name])(config)


def build_hf(
    name: str,
    device: torch.device,
    small: bool = False,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> Workload:
    """A transformers causal LM (`TOKEN_SHAPES`: ``hf_gpt2`` 16 x 1024 tokens, most Llamas 8 x 2048)
    whose own loss trains it: ``model(input_ids=tokens, labels=tokens).loss``."""
    batch, seq = token_shape(name, small, batch_size, seq_len)
    config = hf_config(name, small, seq)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)
    with torch.device(device):  # as build_gpt: initializing on the host would dominate a short run
        model = hf_model(name, config)
    # GPT2LMHeadModel's class name names no loss, so transformers logs a warning at every loss and
    # falls back to this one; the logging call breaks torch.compile's graph of the baseline.
    model.loss_type = "ForCausalLM"
    return Workload(
        name=name, model=model, inputs=tokens, targets=tokens, loss_fn=None, optimizer="adamw", lr=3e-4
    )


def parameter_count(name: str, small: bool, seq_len: int | None = None) -> int:
    """Parameters of a Hugging Face workload's model, counted on the meta device (no memory)."""
    _, seq = token_shape(name, small, None, seq_len)
    with torch.device("meta"):
        return sum(p.numel() for p in hf_model(name, hf_config(name, small, seq)).parameters())


BUILDERS: dict[str, Callable[..., Workload]] = {
    "gpt": build_gpt,
    "resnet50": build_resnet50,
    "hf_gpt2": lambda *args, **kwargs: build_hf("hf_gpt2", *args, **kwargs),
    "hf_llama": lambda *args, **kwargs: build_hf("hf_llama", *args, **kwargs),
    "hf_llama_liger": lambda *args, **kwargs: build_hf("hf_llama_liger", *args, **kwargs),
    "hf_llama32_1b": lambda *args, **kwargs: build_hf("hf_llama32_1b", *args, **kwargs),
    "hf_mixtral": lambda *args, **kwargs: build_hf("hf_mixtral", *args, **kwargs),
}


def build_workload(
    name: str,
    device: torch.device,
    small: bool = False,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> Workload:
    """Build the named workload (one of `BUILDERS`) with a fresh, seeded model; ``batch_size`` and
    ``seq_len`` (token models only) override its defaults."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(BUILDERS)}")
    torch.manual_seed(0)
    return BUILDERS[name](device, small=small, batch_size=batch_size, seq_len=seq_len)
