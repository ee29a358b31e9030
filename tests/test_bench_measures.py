"""The measuring side of benchmarks/bench_train.py (issue 25): GPU time summed by kind of kernel
(benchmarks/kernel_breakdown.py) and variants run in fresh processes (benchmarks/isolated_runs.py:
the Liger-Kernel rows, compiled peak memory measured alone).

The kernel rules are checked on names the H200's profiles show (cuBLAS, cuDNN, torch's
elementwise and reduce kernels, Inductor's generated Triton kernels); the whole path runs on the
CPU, where the same rules sort the ops' self CPU time.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

_BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"benchmarks_{name}", os.path.join(_BENCHMARKS, f"{name}.py")
    )
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # for dataclasses
    spec.loader.exec_module(module)
    return module


kernel_breakdown = _load("kernel_breakdown")
isolated_runs = _load("isolated_runs")

# (category, name) of kernels in the H200's profiles (long template arguments cut) and CPU ops.
KERNEL_NAMES = [
    ("GEMM", "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute"),
    ("GEMM", "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN"),
    ("attention", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128"),
    ("attention", "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel>"),
    (
        "casts/copies",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}, LoadWithCast<1>>",
    ),
    ("elementwise", "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"),
    ("norms", "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>"),
    (
        "reductions",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<"
        "float, at::native::sum_functor<float, float, float>::operator()::{lambda(float, float)#1}>>>",
    ),
    ("optimizer", "void at::native::multi_tensor_apply_kernel<Metadata<4>, FusedAdamMathFunctor<float, 4>>"),
    ("casts/copies", "Memcpy DtoD (Device -> Device)"),
    ("casts/copies", "triton_poi_fused__to_copy_0"),
    ("elementwise", "triton_poi_fused__to_copy_add_gelu_mul_5"),
    ("norms", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3"),
    ("reductions", "triton_per_fused__log_softmax_2"),
    ("GEMM", "triton_tem_fused_mm_0"),
    ("other", "void at::native::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>"),
    ("GEMM", "aten::addmm"),
    ("casts/copies", "aten::_to_copy"),
    ("norms", "aten::native_layer_norm"),
    ("optimizer", "aten::_fused_adamw_"),
]


@pytest.mark.parametrize(("category", "name"), KERNEL_NAMES, ids=[name[:40] for _, name in KERNEL_NAMES])
def test_kernels_are_classified_by_name(category: str, name: str) -> None:
    assert kernel_breakdown.classify(name, {}) == category


def test_hand_written_triton_kernels_go_by_family() -> None:
    import amp_fx.kernels.triton_ops  # noqa: F401  (loads every family's Triton kernels)

    families = kernel_breakdown.triton_kernel_families()
    assert families["_adam_kernel"] == "amp_fx adam"
    assert families["_cross_entropy_forward_kernel"] == "amp_fx cross_entropy"
    assert kernel_breakdown.classify("_adam_kernel", families) == "triton amp_fx adam"
    assert not any(name.startswith("triton_") for name in families)  # Inductor's go by the rules


def test_breakdown_of_a_profiled_step() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    optimizer = torch.optim.AdamW(layer.parameters(), fused=True)

    def step() -> None:
        optimizer.zero_grad()
        layer(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()

    step()
    ms = kernel_breakdown.profile_breakdown(step, torch.device("cpu"), steps=2)
    assert {"GEMM", "norms", "optimizer"} <= set(ms)
    assert all(value >= 0 for value in ms.values())
    table = kernel_breakdown.format_breakdown({"o2 eager": ms}, "CPU ms/step", {"o2 eager": 1.0})
    assert "| GEMM |" in table and "| timed step | 1.00 |" in table


def test_a_child_gets_its_group_and_no_parent_only_option() -> None:
    argv = ["--models=gpt,hf_gpt2", "--isolate", "variant", "--markdown", "B.md", "--steps", "3", "--small"]
    group = isolated_runs.Group(["o2_fp16"], ["compile"])
    child = isolated_runs.child_argv(argv, "gpt", group, "out.json", time_budget=100.0)
    assert child[:3] == ["--steps", "3", "--small"]
    assert (
        child[child.index("--variants") + 1] == "o2_fp16" and child[child.index("--modes") + 1] == "compile"
    )
    assert child[child.index("--isolate") + 1] == "none" and "B.md" not in child
    assert child[-2:] == ["--time-budget", "100"]


@pytest.mark.slow
def test_liger_comparison_runs_in_two_processes() -> None:
    """hf_llama_liger's default rows at CPU size: the Liger rows in a process of their own (on a
    CPU, or without Liger installed, reported as skipped with the reason), one table."""
    root = os.path.join(_BENCHMARKS, os.pardir)
    command = [
        sys.executable,
        os.path.join(_BENCHMARKS, "bench_train.py"),
        "--small",
        "--models",
        "hf_llama_liger",
    ]
    command += ["--modes", "eager", "--steps", "1", "--rounds", "1", "--breakdown"]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
    output = subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=600).stdout
    table = output[output.index("#### Training step") :]
    assert "vs autocast_bf16" in table and "ran in 2 processes" in table
    for name in ("autocast_bf16", "pure_bf16", "o2_bf16"):
        assert f"| {name} | " in table and f"| {name} | failed" not in table
    for name in ("liger_autocast_bf16", "liger_pure_bf16"):
        assert f"| {name} | " in table
        if not torch.cuda.is_available():
            assert f"- {name} (eager): skipped: Liger-Kernel" in table
    assert "by kind of kernel" in table and "| o2_bf16 eager |" in table.replace("| kind | ", "| ")
