"""O2 is never less accurate than torch.autocast, measured by the relative oracle (`error_ratio`).

Mixture-of-experts layers run their experts through ``aten._grouped_mm``, which autocast does not
list: O2 runs them low, judged against autocast with the experts run low the same way (issue 37,
tests/test_moe_o2.py). Parameters no lowered op reads (Swin V2's attention logit scale, which
only ``clamp``/``exp``/``mul`` read; Swin V1's relative-position bias table, indexed and added to
the attention scores) run FP32 at O2, with a reason in the report (the
parameters' storage follows the graph on both front ends: the torch.export front end stores such a
parameter at the first capture that reads it, tests/capture/test_export_parameter_storage.py); the suite's
Hugging Face, timm and nanoGPT models are then within the oracle's bound of autocast.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.core.policy import Rule
from amp_fx.optim import FusedAdam
from amp_fx.optim.model_load_hooks import MASTER_KEY
from amp_fx.passes.shared.decisions import UNLOWERED_PARAMETER_REASON
from amp_fx.testing import RELATIVE_BOUND, assert_equivalent, error_ratio, tolerances
from tests.models.hf import MODELS as HF_MODELS
from tests.models.hf import VOCAB
from tests.models.small import NanoGPT

BF16 = torch.bfloat16
FP32 = torch.float32


def _words(text: str) -> str:
    """The report's text with its column wrapping undone (one space between words)."""
    return re.sub(r"\s+", " ", text)


def _mixtral() -> tuple[nn.Module, dict[str, Any]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (2, 8))
    return transformers.MixtralForCausalLM(config).eval(), {"input_ids": ids, "labels": ids}


def _tiny_swin(name: str) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A timm Swin (``swinv2_tiny_window8_256``, ``swin_tiny_patch4_window7_224``) from a tiny config."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        name, pretrained=False, img_size=32, window_size=4, embed_dim=16, depths=(1, 1), num_heads=(2, 2),
        num_classes=5,
    )  # fmt: skip
    return model.eval(), (torch.randn(2, 3, 32, 32),)


def test_grouped_matmuls_of_experts_run_low_at_o2() -> None:
    """Experts run low at O2 (issue 37), judged against autocast with them run low the same way;
    ``set_op("_grouped_mm", "fp32")`` keeps them FP32, within the bound of plain autocast."""
    pytest.importorskip("transformers")
    model, batch = _mixtral()
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    assert_equivalent(model, o2, (), keyword_inputs=batch)
    grouped = [
        n for gm in amp_fx.captured_graphs(o2) for n in gm.graph.nodes if node_info(n).op == "_grouped_mm"
    ]
    assert grouped and all(node_info(n).rule is Rule.LOWER for n in grouped)
    text = _words(str(amp_fx.report(o2)))
    assert "_grouped_mm lower" in text and "grouped matrix products (mixture-of-experts experts)" in text
    policy = amp_fx.preset("O2", BF16, "cpu").set_op("_grouped_mm", "fp32")
    fp32_experts = amp_fx.convert(model, policy=policy)
    assert error_ratio(model, fp32_experts, (), keyword_inputs=batch, check_grads=False).ratio <= 1.0
    assert_equivalent(model, fp32_experts, (), keyword_inputs=batch)


def test_a_parameter_no_lowered_op_reads_stays_fp32_at_o2() -> None:
    model, inputs = _tiny_swin("swinv2_tiny_window8_256")
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    assert error_ratio(model, o2, inputs, check_grads=False).ratio <= 1.0
    assert_equivalent(model, o2, inputs)
    dtypes = {name: p.dtype for name, p in o2.named_parameters()}
    scales = [name for name in dtypes if name.endswith("logit_scale")]
    assert scales and all(dtypes[name] == torch.float32 for name in scales)
    # q_bias is concatenated into the qkv projection's bias: a lowered op reads it, it stays low.
    assert all(dtypes[name] == BF16 for name in dtypes if name.endswith("q_bias"))
    # The report's table names each parameter (its get_attr node) with its dtype and why.
    report = amp_fx.report(o2)
    rows = {row.name: row for row in report.rows}
    for name in scales:
        row = rows[name.replace(".", "_")]
        assert row.out_dtype == torch.float32 and row.why == UNLOWERED_PARAMETER_REASON, row
    assert "kept float32: no op that" in str(report)  # the text shows the same rows
    # O3 stores everything low, as Apex's O3 does.
    o3 = amp_fx.convert(model, "O3", dtype=BF16)
    assert all(p.dtype == BF16 for name, p in o3.named_parameters() if name in scales)


