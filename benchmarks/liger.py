"""Liger-Kernel (https://github.com/linkedin/Liger-Kernel) as a comparison column of bench_train.

Liger replaces transformers' classes and functions for a model family in the whole process
(``apply_liger_kernel_to_llama()`` swaps LlamaRMSNorm, LlamaMLP, the rotary embedding and
LlamaForCausalLM's forward, with its fused linear + cross-entropy), so a model built after the
patch runs Liger's Triton kernels, and so does every later model of that family in the process:
bench_train runs the Liger variants in a process of their own.

Liger is a benchmark-only dependency, a pure-Python wheel. On a machine without the registry
(the GPU machine), install it from the wheel downloaded into ``.wheels/`` beforehand
(``python -m pip download liger-kernel --no-deps -d .wheels``)::

    python3 -m pip install --no-deps .wheels/liger_kernel-*.whl
"""

from __future__ import annotations

import importlib.metadata

INSTALL_HINT = "python3 -m pip install --no-deps .wheels/liger_kernel-*.whl"


def unavailable_reason(model_type: str | None, device_type: str) -> str | None:
    """Why Liger cannot run a ``model_type`` (transformers' ``config.model_type``; None: not a
    transformers model) model here, or None. Its Triton kernels need a GPU: on a CPU they fail
    even under TRITON_INTERPRET=1 (tried with liger-kernel 0.8.5)."""
    if model_type is None:
        return "Liger-Kernel patches transformers models only"
    try:
        import liger_kernel.transformers as liger_transformers
    except ImportError:
        return f"Liger-Kernel is not installed ({INSTALL_HINT})"
    if not hasattr(liger_transformers, f"apply_liger_kernel_to_{model_type}"):
        version = importlib.metadata.version("liger-kernel")
        return f"Liger-Kernel {version} has no apply_liger_kernel_to_{model_type}: nothing to compare"
    if device_type != "cuda":
        return "Liger-Kernel's Triton kernels need a CUDA device (they fail under TRITON_INTERPRET)"
    return None


def patch_transformers(model_type: str) -> None:
    """Apply Liger's default patch for ``model_type`` (e.g. ``"llama"``): models of that family
    built afterwards, in this process, run Liger's kernels."""
    import liger_kernel.transformers as liger_transformers

    getattr(liger_transformers, f"apply_liger_kernel_to_{model_type}")()
