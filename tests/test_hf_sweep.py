"""A handful of rows of benchmarks/sweep_hf_default_calls.py (issue 22), through its own check.

Each class is built from a tiny config, called with its defaults (``input_ids``,
``attention_mask``, ``labels``; never ``use_cache``), converted at O1 in bf16 on CPU: it converts,
is captured whole, and equals ``torch.autocast`` bit for bit. Families other tests do not cover
(GPT-2, Llama, Qwen2, Gemma 3, T5, BART and Whisper are in tests/test_default_calls.py).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

transformers = pytest.importorskip("transformers")

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "sweep_hf_default_calls.py")
_spec = importlib.util.spec_from_file_location("sweep_hf_default_calls", _PATH)
sweep = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))  # for its dataclass
_spec.loader.exec_module(sweep)

ROWS = [
    ("OPTForCausalLM", "causal"),
    ("GPTNeoXForCausalLM", "causal"),
    ("PhiForCausalLM", "causal"),
    ("Qwen3ForCausalLM", "causal"),
    ("MixtralForCausalLM", "causal"),  # mixture of experts
    ("DeepseekV3ForCausalLM", "causal"),  # multi-head latent attention, experts
    ("PegasusForConditionalGeneration", "seq2seq"),
    ("LlavaForConditionalGeneration", "vlm"),  # image tokens merged into the text
]


@pytest.mark.parametrize(("name", "group"), ROWS, ids=[name for name, _ in ROWS])
def test_sweep_row(name: str, group: str) -> None:
    row = sweep.check(name, group, timeout=300)
    assert row.builds, row.build_error
    assert row.converts, f"{row.error} ({row.where})"
    assert row.graphs >= 1
    if row.islands:  # allowed only where code is data-dependent: a small share, a source line named
        assert row.island_parameters is not None and row.island_parameters <= 0.25, row.islands
        assert all(".py" in reason for reasons in row.islands.values() for reason in reasons), row.islands
    else:
        assert row.island_parameters == 0.0
    assert row.bit_equal, f"O1 differs from autocast in {row.unequal}"
    assert "labels" in row.inputs and "use_cache" not in row.inputs
    assert not (group == "vlm" and row.text_only), row.media_error  # the image is in the call


def test_the_sweep_lists_the_registered_classes() -> None:
    assert "OPTForCausalLM" in sweep.class_names("causal")
    assert "PegasusForConditionalGeneration" in sweep.class_names("seq2seq")
    assert sweep.tiny_config(transformers.OPTConfig).use_cache is True  # the config's default call
