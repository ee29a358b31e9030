"""O2's pattern fusions reach Hugging Face causal-LM families that no issue names (issues 25, 37).

The fusions are found by what a graph computes, never by a model's name, so a family nobody wrote
a test for must get them as Llama and GPT-2 do. Each family here is built from a tiny seeded
config (no dropout), converted at O2 in bf16 on CPU and called with its defaults plus ``labels=``
in training, as README shows. The fusions expected are derived from what the family computes
(its norm, rotary or not, its MLP), written as data keyed by that property; the checks:

- the fused calls of each property are in the captured graphs, as many as the model computes
  (norms, q and k rotations, MLP activations, the head and loss as one chunked call), and no
  fused call of a property the family lacks;
- the loss is real and finite, the logits None in training and real in eval;
- the loss and every parameter's gradient are within ``assert_equivalent``'s relative oracle
  (at most 1.5x torch.autocast's error against the FP32 original);
- a backward and one `FusedAdam` step change every parameter.

Gemma 2's final logit softcap (``logits / c; tanh; * c``) is fused into the chunked head and loss
(``softcap=c``). Left out: BLOOM (its GELU is a torch.autograd.Function, so the model runs in
autocast islands in training).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from packaging.version import Version
from torch import nn

import amp_fx
from amp_fx.ops.activations import fp32_activation, fp32_gated_activation
from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy
from amp_fx.ops.norms import add_layer_norm_fp32, add_rms_norm_fp32, layer_norm_fp32, rms_norm_fp32
from amp_fx.ops.rotary import rotary_embedding, rotary_embedding_pair
from amp_fx.testing import assert_equivalent

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 128, 64, 2, 4, 2
# Token ids inside the tiny vocabulary (the defaults of some families lie beyond it).
TOKENS = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
LLAMA_LIKE = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": 64,
}  # fmt: skip


def _norm_modules(model: nn.Module) -> int:
    """Norm modules (LayerNorm, RMSNorm and the families' own): each must become one fused call."""
    return sum(type(m).__name__.endswith("Norm") for m in model.modules())


def _has_shared_expert(model: nn.Module) -> bool:
    return bool(getattr(model.config, "shared_expert_intermediate_size", 0))


@dataclass(frozen=True)
class Fusion:
    """What a property of a family's computation becomes at O2: ``calls`` maps each fused function
    to how many of the property's steps one call does; ``steps`` counts them in the tiny model."""

    calls: dict[Callable[..., Any], int]
    steps: Callable[[nn.Module], int]


FUSIONS: dict[str, Fusion] = {
    "RMSNorm": Fusion({rms_norm_fp32: 1, add_rms_norm_fp32: 1}, _norm_modules),
    "LayerNorm": Fusion({layer_norm_fp32: 1, add_layer_norm_fp32: 1}, _norm_modules),
    # q and k of each layer; a pair rotates both in one call.
    "rotary": Fusion({rotary_embedding: 1, rotary_embedding_pair: 2}, lambda m: 2 * LAYERS),
    # One per layer, and one more where a shared expert runs beside the routed ones.
    "gated MLP": Fusion({fp32_gated_activation: 1}, lambda m: LAYERS * (1 + _has_shared_expert(m))),
    "tanh-GELU MLP": Fusion({fp32_activation: 1}, lambda m: LAYERS),
    "causal-LM loss": Fusion({chunked_linear_cross_entropy: 1}, lambda m: 1),
}


@dataclass(frozen=True)
class Family:
    name: str  # transformers' prefix: {name}Config, {name}ForCausalLM
    computes: tuple[str, ...]  # keys of FUSIONS; every family here has the causal-LM loss
    config: dict[str, Any] = field(default_factory=lambda: dict(LLAMA_LIKE))
    # The transformers version from which the training forward has no data-dependent branch, so
    # torch.export captures it whole (before it, the model runs in autocast islands, unfused).
    whole_from: str | None = None

    def build(self) -> nn.Module:
        """The family's causal LM from the tiny config, seeded, without dropout, in training mode."""
        if not hasattr(transformers, f"{self.name}ForCausalLM"):
            pytest.skip(f"transformers {transformers.__version__} has no {self.name}ForCausalLM")
        if self.whole_from and Version(transformers.__version__) < Version(self.whole_from):
            pytest.skip(
                f"{self.name} in transformers {transformers.__version__} branches on data in training"
            )
        config = getattr(transformers, f"{self.name}Config")(**self.config, **TOKENS)
        for key, value in list(vars(config).items()):  # every family names its dropouts its own way
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
                setattr(config, key, 0.0)
        torch.manual_seed(0)
        return getattr(transformers, f"{self.name}ForCausalLM")(config).train()


RMS_GATED = ("RMSNorm", "rotary", "gated MLP")
HEAD_DIM = {**LLAMA_LIKE, "head_dim": HIDDEN // HEADS}  # families whose default head_dim is fixed
NO_GQA = {key: value for key, value in LLAMA_LIKE.items() if key != "num_key_value_heads"}
FALCON = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "new_decoder_architecture": True, "num_kv_heads": KV_HEADS,
}  # fmt: skip
GPTJ = {
    "vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 64,
    "rotary_dim": HIDDEN // HEADS // 2,
}  # fmt: skip
GPT_BIGCODE = {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 64}
MPT = {"vocab_size": VOCAB, "d_model": HIDDEN, "n_layers": LAYERS, "n_heads": HEADS, "max_seq_len": 64}
OPT = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "ffn_dim": 2 * HIDDEN, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "max_position_embeddings": 64, "word_embed_proj_dim": HIDDEN,
}  # fmt: skip
# Mixture-of-experts families (issue 37): the dense parts' fusions apply, and the experts' gated
# activation (written out over all experts at once) is fused as a dense MLP's is.
MOE = {**LLAMA_LIKE, "num_experts_per_tok": 2}
FAMILIES = [
    Family("Mixtral", RMS_GATED, {**MOE, "num_local_experts": 4}),
    Family("Olmoe", RMS_GATED, {**MOE, "num_experts": 4}),  # RMSNorms of q and k too
    Family(
        "Qwen2Moe",
        RMS_GATED,
        {**MOE, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    ),
    Family("Qwen2", RMS_GATED),
    Family("Qwen3", RMS_GATED, HEAD_DIM),  # RMSNorms of q and k too
    Family("Mistral", RMS_GATED),
    Family("Gemma", RMS_GATED, HEAD_DIM),  # (1 + w) norms, GeGLU
    Family("Gemma2", RMS_GATED, HEAD_DIM),  # four norms a layer, final logit softcap 30
    Family("Phi3", RMS_GATED),  # one gate_up projection, chunked
    Family("Granite", RMS_GATED),  # logits / logits_scaling
    # written-out LayerNorm, interleaved rotary, logits * 0.0625
    Family("Cohere", ("LayerNorm", "rotary", "gated MLP")),
    Family("Olmo", ("LayerNorm", "rotary", "gated MLP")),  # LayerNorm without weights
    Family("StableLm", ("LayerNorm", "rotary", "gated MLP")),  # partial rotary
    Family("Phi", ("LayerNorm", "rotary", "tanh-GELU MLP")),  # partial rotary, written-out GELU
    Family("GPTNeoX", ("LayerNorm", "rotary"), NO_GQA),  # partial rotary, parallel residual, erf GELU
    Family("Falcon", ("LayerNorm", "rotary"), FALCON),  # two LayerNorms of one input per layer
    Family("GPTJ", ("LayerNorm", "rotary", "tanh-GELU MLP"), GPTJ),  # interleaved, partial rotary
    Family("GPTBigCode", ("LayerNorm",), GPT_BIGCODE),  # learned positions, multi-query, aten GELU
    Family("Mpt", ("LayerNorm",), MPT),  # ALiBi, LayerNorms without bias
    # Learned positions, ReLU MLP. Up to 5.17 at least, OPTDecoder draws torch.rand per layer in
    # training and branches on it even at layerdrop 0; 5.24 skips the draw then.
    Family("OPT", ("LayerNorm",), OPT, whole_from="5.24"),
]


def fused_steps(model: nn.Module) -> dict[str, int]:
    """Per property of FUSIONS, the steps the fused calls in ``model``'s captured graphs do."""
    graphs = amp_fx.report(model).graphs.values()
    targets = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    return {prop: sum(fusion.calls.get(target, 0) for target in targets) for prop, fusion in FUSIONS.items()}


def expected_steps(family: Family, model: nn.Module) -> dict[str, int]:
    """Per property of FUSIONS, the steps ``model`` computes: none for a property it lacks."""
    computes = {*family.computes, "causal-LM loss"}
    return {prop: fusion.steps(model) if prop in computes else 0 for prop, fusion in FUSIONS.items()}


class Loss(nn.Module):
    """The model's loss alone: the oracle compares outputs, and in training the converted model's
    logits are None (the head and loss run chunked) where the original's are real."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs).loss


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_family_gets_the_fusions(family: Family) -> None:
    model = family.build()
    converted = amp_fx.convert(model, "O2", dtype=BF16)  # a copy: `model` stays the FP32 original
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}

    output = converted(**inputs)
    assert type(output.loss) is torch.Tensor and torch.isfinite(output.loss)
    assert output.logits is None  # training with labels=: head and loss ran as one chunked call
    assert fused_steps(converted) == expected_steps(family, model)
    # A final logit softcap (Gemma 2's) is computed by the chunked call; no other family has one.
    heads = [
        node
        for gm in amp_fx.report(converted).graphs.values()
        for node in gm.graph.nodes
        if node.target is chunked_linear_cross_entropy
    ]
    cap = getattr(model.config, "final_logit_softcapping", None)
    assert [node.kwargs.get("softcap") for node in heads] == [cap] * len(heads)

    optimizer = amp_fx.optim.FusedAdam(converted.parameters(), lr=1e-2)
    before = {name: p.detach().clone() for name, p in converted.named_parameters()}
    output.loss.backward()
    # Before the step, while the parameters are the original's.
    assert_equivalent(Loss(model), Loss(converted), (), keyword_inputs=inputs)
    optimizer.step()
    unchanged = [name for name, p in converted.named_parameters() if torch.equal(p, before[name])]
    assert not unchanged

    converted.eval()
    with torch.no_grad():
        evaluated = converted(**inputs)
    assert type(evaluated.logits) is torch.Tensor and type(evaluated.loss) is torch.Tensor
    assert evaluated.logits.shape == (*ids.shape, VOCAB)
