"""Model FLOPs of one training step and MFU (model FLOPs utilisation), for bench_train's table.

The transformers count the convention of PaLM and Megatron: every weight matrix a token passes
through is one multiply-add per weight forward and two backward (6 FLOPs per matmul parameter per
token), and causal attention's two products (`training_flops`). Model FLOPs are what the model
needs, not what a recipe runs: recomputation, masked-out attention blocks, casts and the
optimizer add none. MFU is those FLOPs per second over the GPU's dense tensor-core peak for the
row's dtype (`DENSE_PEAK_FLOPS`).

Example (the Llama-3.2-1B shape, 4 x 4096 tokens):
    >>> shape = TransformerShape(hidden=2048, layers=16, attention_width=2048, kv_width=512,
    ...                          ffn=8192, ffn_matrices=3, vocab=128256)
    >>> round(training_flops(shape, batch=4, seq_len=4096) / 1e12, 1)
    134.7
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from models import GPT2_SMALL, GPT_TINY, HF_MODEL_CLASSES, GPTConfig, hf_config, token_shape

# Dense (no structured sparsity) fp16/bf16 tensor-core peaks, by torch.cuda.get_device_name:
# NVIDIA's datasheets (H100 SXM and H200: 1979 TFLOP/s with sparsity, half that dense). The PCIe
# and NVL cards run at lower clocks and power, so a name not listed gets no MFU rather than a
# wrong one.
DENSE_PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    "NVIDIA H100 80GB HBM3": {torch.float16: 989e12, torch.bfloat16: 989e12},  # H100 SXM
    "NVIDIA H200": {torch.float16: 989e12, torch.bfloat16: 989e12},
}


@dataclass(frozen=True)
class TransformerShape:
    """What a decoder-only transformer's FLOPs per token depend on."""

    hidden: int
    layers: int
    attention_width: int  # query heads x head dim (the hidden size in every model here)
    kv_width: int  # key/value heads x head dim
    ffn: int  # the feed-forward layer's inner width (one expert's, for a mixture of experts)
    ffn_matrices: int  # 2 (up, down: GELU) or 3 (gate, up, down: SwiGLU)
    vocab: int
    experts_per_token: int = 1
    experts: int = 0  # a mixture of experts' router is a hidden x experts matmul; 0: dense

    @property
    def matmul_parameters(self) -> int:
        """Weights a token passes through as matmuls: q, k, v, o, the feed-forward matrices of the
        experts it is routed to, the router, and the LM head (counted once whether or not it is
        the tied embedding table; the embedding lookup is no matmul)."""
        attention = self.hidden * (2 * self.attention_width + 2 * self.kv_width)
        ffn = self.experts_per_token * self.ffn_matrices * self.hidden * self.ffn + self.hidden * self.experts
        return self.layers * (attention + ffn) + self.hidden * self.vocab


def training_flops(shape: TransformerShape, batch: int, seq_len: int) -> int:
    """Model FLOPs of one training step (forward and backward) on ``batch`` x ``seq_len`` tokens::

        6 x matmul_parameters x tokens
        + 3 x (2 x 2 x batch x seq_len^2 x attention_width x layers) / 2

    The first term: 2 FLOPs per weight per token forward, 4 backward (the input's and the weight's
    gradients). The second: attention's two products forward (scores Q K^T and scores x V, each 2 x
    seq_len^2 x attention_width per sequence and layer), halved because the causal mask leaves half
    the scores, times 3 for forward and backward. Norms, activations, rotary, softmax and the loss
    are not counted (elementwise, a few percent at these sizes).

    >>> tiny = TransformerShape(hidden=4, layers=1, attention_width=4, kv_width=4, ffn=8,
    ...                         ffn_matrices=2, vocab=10)
    >>> tiny.matmul_parameters  # 4 x (4+4+4+4) attention + 2 x 4 x 8 MLP + 4 x 10 head
    168
    >>> training_flops(tiny, batch=1, seq_len=2)  # 6 x 168 x 2 + 6 x 1 x 2^2 x 4 x 1
    2112
    """
    dense = 6 * shape.matmul_parameters * batch * seq_len
    # 3 x (2 x 2 x B x S^2 x W x L) / 2, kept in integers
    attention = 6 * batch * seq_len**2 * shape.attention_width * shape.layers
    return dense + attention


