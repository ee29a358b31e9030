"""Host cost of amp_fx's fused ops and of a tiny model's O2 training step, on CPU.

Where the tensors are tiny, a step is host work: Python, argument checks, dispatch and autograd
nodes, one per op. This script measures that cost where no GPU is needed:

(a) every fused op of ``amp_fx.ops`` on tiny tensors, through its kernels (``AMP_FX_FORCE_TRITON=0``:
    the pure-torch reference kernels, ``amp_fx.kernels.reference``, on the host path a GPU call
    takes; ``=1`` for the Triton kernels under ``TRITON_INTERPRET=1``): the median microseconds of
    one call, forward alone and forward + backward (``torch.autograd.grad``), beside the unfused
    torch chain it stands for;
(b) two tiny Hugging Face causal LMs trained with ``labels=``, a Llama (hidden 32, 4 layers,
    vocabulary 128) in bf16 and a GPT-2 (width 64, 12 layers, vocabulary 256) in fp16 with loss
    scaling: ``amp_fx.convert`` at O2 with `amp_fx.optim.FusedAdam` (and `amp_fx.LossScaler`), as a
    CPU user runs it (the fused norms, activations and rotary compute their torch expressions
    eagerly on a CPU, `amp_fx.kernels.kernels_run_for`) and with the reference kernels forced,
    against eager ``torch.autocast`` with ``torch.optim.AdamW(foreach=True)`` (and
    ``torch.amp.GradScaler``), median ms per step and the ratio.

One thread (``torch.set_num_threads(1)``), timed by its CPU time (``time.thread_time``): on a
machine shared with other work, wall time also counts the time the thread waits for a core, which
is not host work (``--wall`` times wall clock instead). The rows of (b) alternate step by step, so
a load that changes during the run reaches both. The load average is printed with the results::

    python benchmarks/bench_host_overhead.py [--repeats 300] [--steps 60] [--only ops|step] [--wall]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from reporting import environment

import amp_fx
import amp_fx.optim
from amp_fx.core.dtypes import dtype_name
from amp_fx.kernels import FORCE_TRITON_ENV
from amp_fx.ops import max_pool as max_pool_op
from amp_fx.ops.activations import fp32_activation, fp32_gated_activation
from amp_fx.ops.batch_norm import batch_norm_act
from amp_fx.ops.chunked_cross_entropy import chunked_linear_cross_entropy
from amp_fx.ops.cross_entropy import fp32_cross_entropy, linear_cross_entropy
from amp_fx.ops.fp8_linear import fp8_linear
from amp_fx.ops.norms import add_layer_norm_fp32, add_rms_norm_fp32, layer_norm_fp32, rms_norm_fp32
from amp_fx.ops.rotary import rotary_chain, rotary_embedding, rotary_embedding_pair

LOW = torch.bfloat16
EPS = 1e-6
# The clock every row reads: the thread's CPU time, or wall time with --wall (main sets it).
_clock = time.thread_time


@dataclass
class Case:
    """One fused op: its call and the torch chain it stands for, on the same inputs."""

    name: str
    fused: Callable[..., object]
    unfused: Callable[..., object]
    inputs: Callable[[], tuple]  # fresh inputs; the tensors that require grad are the leaves


def _randn(*shape: int, dtype: torch.dtype = LOW, grad: bool = True) -> torch.Tensor:
    return torch.randn(shape).to(dtype).requires_grad_(grad)


def _rms_chain(x, weight):
    # Llama's RMSNorm on a low-precision input, as amp_fx's O2 graph writes it.
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * y.to(LOW)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _rotary_pair_chain(q, k, cos, sin):
    return (q * cos + _rotate_half(q) * sin).to(LOW), (k * cos + _rotate_half(k) * sin).to(LOW)


def _pooled(shape):
    return torch.randn(shape).to(memory_format=torch.channels_last).requires_grad_(True)


def cases() -> list[Case]:
    """Every fused op of ``amp_fx.ops`` at a tiny size (2 x 8 tokens of width 32; 4 x 4 images)."""
    rows, width, vocab = (2, 8), 32, 128
    weight = torch.ones(width, requires_grad=True)
    bias = torch.zeros(width, requires_grad=True)
    channels = 8
    bn_weight = torch.ones(channels, requires_grad=True)
    bn_bias = torch.zeros(channels, requires_grad=True)

    def bn_inputs():
        x = torch.randn(2, channels, 4, 4).to(memory_format=torch.channels_last).requires_grad_(True)
        return x, torch.zeros(channels), torch.ones(channels)

    target = torch.randint(0, vocab, (rows[0] * rows[1],))
    head = _randn(vocab, width)
    fp8_weight = _randn(48, width)  # FP8 products take multiples of 16
    tables = (torch.randn(rows[0], 1, rows[1], 8), torch.randn(rows[0], 1, rows[1], 8))
    return [
        Case(
            "rms_norm_fp32 (Llama)",
            lambda x: rms_norm_fp32(x, weight, EPS, mid_dtype=LOW, out_dtype=LOW),
            lambda x: _rms_chain(x, weight).to(LOW),
            lambda: (_randn(*rows, width),),
        ),
        Case(
            "add_rms_norm_fp32 (Llama)",
            lambda x, r: add_rms_norm_fp32(x, r, weight, EPS, mid_dtype=LOW, out_dtype=LOW),
            lambda x, r: (lambda s: (s, _rms_chain(s, weight).to(LOW)))(x + r),
            lambda: (_randn(*rows, width), _randn(*rows, width, dtype=torch.float32)),
        ),
        Case(
            "layer_norm_fp32",
            lambda x: layer_norm_fp32(x, (width,), weight, bias, out_dtype=LOW),
            lambda x: F.layer_norm(x.float(), (width,), weight, bias).to(LOW),
            lambda: (_randn(*rows, width),),
        ),
        Case(
            "add_layer_norm_fp32",
            lambda x, r: add_layer_norm_fp32(x, r, (width,), weight, bias, out_dtype=LOW),
            lambda x, r: (lambda s: (s, F.layer_norm(s, (width,), weight, bias).to(LOW)))(x + r),
            lambda: (_randn(*rows, width), _randn(*rows, width, dtype=torch.float32)),
        ),
        Case(
            "rotary_embedding",
            lambda q: rotary_embedding(q, *tables, dtype=LOW),
            lambda q: rotary_chain(q, *tables, dtype=LOW),
            lambda: (_randn(rows[0], 4, rows[1], 8),),
        ),
        Case(
            "rotary_embedding_pair",
            lambda q, k: rotary_embedding_pair(q, k, *tables, dtypes=(LOW, LOW)),
            lambda q, k: _rotary_pair_chain(q, k, *tables),
            lambda: (_randn(rows[0], 4, rows[1], 8), _randn(rows[0], 2, rows[1], 8)),
        ),
        Case(
            "fp32_activation (gelu_tanh)",
            lambda x: fp32_activation(x, "gelu_tanh"),
            lambda x: F.gelu(x.float(), approximate="tanh").to(LOW),
            lambda: (_randn(*rows, 2 * width),),
        ),
        Case(
            "fp32_gated_activation (silu)",
            lambda g, u: fp32_gated_activation(g, u, "silu"),
            lambda g, u: (F.silu(g.float()) * u.float()).to(LOW),
            lambda: (_randn(*rows, 2 * width), _randn(*rows, 2 * width)),
        ),
        Case(
            "fp32_cross_entropy",
            lambda x: fp32_cross_entropy(x, target),
            lambda x: F.cross_entropy(x.float(), target),
            lambda: (_randn(rows[0] * rows[1], vocab),),
        ),
        Case(
            "linear_cross_entropy",
            lambda h: linear_cross_entropy(h, head, None, target),
            lambda h: F.cross_entropy(F.linear(h, head).float(), target),
            lambda: (_randn(rows[0] * rows[1], width),),
        ),
        Case(
            "chunked_linear_cross_entropy",
            lambda h: chunked_linear_cross_entropy(h, head, None, target),
            lambda h: F.cross_entropy(F.linear(h, head).float(), target),
            lambda: (_randn(rows[0] * rows[1], width),),
        ),
        Case(
            "batch_norm_act",
            lambda x, mean, var: batch_norm_act(x, bn_weight, bn_bias, mean, var, 0.1, 1e-5),
            lambda x, mean, var: F.relu(F.batch_norm(x, mean, var, bn_weight, bn_bias, True, 0.1, 1e-5)),
            bn_inputs,
        ),
        Case(
            "fp8_linear (rowwise)",
            lambda h: fp8_linear(h, fp8_weight, recipe="rowwise"),
            lambda h: F.linear(h, fp8_weight),
            lambda: (_randn(16, width),),
        ),
        Case(
            "max_pool2d (fused at any size)",
            lambda x: max_pool_op.max_pool2d(x, 3, 2, 1),
            lambda x: F.max_pool2d(x, 3, 2, 1),
            lambda: (_pooled((2, 8, 8, 8)),),
        ),
    ]


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _time_call(function: Callable[..., object], inputs: tuple, repeats: int) -> tuple[float, float]:
    """Median microseconds of one call: forward alone, and forward + backward of every output
    that has a gradient, into every input that requires one."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    forward, both = [], []
    for i in range(repeats + 10):
        start = _clock()
        out = function(*inputs)
        middle = _clock()
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.grad_fn is not None]
        grads = [torch.ones_like(t) for t in outs]
        backward_start = _clock()
        torch.autograd.grad(outs, leaves, grads, allow_unused=True)
        end = _clock()
        if i >= 10:  # warm-up
            forward.append(middle - start)
            both.append(middle - start + end - backward_start)
    return _median_us(forward), _median_us(both)


