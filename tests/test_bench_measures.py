"""The measuring side of benchmarks/bench_train.py (issue 25): GPU time summed by kind of kernel
(benchmarks/kernel_breakdown.py) and variants run in fresh processes (benchmarks/isolated_runs.py:
the Liger-Kernel rows, compiled peak memory measured alone); model FLOPs and MFU per row
(benchmarks/train_flops.py, issue 41), checked against hand counts and torch's FLOP counter.

The kernel rules are checked on names the H200's profiles show (cuBLAS, cuDNN, torch's
elementwise and reduce kernels, Inductor's generated Triton kernels); the whole path runs on the
CPU, where the same rules sort the ops' self CPU time.
"""

from __future__ import annotations

import argparse
import doctest
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

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
# bench_train's modules import each other by their file names: benchmarks/ last on the path, so
# that none of its names (models, reporting) hides an installed module.
if os.path.abspath(_BENCHMARKS) not in sys.path:
    sys.path.append(os.path.abspath(_BENCHMARKS))
_path = list(sys.path)
import bench_train  # noqa: E402  (it puts benchmarks/ first on the path, for a script's sake)

sys.path[:] = _path
import models  # noqa: E402
import train_flops  # noqa: E402
import train_report  # noqa: E402
import train_variants  # noqa: E402
from train_timing import Result  # noqa: E402

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


# ---------------------------------------------------------------------------------------------
# Model FLOPs and MFU (benchmarks/train_flops.py)
# ---------------------------------------------------------------------------------------------


def test_the_llama_32_1b_step_is_134_7_tflop_as_counted_by_hand() -> None:
    """Issue 41's check value: the Llama-3.2-1B shape at 4 x 4096 tokens is 134.7 TFLOP a step."""
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192  # q, o; k, v (8 x 64 wide); gate, up, down
    matmul_parameters = 16 * per_layer + 2048 * 128256  # the tied LM head once, the lookup not
    tokens = 4 * 4096
    attention = 3 * (2 * 2 * 4 * 4096**2 * 2048 * 16) // 2  # forward's two products, causal half, x3
    hand = 6 * matmul_parameters * tokens + attention
    assert matmul_parameters == 1_235_746_816
    flops = train_flops.step_flops("hf_llama32_1b", small=False, batch_size=None, seq_len=None)
    assert flops.total == hand
    assert flops.total == pytest.approx(134.7e12, rel=0.01)
    assert str(flops).startswith(
        "Model FLOPs per step: 134.7 TFLOP (6 x 1.236B matmul parameters x 16384 tokens"
    )


def _matmul_weights(model: torch.nn.Module) -> int:
    """Weights of the model's matmul layers: nn.Linear and transformers' Conv1D (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "hf_llama", "hf_llama_liger", "hf_llama32_1b"])
def test_matmul_parameters_are_the_full_size_models_matmul_weights(name: str) -> None:
    """Counted from the config, they are the weights of the model's linear layers (built on the
    meta device); a tied LM head is a linear layer whose weight is the embedding table's."""
    if name == "gpt":
        config = models.GPT2_SMALL
        with torch.device("meta"):
            model = models.GPT(config)
    else:
        config = models.hf_config(name, small=False, seq_len=models.TOKEN_SHAPES[name][0][1])
        with torch.device("meta"):
            model = models.hf_model(name, config)
    assert train_flops.transformer_shape(config).matmul_parameters == _matmul_weights(model)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "hf_llama32_1b"])
def test_training_flops_are_what_torchs_flop_counter_counts_of_a_step(name: str) -> None:
    """One forward and backward of the CPU-size model under torch.utils.flop_counter, attention
    as explicit matmuls: the linear layers' FLOPs are 6 x matmul parameters x tokens exactly, and
    attention's are twice the causal count (the counter counts the masked half too)."""
    batch, seq = models.token_shape(name, small=True, batch_size=None, seq_len=None)
    config = models.hf_config(name, small=True, seq_len=seq)
    config._attn_implementation = "eager"  # attention as bmm, which the counter sees on a CPU
    torch.manual_seed(0)
    model = models.hf_model(name, config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens, labels=tokens).loss.backward()
    counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    shape = train_flops.transformer_shape(config)
    dense = 6 * shape.matmul_parameters * batch * seq
    assert counted.get("aten.mm", 0) + counted.get("aten.addmm", 0) == dense
    assert counted["aten.bmm"] == 2 * (train_flops.training_flops(shape, batch, seq) - dense)


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_to() -> None:
    config = models.hf_config("hf_mixtral", small=False, seq_len=2048)
    shape = train_flops.transformer_shape(config)
    # hidden 1024; 16 heads of 64 for q, o; 8 of 64 for k, v; 2 of 8 experts of 3 x 1024 x 3584; router
    per_layer = 2 * 1024 * 1024 + 2 * 1024 * 512 + 2 * 3 * 1024 * 3584 + 1024 * 8
    assert shape.matmul_parameters == 8 * per_layer + 1024 * 32000


def test_resnet_flops_are_three_forwards_of_convolutions_and_matmuls() -> None:
    """ResNet-50's forward is 4.09 G multiply-adds an image (torchvision's published 4.09 GFLOPS)."""
    flops = train_flops.step_flops("resnet50", small=False, batch_size=2, seq_len=None)
    assert flops.total == pytest.approx(3 * 2 * 2 * 4.09e9, rel=0.01)