def transformer_shape(config: Any) -> TransformerShape:
    """The `TransformerShape` of a config: bench_train's own GPT (`models.GPTConfig`) or a
    transformers GPT-2, Llama or Mixtral config."""
    if isinstance(config, GPTConfig):
        width = config.d_model
        return TransformerShape(width, config.n_layer, width, width, 4 * width, 2, config.vocab_size)
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt2":
        width = config.n_embd
        ffn = config.n_inner or 4 * width
        return TransformerShape(width, config.n_layer, width, width, ffn, 2, config.vocab_size)
    if model_type in ("llama", "mixtral"):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        moe = model_type == "mixtral"
        return TransformerShape(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            attention_width=config.num_attention_heads * head_dim,
            kv_width=config.num_key_value_heads * head_dim,
            ffn=config.intermediate_size,
            ffn_matrices=3,
            vocab=config.vocab_size,
            experts_per_token=config.num_experts_per_tok if moe else 1,
            experts=config.num_local_experts if moe else 0,
        )
    raise ValueError(f"no FLOP count for a {type(config).__name__}: add its shape to transformer_shape")


def convolution_training_flops(model: torch.nn.Module, inputs: torch.Tensor) -> int:
    """A convolutional network's model FLOPs per training step: its forward's convolutions and
    matmuls as torch.utils.flop_counter counts them, times 3 (forward and backward), the usual
    convention. Pass a model and inputs on the meta device: nothing is computed."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(inputs)
    return 3 * counter.get_total_flops()


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one of bench_train's steps, and how they were counted (for under its table)."""

    total: int
    counted: str

    def __str__(self) -> str:
        return f"Model FLOPs per step: {format_flops(self.total)} ({self.counted}; benchmarks/train_flops.py)"


def step_flops(model_name: str, small: bool, batch_size: int | None, seq_len: int | None) -> StepFlops:
    """Model FLOPs of one of bench_train's training steps, at the command line's size."""
    if model_name == "resnet50":
        from models import build_resnet50

        # The same model and batch as the benchmark's, on the meta device.
        work = build_resnet50(torch.device("meta"), small=small, batch_size=batch_size)
        total = convolution_training_flops(work.model, work.inputs)
        return StepFlops(total, "3 x the forward's convolutions and matmuls, torch.utils.flop_counter")
    batch, seq = token_shape(model_name, small, batch_size, seq_len)
    if model_name == "gpt":
        config: Any = GPT_TINY if small else GPT2_SMALL
    elif model_name in HF_MODEL_CLASSES:
        config = hf_config(model_name, small, seq)
    else:
        raise ValueError(f"no FLOP count for model {model_name!r}: add it to step_flops")
    shape = transformer_shape(config)
    total = training_flops(shape, batch, seq)
    dense = 6 * shape.matmul_parameters * batch * seq
    params = shape.matmul_parameters
    params_text = f"{params / 1e9:.3f}B" if params >= 1e9 else f"{params / 1e6:.3g}M"
    counted = (
        f"6 x {params_text} matmul parameters x {batch * seq} tokens "
        f"= {format_flops(dense)}, + causal attention {format_flops(total - dense)}"
    )
    return StepFlops(total, counted)


def format_flops(flops: float) -> str:
    """FLOPs in the largest unit that keeps a number >= 1: ``format_flops(134.67e12)`` is '134.7 TFLOP'."""
    for unit, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= size:
            return f"{flops / size:.1f} {unit}FLOP"
    return f"{flops:.0f} FLOP"


def dense_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense tensor-core peak in FLOP/s for ``dtype`` (`DENSE_PEAK_FLOPS`), None where
    it is not known (a CPU, a GPU not in the table, float32): MFU is then not stated."""
    if device.type != "cuda":
        return None
    return DENSE_PEAK_FLOPS.get(torch.cuda.get_device_name(device), {}).get(dtype)