def op_table(repeats: int) -> str:
    """(a): one row per fused op."""
    lines = [
        "| fused op (CPU, tiny) | fused fwd us | torch fwd us | fused fwd+bwd us | torch fwd+bwd us |"
        " fwd+bwd ratio |",
        "|---|---|---|---|---|---|",
    ]
    # max_pool2d fuses only large inputs (its host cost above torch's is worth paying there); here
    # its host cost is the point.
    saved = max_pool_op.MIN_FUSED_ELEMENTS
    max_pool_op.MIN_FUSED_ELEMENTS = 0
    try:
        for case in cases():
            fused = _time_call(case.fused, case.inputs(), repeats)
            unfused = _time_call(case.unfused, case.inputs(), repeats)
            lines.append(
                f"| {case.name} | {fused[0]:.0f} | {unfused[0]:.0f} | {fused[1]:.0f} | {unfused[1]:.0f} | "
                f"{fused[1] / unfused[1]:.2f} |"
            )
    finally:
        max_pool_op.MIN_FUSED_ELEMENTS = saved
    return "\n".join(lines)


def tiny_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    """A randomly initialized 4-layer Llama of hidden size 32 and a 2 x 16 batch of tokens."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    return model, torch.randint(0, config.vocab_size, (2, 16))


def tiny_gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    """A randomly initialized GPT-2 of GPT-2 small's 12 layers, width 64, and a 2 x 32 batch."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=12, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    return model, torch.randint(0, config.vocab_size, (2, 32))


