"""O2's opt-in low-precision residual stream (``low_precision_residual=True``, issue 25).

With it a transformer's embedding tables are stored low, so the residual stream starts low and
every residual add, and the fused add + norm calls that take them in, sum two low values, as in
a model cast with ``.to(dtype)``; norms keep their FP32 math and weights, the optimizer its FP32
masters. Without it the stream stays FP32 as under autocast. Its accuracy is held to the model
cast low (the relative oracle with ``low_precision_copy`` as reference); docs/DESIGN.md ("Fused
norms") has the measured errors of both choices (benchmarks/residual_accuracy.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import amp_fx
from amp_fx.core.node_info import node_info
from amp_fx.ops import norms
from amp_fx.optim import FusedAdam, master_params
from amp_fx.testing import RELATIVE_BOUND, error_ratio, low_precision_copy
from tests.models.hf import MODELS

pytest.importorskip("transformers")

BF16 = torch.bfloat16
# What fuse_norms puts in place of a residual add and the norm after it.
_ADD_NORMS = (norms.add_rms_norm_fp32, norms.add_layer_norm_fp32)


def _policy(low: bool, dtype: torch.dtype = BF16) -> amp_fx.Policy:
    return amp_fx.preset("O2", dtype, "cpu", low_precision_residual=low)


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[torch.nn.Module, dict[str, Any]]]:
    """Each tiny model in eval mode (no dropout) with its batch."""
    built = {}
    for name in ("llama", "gpt2"):
        torch.manual_seed(0)
        model, inputs = MODELS[name]()
        built[name] = (model.eval(), inputs(2, 8))
    return built


@pytest.fixture(scope="module")
def converted(models) -> Any:
    """``converted(name, low)``: the model converted at O2 bf16 with or without the option (each
    converted once for the module's tests)."""
    done: dict[tuple[str, bool], torch.nn.Module] = {}

    def get(name: str, low: bool) -> torch.nn.Module:
        if (name, low) not in done:
            done[name, low] = amp_fx.convert(models[name][0], policy=_policy(low))
        return done[name, low]

    return get


@pytest.fixture
def fused_sums(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, torch.dtype, torch.dtype]]:
    """(branch, stream, sum) dtypes of every fused add + norm call that runs."""
    calls = []
    fused_norm = norms.fused_norm

    def recorded(x, residual, *args):
        out = fused_norm(x, residual, *args)
        if residual is not None:
            assert type(out[1]) is torch.Tensor
            calls.append((x.dtype, residual.dtype, out[1].dtype))
        return out

    monkeypatch.setattr(norms, "fused_norm", recorded)
    return calls


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_stream_is_low_with_the_option_and_fp32_without(name, models, converted, fused_sums) -> None:
    batch = models[name][1]
    counts = []
    for low, stream in ((False, torch.float32), (True, BF16)):
        o2 = converted(name, low)
        fused_sums.clear()
        assert o2(**batch).loss.dtype == torch.float32  # the loss stays FP32
        nodes = [n for gm in amp_fx.captured_graphs(o2) for n in gm.graph.nodes]
        embeddings = [n for n in nodes if node_info(n).op == "embedding"]
        assert embeddings and {node_info(n).out_dtype for n in embeddings} == {stream}
        add_norms = [n for n in nodes if n.target in _ADD_NORMS]
        counts.append(len(add_norms))
        for node in add_norms:
            read = set(node_info(node).in_dtypes[:2])  # the branch and the stream
            assert read == {BF16, stream}, (node.name, read)
            (summed,) = [user for user in node.users if user.args[1] == 0]
            assert node_info(summed).out_dtype == stream
        # The adds left unfused (GPT-2's token + position embeddings) sum in the stream's dtype too.
        floating_adds = {node_info(n).out_dtype for n in nodes if node_info(n).op == "add"} - {torch.int64}
        assert floating_adds <= {stream}
        # What ran: every fused add read and wrote the stream in its dtype.
        assert len(fused_sums) == len(add_norms)
        assert all(
            {branch, residual} == {BF16, stream} and total == stream for branch, residual, total in fused_sums
        )
        # Norm weights stay FP32 either way; the embedding table follows the stream.
        dtypes = {n: p.dtype for n, p in o2.named_parameters()}
        norm_weights = [n for n in dtypes if "norm" in n or ".ln_" in n]
        assert norm_weights and all(dtypes[n] == torch.float32 for n in norm_weights)
        assert {dtypes[n] for n in dtypes if "embed_tokens" in n or ".wte." in n} == {stream}
        # The report says the option is on, and why the tables are low.
        report = amp_fx.report(o2)
        assert ("low-precision residual stream (opt-in)" in str(report).splitlines()[0]) is low
        assert report.to_dict()["policy"]["low_precision_residual"] is low
        reasons = {row.why for row in report.rows if row.op == "embedding"}
        assert reasons and all(("low_precision_residual" in why) is low for why in reasons)
    assert counts[0] == counts[1] > 0  # the same chains fused with a low stream


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_error_is_at_most_that_of_the_model_cast_low(name, models, converted) -> None:
    # The option gives up autocast's FP32 stream (O2's promise of at most autocast's error), and
    # keeps FP32 norms, islands and loss: at most the error of the model cast with .to(bfloat16).
    model, batch = models[name]
    cast = low_precision_copy(model, BF16)
    measured = error_ratio(model, converted(name, True), (), keyword_inputs=batch, reference=cast, batches=3)
    assert measured.reference == "the given reference"
    assert not measured.failures(RELATIVE_BOUND), measured.failures(RELATIVE_BOUND)


def test_trains_with_fp32_masters_like_fp32(models) -> None:
    model, batch = models["llama"]
    fp32 = copy.deepcopy(model).train()
    converted = amp_fx.convert(copy.deepcopy(model).train(), policy=_policy(True))
    reference = torch.optim.Adam(fp32.parameters(), lr=1e-2)
    optimizer = FusedAdam(list(converted.parameters()), lr=1e-2)
    losses: dict[str, list[float]] = {"fp32": [], "o2": []}
    for _ in range(6):
        for key, net, opt in (("fp32", fp32, reference), ("o2", converted, optimizer)):
            loss = net(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    assert losses["o2"][-1] < 0.9 * losses["o2"][0]
    assert losses["o2"][-1] == pytest.approx(losses["fp32"][-1], rel=0.05), losses
    table = converted.get_parameter("model.embed_tokens.weight")
    assert table.dtype == BF16
    assert all(m.dtype == torch.float32 for m in master_params(optimizer))