def test_a_position_bias_table_stays_fp32_at_o2_and_trains_in_fp32() -> None:
    """Swin V1 reads its relative-position bias table by an index, views and an add to the
    attention scores: no lowered op reads it, so O2 keeps it FP32 (never rounded) and
    within the oracle's bound of autocast; its gradient is FP32, and a fused optimizer steps it as
    torch's Adam steps an FP32 tensor (no master copy), leaving it the same FP32 tensor."""
    model, inputs = _tiny_swin("swin_tiny_patch4_window7_224")
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    assert_equivalent(model, o2, inputs)
    params = dict(o2.named_parameters())
    tables = [name for name in params if name.endswith("relative_position_bias_table")]
    assert len(tables) == 2
    for name in tables:
        assert params[name].dtype == FP32 and torch.equal(params[name], model.get_parameter(name)), name
    # The attention's matrix products read their weights low, as O2 stores weights.
    assert all(params[name].dtype == BF16 for name in params if name.endswith(("qkv.weight", "proj.weight")))
    rows = {row.name: row for row in amp_fx.report(o2).rows}
    for name in tables:
        assert rows[name.replace(".", "_")].why == UNLOWERED_PARAMETER_REASON, name

    o2.train()
    optimizer = FusedAdam(o2.parameters(), lr=1e-2)
    nn.functional.cross_entropy(o2(*inputs), torch.tensor([1, 3])).backward()
    references, (fp32_rtol, fp32_atol) = [], tolerances(FP32)
    for name in tables:
        assert params[name].grad.dtype == FP32, name
        reference = nn.Parameter(params[name].detach().clone())
        reference.grad = params[name].grad.clone()
        references.append(reference)
    torch.optim.Adam(references, lr=1e-2).step()
    optimizer.step()
    for name, reference in zip(tables, references, strict=True):
        assert o2.get_parameter(name) is params[name] and params[name].dtype == FP32, name
        assert MASTER_KEY not in optimizer.state[params[name]], name  # FP32: its own master
        assert not torch.equal(params[name], model.get_parameter(name)), name  # the step moved it
        # Within FP32's tolerances (the fused kernel's order of operations), far below bf16's rounding.
        torch.testing.assert_close(params[name], reference, rtol=fp32_rtol, atol=fp32_atol)


def test_the_rule_reads_through_value_moving_ops_only() -> None:
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8) / 3)  # read by a matmul through .t()
            self.bias = nn.Parameter(torch.zeros(4))  # concatenated into the matmul's bias
            self.pad = nn.Parameter(torch.zeros(4))
            self.temperature = nn.Parameter(torch.ones(1))  # only exp and mul read it

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bias = torch.cat([self.bias, self.pad])
            return nn.functional.linear(x, self.weight.t(), bias) * self.temperature.exp()

    torch.manual_seed(0)
    model = Gated()
    o2 = amp_fx.convert(model, "O2", dtype=BF16, device_type="cpu")
    dtypes = {name: p.dtype for name, p in o2.named_parameters()}
    assert dtypes == {"weight": BF16, "bias": BF16, "pad": BF16, "temperature": torch.float32}
    assert_equivalent(model, o2, (torch.randn(3, 8),))


def _suite_models() -> dict[str, Any]:
    def nanogpt() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        idx = torch.randint(0, 64, (2, 8))
        return NanoGPT(), (idx, idx.clone()), {}

    def swinv2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        model, inputs = _tiny_swin("swinv2_tiny_window8_256")
        return model, inputs, {}

    def hf(name: str):
        def build() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
            model, inputs = HF_MODELS[name]()
            return model, (), inputs(2, 8)

        return build

    return {"nanogpt": nanogpt, "timm_swinv2": swinv2, **{f"hf_{name}": hf(name) for name in HF_MODELS}}


_FAST = ("nanogpt", "timm_swinv2", "hf_gpt2")


def _case(name: str) -> Any:
    return pytest.param(name, marks=[] if name in _FAST else [pytest.mark.slow])


@pytest.mark.parametrize("name", [_case(name) for name in _suite_models()])
def test_o2_is_within_the_oracles_bound_of_autocast(name: str) -> None:
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, kwargs = _suite_models()[name]()
    model.eval()  # no dropout: the three models see the same computation
    o2 = amp_fx.convert(model, "O2", dtype=BF16)
    measured = error_ratio(model, o2, args, keyword_inputs=kwargs)
    assert not measured.failures(RELATIVE_BOUND), measured.failures(RELATIVE_BOUND)