def test_the_dense_peak_is_known_for_the_h100_sxm_and_h200_in_16_bits_only(monkeypatch) -> None:
    cuda = torch.device("cuda")
    names = iter(["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert train_flops.dense_peak_flops(cuda, torch.bfloat16) == 989e12
    assert train_flops.dense_peak_flops(cuda, torch.float16) == 989e12
    assert train_flops.dense_peak_flops(cuda, torch.float32) is None
    assert train_flops.dense_peak_flops(cuda, torch.bfloat16) is None  # a PCIe card: not in the table
    assert train_flops.dense_peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_the_table_states_tflops_mfu_and_issue_41s_targets(monkeypatch) -> None:
    """hf_llama32_1b on an H200: an O2 step of 248 ms is 543 TFLOP/s, 54.9% of 989 (the MFU
    target of 55% just missed); every O2 row's peak is checked against autocast's of its dtype."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    flops = train_flops.step_flops("hf_llama32_1b", small=False, batch_size=None, seq_len=None)
    results = {
        ("autocast_bf16", "eager"): Result(median_ms=420.0, peak_gib=70.0),
        ("o2_bf16", "eager"): Result(median_ms=248.0, peak_gib=41.0),
        ("o2_bf16_low_residual", "eager"): Result(median_ms=240.0, peak_gib=71.0),
        ("fp32", "eager"): Result(median_ms=4000.0, peak_gib=80.0),
    }
    variants = [train_variants.VARIANTS[name] for name, _ in results]
    table = train_report.format_table(
        "hf_llama32_1b", variants, ["eager"], results, "t", flops, torch.device("cuda"), "autocast_bf16"
    )
    assert "| eager ms/step | eager vs autocast_bf16 | eager peak GiB | eager TFLOP/s | eager MFU |" in table
    tflops = flops.total / 0.248 / 1e12
    assert f"| o2_bf16 | 248.0 | 0.59x | 41.00 | {tflops:.1f} | {tflops / 989:.1%} |" in table
    assert "| fp32 | 4000.0 | 9.52x | 80.00 | 33.7 | - |" in table  # no fp32 peak: no MFU
    assert "NVIDIA H200's dense peak (bfloat16 989 TFLOP/s)" in table and "No MFU for float32" in table
    assert "- eager: o2_bf16 takes 0.59x autocast_bf16's time (issue 41: <= 0.6): met" in table
    assert "- eager: o2_bf16 MFU (issue 41: >= 55%): 54.9%, missed" in table
    assert "- eager: o2_bf16 peak 41.00 GiB vs autocast_bf16 70.00 GiB (issue 41: <=): met" in table
    assert (
        "- eager: o2_bf16_low_residual peak 71.00 GiB vs autocast_bf16 70.00 GiB (issue 41: <=): missed"
        in table
    )


def test_compile_mode_is_the_command_lines_else_the_models_under_inductor() -> None:
    args = bench_train.parse_args(["--models", "hf_llama_liger,hf_gpt2", "--compile-backend", "inductor"])
    assert train_variants.compile_mode("hf_llama_liger", args) == "max-autotune-no-cudagraphs"
    assert train_variants.compile_mode("hf_gpt2", args) is None
    args = bench_train.parse_args(["--compile-backend", "inductor", "--compile-mode", "default"])
    assert train_variants.compile_mode("hf_llama_liger", args) == "default"
    args = bench_train.parse_args(["--device", "cpu"])  # the eager backend takes no mode
    assert train_variants.compile_mode("hf_llama_liger", args) is None
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--device", "cpu", "--compile-mode", "max-autotune"])


def test_a_compiled_row_is_compiled_in_its_mode(monkeypatch) -> None:
    """build_step hands the mode to torch.compile (recorded here instead of compiling)."""
    import train_step

    seen = {}

    def fake_compile(function, **options):
        seen.update(options)
        return function

    monkeypatch.setattr(torch, "compile", fake_compile)
    args = argparse.Namespace(small=True, batch_size=None, seq_len=None, no_kv_cache=False)
    work = train_step.make_workload("gpt", args, torch.device("cpu"))
    step = train_step.build_step(
        train_variants.VARIANTS["autocast_bf16"], work, "compile", "inductor", "max-autotune"
    )
    step()
    assert seen == {"backend": "inductor", "mode": "max-autotune"}


@pytest.mark.parametrize("module", [train_flops, train_variants], ids=lambda m: m.__name__)
def test_docstring_examples(module) -> None:
    failures, _ = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert failures == 0


@pytest.mark.slow
def test_the_llama_32_1b_shape_runs_at_cpu_size_with_tflops_per_row() -> None:
    """hf_llama32_1b's default rows (autocast_bf16, o2_bf16), eager and compiled, at CPU size."""
    command = [
        sys.executable,
        os.path.join(_BENCHMARKS, "bench_train.py"),
        "--small",
        "--models",
        "hf_llama32_1b",
    ]
    command += ["--steps", "1", "--rounds", "1"]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(os.path.join(_BENCHMARKS, os.pardir))}
    output = subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=600).stdout
    table = output[output.index("#### Training step") :]
    assert "compile TFLOP/s | compile MFU |" in table and "Model FLOPs per step:" in table
    for name in ("autocast_bf16", "o2_bf16"):
        assert f"| {name} | " in table and "failed" not in table
