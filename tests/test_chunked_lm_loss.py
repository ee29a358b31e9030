"""Hugging Face causal LMs at O2 with their head and loss fused chunk by chunk train as under
torch.autocast: one training step's loss and every parameter's gradient agree within the suite's
bf16 tolerances, called as their docs show (``model(input_ids=ids, labels=ids)``), with a tied
head (GPT-2) and an untied one (Llama). In training the output's logits are None; in eval they
are real and agree with autocast's.
"""

from __future__ import annotations

import math

import pytest
import torch

import amp_fx
from amp_fx.testing import grad_tolerances, tolerances, with_autocast
from amp_fx.testing.comparison import compare_tensors
from tests.models.hf import VOCAB, causal_lm_without_dropout

transformers = pytest.importorskip("transformers")

BF16 = torch.bfloat16


def _ids() -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    return ids


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("name", "tied"), [("gpt2", True), ("llama", False)])
def test_o2_training_step_matches_autocast(name, tied, device):
    model = causal_lm_without_dropout(name, tied).to(device)
    ids = _ids().to(device)
    labels = ids.clone()
    labels[0, :3] = -100  # a padded prompt, as a collator writes it
    reference = with_autocast(model, device, BF16)
    expected = reference(input_ids=ids, labels=labels)
    expected.loss.backward()
    converted = amp_fx.convert(model, "O2", dtype=BF16)
    output = converted(input_ids=ids, labels=labels)
    assert output.logits is None and type(output.loss) is torch.Tensor
    output.loss.backward()

    mismatches = [compare_tensors(output.loss, expected.loss, **_named(tolerances(BF16)), name="loss")]
    expected_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    scale = math.sqrt(
        sum(g.double().pow(2).sum().item() for g in expected_grads.values())
        / sum(g.numel() for g in expected_grads.values())
    )
    for param_name, param in converted.named_parameters():
        assert type(param.grad) is torch.Tensor, param_name
        mismatches.append(
            compare_tensors(
                param.grad,
                expected_grads[param_name],
                **_named(grad_tolerances(BF16)),
                scale=scale,
                name=param_name,
            )  # fmt: skip
        )
    assert not [m for m in mismatches if m is not None], mismatches

    converted.eval()
    reference.eval()
    with torch.no_grad():
        evaluated, expected = converted(input_ids=ids, labels=labels), reference(input_ids=ids, labels=labels)
    assert type(evaluated.logits) is torch.Tensor and evaluated.logits.dtype == torch.float32
    assert compare_tensors(evaluated.logits, expected.logits, **_named(tolerances(BF16))) is None
    assert compare_tensors(evaluated.loss, expected.loss, **_named(tolerances(BF16))) is None


def _named(pair: tuple[float, float]) -> dict[str, float]:
    return dict(zip(("rtol", "atol"), pair, strict=True))