# The models of table (b): each built by its function, trained in its dtype; fp16 with loss scaling
# (amp_fx.LossScaler against torch.amp.GradScaler), as each recipe trains it.
STEP_MODELS = {"tiny Llama": (tiny_llama, torch.bfloat16), "tiny GPT-2": (tiny_gpt2, torch.float16)}


def _o2_step(model: torch.nn.Module, tokens: torch.Tensor, dtype: torch.dtype) -> Callable[[], None]:
    converted = amp_fx.convert(model, policy=amp_fx.preset("O2", dtype, "cpu"))
    params = [p for p in converted.parameters() if p.requires_grad]
    optimizer = amp_fx.optim.FusedAdam(params, lr=1e-3, adam_w_mode=True, master_weights=True)
    scaler = amp_fx.LossScaler(enabled=dtype == torch.float16)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(converted(input_ids=tokens, labels=tokens).loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


def _autocast_step(model: torch.nn.Module, tokens: torch.Tensor, dtype: torch.dtype) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = model(input_ids=tokens, labels=tokens).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


@contextlib.contextmanager
def _kernels_forced() -> Iterator[None]:
    """The fused ops run their kernels (the reference on a CPU) while inside."""
    previous = os.environ.get(FORCE_TRITON_ENV)
    os.environ.setdefault(FORCE_TRITON_ENV, "0")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FORCE_TRITON_ENV)


def _forced(step: Callable[[], None]) -> Callable[[], None]:
    def forced_step() -> None:
        with _kernels_forced():
            step()

    return forced_step


def step_table(steps: int) -> str:
    """(b): each tiny model's step, O2 + FusedAdam (as CPU users run it, and on the reference
    kernels) against eager autocast + AdamW."""
    lines = ["| tiny model step (CPU) | median ms | ratio |", "|---|---|---|"]
    for model_name, (build, dtype) in STEP_MODELS.items():
        model, tokens = build()
        baseline_name = f"{model_name}: autocast({dtype_name(dtype)}) + AdamW(foreach)"
        variants = {
            f"{model_name}: amp_fx O2 + FusedAdam": _o2_step(copy.deepcopy(model), tokens, dtype),
            "same, the kernels' reference forced": _forced(_o2_step(copy.deepcopy(model), tokens, dtype)),
            baseline_name: _autocast_step(copy.deepcopy(model), tokens, dtype),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(steps + 5):
            for name, step in variants.items():
                start = _clock()
                step()
                if i >= 5:  # warm-up
                    times[name].append(_clock() - start)
        medians = {name: statistics.median(samples) * 1e3 for name, samples in times.items()}
        baseline = medians[baseline_name]
        lines += [f"| {name} | {ms:.2f} | {ms / baseline:.2f} |" for name, ms in medians.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=300, help="timed calls per op row")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    parser.add_argument("--only", choices=("ops", "step"), help="one of the two tables")
    parser.add_argument("--wall", action="store_true", help="time wall clock, not the thread's CPU time")
    args = parser.parse_args(argv)
    global _clock
    _clock = time.perf_counter if args.wall else time.thread_time
    torch.set_num_threads(1)
    clock = "wall time" if args.wall else "the thread's CPU time"
    print(f"{environment(torch.device('cpu'))}, load average {os.getloadavg()[0]:.2f} (1 min), {clock}")
    if args.only != "step":
        with _kernels_forced():
            print(op_table(args.repeats))
    if args.only != "ops":
        print(step_table(args.steps))


if __name__ == "__main__":
    main()
