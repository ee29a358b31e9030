"""bench_train's variants: how each row of its table trains, the order they run in, and what
each model runs without ``--variants`` (and its compile mode without ``--compile-mode``).

Example:
    >>> VARIANTS["o2_fp16"].uses_loss_scaling, VARIANTS["o2_bf16"].uses_loss_scaling
    (True, False)
    >>> args = argparse.Namespace(compile_mode=None, compile_backend="inductor")
    >>> compile_mode("hf_llama_liger", args), compile_mode("hf_gpt2", args)
    ('max-autotune-no-cudagraphs', None)
    >>> VARIANTS["o2_bf16_low_residual"].low_precision_residual
    True
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Variant:
    """How one row of the table trains: who converts the model and in which precision."""

    name: str
    # "torch": plain PyTorch (fp32, autocast or .half()); "amp_fx": amp_fx.convert + fused optimizer.
    framework: str
    # dtype of the model's parameters (torch variants) or amp_fx's low dtype.
    dtype: torch.dtype = torch.float32
    autocast: bool = False
    opt_level: str | None = None
    # The whole step captured once with amp_fx.CudaGraphStep and replayed (eager only).
    cuda_graph: bool = False
    # amp_fx converts the model alone; the loss runs on its float32 outputs.
    loss_outside: bool = False
    # amp_fx's BatchNorm + [add] + ReLU fusion (the O2 default); False runs them as torch ops.
    fused_batch_norm: bool = True
    # amp_fx's max-pool kernels (the O2 default); False runs torch's.
    fused_max_pool: bool = True
    # amp_fx's linear head + cross-entropy fusion (the O2 default); False runs them as two calls.
    fused_linear_loss: bool = True
    # A transformers model called as its config says (use_cache: a key/value cache is filled);
    # False sets config.use_cache=False, the comparison row of issue 22.
    kv_cache: bool = True
    # Liger-Kernel's patch for the model's family applied before it is built (benchmarks/liger.py);
    # it holds for the whole process, so these variants run in a process of their own.
    liger: bool = False
    # amp_fx's opt-in low-precision residual stream (``preset(..., low_precision_residual=True)``):
    # embedding tables stored low, residual adds and the fused add + norm calls on a low stream.
    low_precision_residual: bool = False

    @property
    def uses_loss_scaling(self) -> bool:
        # fp16 needs a dynamic loss scale wherever an fp32 copy of the weights exists (autocast, O1,
        # O2); `.half()` and O3 train without one, as Apex's O3 does.
        if self.dtype != torch.float16:
            return False
        return self.autocast or self.opt_level in ("O1", "O2")


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant("fp32", "torch"),
        Variant("autocast_fp16", "torch", torch.float16, autocast=True),
        Variant("autocast_bf16", "torch", torch.bfloat16, autocast=True),
        Variant("half", "torch", torch.float16),
        Variant("pure_bf16", "torch", torch.bfloat16),
        *(
            Variant(f"o{level}_{short}", "amp_fx", dtype, opt_level=f"O{level}")
            for level in (1, 2, 3)
            for short, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
        ),
        Variant("o2_fp16_cuda_graph", "amp_fx", torch.float16, opt_level="O2", cuda_graph=True),
        Variant("o2_fp16_loss_outside", "amp_fx", torch.float16, opt_level="O2", loss_outside=True),
        Variant("o2_fp16_unfused_bn", "amp_fx", torch.float16, opt_level="O2", fused_batch_norm=False),
        Variant("o2_fp16_unfused_pool", "amp_fx", torch.float16, opt_level="O2", fused_max_pool=False),
        Variant(
            "o2_fp16_unfused_linear_loss", "amp_fx", torch.float16, opt_level="O2", fused_linear_loss=False
        ),
        *(
            Variant(f"o2_{short}_low_residual", "amp_fx", dtype, opt_level="O2", low_precision_residual=True)
            for short, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
        ),
        Variant("o2_fp16_no_kv_cache", "amp_fx", torch.float16, opt_level="O2", kv_cache=False),
        Variant("autocast_fp16_no_kv_cache", "torch", torch.float16, autocast=True, kv_cache=False),
        Variant("liger_autocast_bf16", "torch", torch.bfloat16, autocast=True, liger=True),
        Variant("liger_pure_bf16", "torch", torch.bfloat16, liger=True),
    ]
}
BASELINE = "autocast_fp16"
RUN_ORDER = [
    BASELINE,
    "o2_fp16",
    "half",
    "o2_bf16",
    "o2_bf16_low_residual",
    "autocast_bf16",
    "pure_bf16",
    "liger_autocast_bf16",
    "liger_pure_bf16",
    "o2_fp16_cuda_graph",
    "o2_fp16_loss_outside",
    "o2_fp16_unfused_bn",
    "o2_fp16_unfused_pool",
    "o2_fp16_unfused_linear_loss",
    "o2_fp16_no_kv_cache",
    "o2_fp16_low_residual",
    "autocast_fp16_no_kv_cache",
    "o1_fp16",
    "o3_fp16",
    "o1_bf16",
    "o3_bf16",
    "fp32",
]
assert sorted(RUN_ORDER) == sorted(VARIANTS)
# What a model runs without --variants: every variant, except for the transformers models: issue
# 12's comparison (their loss is inside the model, so o2_fp16_loss_outside has no meaning), which
# keeps both within one GPU run of <= 9 minutes.
# hf_llama_liger runs the comparison of issue 25 in bf16, its Liger rows in a process of their own.
DEFAULT_VARIANTS: dict[str, list[str]] = {
    "hf_gpt2": [BASELINE, "o2_fp16"],
    "hf_llama": [BASELINE, "o2_fp16"],
    "hf_llama_liger": ["autocast_bf16", "pure_bf16", "o2_bf16", "liger_autocast_bf16", "liger_pure_bf16"],
    # issue 41: the Llama-3.2-1B shape in bf16
    "hf_llama32_1b": ["autocast_bf16", "o2_bf16"],
    # issue 37: O2's low-precision experts against autocast's FP32 ones, bf16
    "hf_mixtral": ["autocast_bf16", "o2_bf16"],
}
# The autocast row of each low dtype: what the targets compare O2 rows to (train_report.py).
AUTOCAST_OF: dict[torch.dtype, str] = {torch.float16: "autocast_fp16", torch.bfloat16: "autocast_bf16"}
# torch.compile's mode for a model's compiled rows under Inductor, where not torch's default
# (``--compile-mode`` overrides): issue 41 asks max-autotune of the Llama 0.5B comparison only, since
# autotuning every GEMM shape of a model costs minutes of GPU time per compile.
MODEL_COMPILE_MODES: dict[str, str] = {"hf_llama_liger": "max-autotune-no-cudagraphs"}
# The variant a model's ratios are taken to, where it is not BASELINE (``--baseline`` overrides).
MODEL_BASELINES: dict[str, str] = {
    "hf_llama_liger": "autocast_bf16",
    "hf_llama32_1b": "autocast_bf16",
    "hf_mixtral": "autocast_bf16",
}


def compile_mode(model_name: str, args: argparse.Namespace) -> str | None:
    """torch.compile's ``mode`` for ``model_name``'s compiled rows: ``--compile-mode``, else the
    model's own under Inductor (`MODEL_COMPILE_MODES`), else None (torch's default; other backends
    take no mode)."""
    if args.compile_mode is not None:
        return args.compile_mode
    if args.compile_backend != "inductor":
        return None
    return MODEL_COMPILE_MODES.get(model_name)


def model_variants(model_name: str, args: argparse.Namespace) -> list[Variant]:
    """The variants ``model_name`` runs: ``--variants``, else its default (`DEFAULT_VARIANTS`)."""
    if args.variants is not None:
        return list(args.variants)
    return [VARIANTS[name] for name in DEFAULT_VARIANTS.get(model_name, VARIANTS)]
