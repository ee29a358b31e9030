"""Every Triton kernel the project launches compiles for an H100/H200 (sm_90), without a GPU.

CI has no GPU: the other kernel tests run the kernels under ``TRITON_INTERPRET=1``, which accepts
code the real compiler rejects. Here each public wrapper (``amp_fx.kernels.triton_ops``) is called
once per configuration on CPU tensors while every ``kernel[grid](...)`` launch is recorded instead
of run (the kernel object's ``run``, which ``KernelInterface.__getitem__`` calls, is replaced), so
the launch signatures are the project's own: pointer element types, scalar values, constexpr
values (dtypes, flags, block sizes fitted to the shapes) and ``num_warps``. Since nothing runs, the
shapes are realistic (a GPT vocabulary, a ResNet stem). The distinct launches go as JSON to
``hopper_compile.py``, a subprocess without ``TRITON_INTERPRET`` (there the kernels are
JITFunctions, which the real compiler needs), which specializes them as ``JITFunction.run`` does
and compiles each through ptxas for ``GPUTarget("cuda", 90, 32)``.

The default run compiles a fixed subset (`_default_subset`): each kernel's first launch per 16-bit
type (fp16, bf16, none) and per combination of its other constexprs (flags, block and window sizes)
and launch options, so every kernel, every dtype and every constexpr branch is compiled: 105 of the
133 distinct launches of the 21 kernels, about 25 s of compiler time shared by one compiler process
per core. ``-m slow`` compiles the other 15, which repeat a compiled combination in another dtype or
differ only in non-constexpr sizes. Ints are specialized by their recorded values (== 1, divisible
by 16) as the JIT would for these shapes; other sizes give other variants of the same code.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import amp_fx.kernels  # noqa: E402
from amp_fx.kernels import triton_ops  # noqa: E402

HOPPER_COMPILE = Path(__file__).with_name("hopper_compile.py")
COMPILE_TIMEOUT_S = 300  # the default run's compiles take about 25 s of CPU time
KERNEL_CLASSES = (InterpretedFunction, JITFunction)
LOW_NAMES = {"float16": "fp16", "bfloat16": "bf16"}  # torch dtype names as Triton's type names


def _skip_without_cuda_compiler() -> None:
    """Skip only where this Triton truly has no NVIDIA backend. Where it has one, ptxas ships with
    it, so failing to find it is a Triton API change or a broken install: a failure, never a skip
    (which would silently drop CI's only sm_90 compile check)."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip(f"this Triton has no CUDA backend (backends: {sorted(backends)})")
    from triton import knobs

    ptxas = knobs.nvidia.ptxas.path
    assert ptxas and os.access(ptxas, os.X_OK), (
        f"Triton has its NVIDIA backend but no runnable ptxas (path {ptxas!r}): the sm_90 compile "
        "check cannot run; fix the install or this lookup, do not skip"
    )


# --- Recording launches ---------------------------------------------------------------------------


def _encode(value: object, where: str) -> object:
    """A launch argument as JSON, for hopper_compile.py's _decode."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return {"tensor": dtype, "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.dtype) and not isinstance(value, tl.pointer_type):
        return {"tl_dtype": value.name}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"{where}: cannot record an argument of type {type(value).__name__}; extend _encode")


@contextlib.contextmanager
def _recording_launches() -> Iterator[list[dict]]:
    """Within it, ``kernel[grid](...)`` records the launch (module, kernel, arguments by name,
    launch options) instead of running it. The wrappers never read a kernel's output on the host
    (the kernel contract forbids syncs), so their later launches are the same as when run."""
    launches: list[dict] = []

    def record(kernel, *args, grid, warmup, **kwargs):
        fn = kernel.fn
        where = f"{fn.__module__}.{fn.__name__}"
        parameters = inspect.signature(fn).parameters
        options = {k: v for k, v in kwargs.items() if k not in parameters}
        bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in parameters})
        bound.apply_defaults()
        launches.append(
            {
                "module": fn.__module__,
                "kernel": fn.__name__,
                "args": {name: _encode(v, f"{where}({name}=...)") for name, v in bound.arguments.items()},
                "options": {name: _encode(v, f"{where} option {name}") for name, v in options.items()},
            }
        )

    saved = {cls: cls.__dict__["run"] for cls in KERNEL_CLASSES}
    try:
        for cls in KERNEL_CLASSES:
            cls.run = record
        yield launches
    finally:
        for cls, run in saved.items():
            cls.run = run


# --- The wrapper calls whose launches are compiled ------------------------------------------------
# Each wrapper's first call is its most featured configuration, so the default run, which compiles
# each kernel's first launch per 16-bit type, compiles the most code; later calls add the other
# constexpr branches and shapes.

LOW_DTYPES = (torch.float16, torch.bfloat16)
ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flag() -> torch.Tensor:
    return torch.zeros(1)


def _optimizer_state(dtypes: tuple[torch.dtype, ...], masters: bool) -> dict:
    """Two tensors per dtype (sizes not multiples of the chunk), fp32 masters for low dtypes."""
    params = [torch.zeros(n, dtype=d) for d in dtypes for n in (5000, 77)]
    return {
        "params": params,
        "grads": [torch.zeros_like(p) for p in params],
        "masters": [p.float() if masters and p.dtype != torch.float32 else None for p in params],
        "states": [torch.zeros_like(p, dtype=torch.float32) for p in params],
        "step": torch.zeros(1),
        "step_offsets": [torch.zeros(()) for _ in params],
    }


def _check_finite_calls() -> None:
    grads = [torch.zeros(n, dtype=d) for d in ALL_DTYPES for n in (9000, 3)]
    triton_ops.check_finite_and_norm_(grads, _flag(), grad_multiplier=_flag(), sq_norm_out=_flag())
    triton_ops.check_finite_and_norm_(grads, _flag())


def _adam_calls() -> None:
    for dtypes, adam_w_mode, weight_decay, scaled in [
        (LOW_DTYPES + (torch.float32,), True, 0.01, True),  # AdamW, unscaled and skippable
        (LOW_DTYPES, False, 0.01, False),  # L2 weight decay
        ((torch.float16,), True, 0.0, False),
    ]:
        s = _optimizer_state(dtypes, masters=True)
        triton_ops.adam_step_(
            s["params"],
            s["grads"],
            s["masters"],
            s["states"],
            [torch.zeros_like(t) for t in s["states"]],
            s["step"],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            grad_multiplier=_flag() if scaled else None,
            found_inf=_flag() if scaled else None,
            step_offsets=s["step_offsets"] if scaled else None,  # per-param counts, as the optimizer
        )
    s = _optimizer_state((torch.float16,), masters=False)  # O3: fp16 params updated in place
    triton_ops.adam_step_(
        s["params"],
        s["grads"],
        None,
        s["states"],
        [t.clone() for t in s["states"]],
        s["step"],
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adam_w_mode=True,
    )


def _sgd_calls() -> None:
    for dtypes, momentum, nesterov, weight_decay, scaled in [
        (LOW_DTYPES + (torch.float32,), 0.9, True, 1e-4, True),
        (LOW_DTYPES, 0.9, False, 0.0, False),
        ((torch.float16,), 0.0, False, 0.0, False),  # plain SGD: no momentum buffers
    ]:
        s = _optimizer_state(dtypes, masters=True)
        triton_ops.sgd_step_(
            s["params"],
            s["grads"],
            s["masters"],
            s["states"] if momentum else None,
            s["step"],
            lr=0.1,
            momentum=momentum,
            dampening=0.0,
            weight_decay=weight_decay,
            nesterov=nesterov,
            grad_multiplier=_flag() if scaled else None,
            found_inf=_flag() if scaled else None,
            step_offsets=s["step_offsets"] if scaled else None,
        )


def _cross_entropy_calls() -> None:
    # A GPT vocabulary (full 4096-wide blocks, 8 warps), then a narrow row (shrunk block and warps).
    for dtype, num_classes in [(d, 50304) for d in ALL_DTYPES] + [(torch.float16, 10)]:
        logits = torch.zeros(4, num_classes, dtype=dtype)
        target = torch.zeros(4, dtype=torch.int64)
        _, lse = triton_ops.cross_entropy_forward(logits, target, -100)
        triton_ops.cross_entropy_backward(torch.zeros(4), logits, target, lse, -100)
        triton_ops.cross_entropy_forward_with_grad(logits, target, -100)


def _channels_last(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)


def _batch_norm_calls() -> None:
    configs = [
        # (shape, dtype, weight dtype or None, residual, relu)
        ((8, 64, 14, 14), torch.float16, torch.float32, True, True),  # ResNet block end, O1/O2
        ((8, 64, 14, 14), torch.bfloat16, torch.float32, True, True),
        ((8, 64, 14, 14), torch.float32, torch.float32, False, True),
        ((8, 256, 7, 7), torch.float16, torch.float16, False, False),  # O3: fp16 weights
        ((8, 256, 7, 7), torch.bfloat16, torch.bfloat16, False, False),
        ((8, 64, 14, 14), torch.float16, None, False, False),  # affine=False
    ]
    for shape, dtype, weight_dtype, residual, relu in configs:
        x = _channels_last(shape, dtype)
        channels = shape[1]
        weight = None if weight_dtype is None else torch.ones(channels, dtype=weight_dtype)
        bias = None if weight_dtype is None else torch.zeros(channels, dtype=weight_dtype)
        out, mean, invstd, _ = triton_ops.batch_norm_act_forward(
            x,
            weight,
            bias,
            _channels_last(shape, dtype) if residual else None,
            1e-5,
            relu,
            running_mean=torch.zeros(channels),
            running_var=torch.ones(channels),
        )
        triton_ops.batch_norm_act_backward(
            torch.zeros_like(x), x, weight, bias, mean, invstd, out, residual, relu
        )
    # A 2-D (M, C) input, as after a Linear (BatchNorm1d).
    x = torch.zeros(32, 512, dtype=torch.float16)
    out, mean, invstd, _ = triton_ops.batch_norm_act_forward(x, None, None, None, 1e-5, True)
    triton_ops.batch_norm_act_backward(torch.zeros_like(x), x, None, None, mean, invstd, out, False, True)


def _max_pool_calls() -> None:
    windows = [
        # (shape, kernel, stride, padding, dilation): ResNet stem; 2x2/2; dilated (backward loop
        # over window rows not unrolled: 25 windows reach one input element)
        ((8, 64, 112, 112), (3, 3), (2, 2), (1, 1), (1, 1)),
        ((8, 256, 14, 14), (2, 2), (2, 2), (0, 0), (1, 1)),
        ((2, 64, 28, 28), (3, 3), (1, 1), (1, 1), (2, 2)),
    ]
    for (shape, kernel, stride, padding, dilation), dtype in [(w, torch.float16) for w in windows] + [
        (windows[0], torch.bfloat16),
        (windows[0], torch.float32),
    ]:
        x = _channels_last(shape, dtype)
        out, offsets = triton_ops.max_pool2d_forward(x, kernel, stride, padding, dilation, False)
        triton_ops.max_pool2d_backward(
            torch.zeros_like(out), offsets, shape, kernel, stride, padding, dilation
        )


def _loss_scale_calls() -> None:
    for num_flags, bounds, inv_scale, zero_flags in [
        (2, True, True, True),  # LossScaler with bounds, two optimizers' flags
        (1, False, False, False),
        (6, False, True, False),  # more flags than pointer arguments: the rest summed first
    ]:
        triton_ops.update_loss_scale_(
            torch.full((), 65536.0),
            torch.zeros((), dtype=torch.int32),
            torch.ones((), dtype=torch.int32),
            [_flag() for _ in range(num_flags)],
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=2000,
            hysteresis=1,
            min_scale=1.0 if bounds else None,
            max_scale=2.0**24 if bounds else None,
            inv_scale_out=torch.zeros(()) if inv_scale else None,
            zero_found_infs=zero_flags,
        )


def _rotary_calls() -> None:
    # Llama's query and key (12 and 4 heads of 128, transposed views) in one launch, the key kept
    # fp32 (a KV cache); GPT-J's interleaved partial rotary (64 of 256) on one tensor, heads third.
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.zeros(1, 64, 12, 128, dtype=dtype).transpose(1, 2)
        k = torch.zeros(1, 64, 4, 128, dtype=dtype).transpose(1, 2)
        cos = torch.zeros(1, 1, 64, 128)
        q_out, k_out = triton_ops.rotary_forward([q, k], cos, cos, False, [dtype, torch.float32])
        triton_ops.rotary_backward([q_out, k_out], cos, cos, False, [dtype, dtype])
        x = torch.zeros(1, 64, 16, 256, dtype=dtype)
        cos = torch.zeros(1, 64, 1, 64)
        (out,) = triton_ops.rotary_forward([x], cos, cos, True, [torch.float32])
        triton_ops.rotary_backward([out], cos, cos, True, [dtype])
        # Recording the range statistics of what it writes (amp_fx.watch): both outputs of one
        # launch, and a partial rotary's, pass-through features included.
        amax, counts = torch.zeros(8), torch.zeros(24, dtype=torch.int64)
        cos = torch.zeros(1, 1, 64, 128)
        triton_ops.rotary_forward([q, k], cos, cos, False, [dtype, dtype], (amax, counts, (1, 2)))
        cos = torch.zeros(1, 64, 1, 64)
        triton_ops.rotary_forward([x], cos, cos, True, [dtype], (amax, counts, (3,)))


def _norms_calls() -> None:
    configs = [
        # (x dtype, residual dtype, weight dtype, subtract_mean, weight_offset, mid_dtype, width)
        (torch.bfloat16, torch.float32, torch.float32, False, 0.0, None, 1536),  # Llama at O2
        (torch.float16, torch.float32, torch.float32, False, 0.0, None, 1536),
        (torch.bfloat16, torch.float32, torch.float32, True, 0.0, None, 768),  # GPT-2 at O2
        (torch.float16, torch.float32, torch.float32, True, 0.0, None, 768),
        (torch.bfloat16, None, torch.float32, False, 1.0, None, 2048),  # Gemma
        (torch.bfloat16, torch.bfloat16, torch.bfloat16, False, 0.0, torch.bfloat16, 4096),  # low stream
        (torch.float16, None, torch.float16, False, 0.0, torch.float16, 8192),
        (torch.float32, None, None, False, 0.0, None, 123),  # no weight, a narrow odd row
    ]
    for dtype, residual_dtype, weight_dtype, subtract_mean, offset, mid, width in configs:
        x = torch.zeros(16, width, dtype=dtype)
        residual = None if residual_dtype is None else torch.zeros(16, width, dtype=residual_dtype)
        weight = None if weight_dtype is None else torch.ones(width, dtype=weight_dtype)
        bias = torch.zeros(width) if subtract_mean else None
        options = {"subtract_mean": subtract_mean, "weight_offset": offset, "mid_dtype": mid}
        out, summed, mean, rstd = triton_ops.norm_forward(
            x, weight, bias, 1e-6, residual=residual, out_dtype=torch.bfloat16, **options
        )
        bias_dtype = None if bias is None else bias.dtype
        triton_ops.norm_backward(
            torch.zeros_like(out), None if summed is None else torch.zeros_like(summed),
            x if summed is None else summed, weight, mean, rstd, bias_dtype=bias_dtype,
            grad_dtype=dtype, residual_grad_dtype=residual_dtype, **options,
        )  # fmt: skip
    # Recording the range statistics of what it writes (amp_fx.watch): out alone, and out and a
    # low-precision sum.
    amax, counts = torch.zeros(8), torch.zeros(24, dtype=torch.int64)
    x = torch.zeros(16, 1536, dtype=torch.bfloat16)
    triton_ops.norm_forward(
        x, torch.ones(1536), None, 1e-6, out_dtype=torch.bfloat16, record=(amax, counts, (3, None))
    )
    triton_ops.norm_forward(
        x, torch.ones(1536), torch.zeros(1536), 1e-6, residual=x, subtract_mean=True, out_dtype=torch.float16,
        record=(amax, counts, (1, 2)),
    )  # fmt: skip


def _activation_calls() -> None:
    # Llama's SwiGLU (the two halves of one projection, read in place) and GPT-2's lone tanh GELU,
    # every activation in each 16-bit dtype.
    for dtype in (torch.float16, torch.bfloat16):
        for activation in ("silu", "gelu", "gelu_tanh"):
            gate, up = torch.zeros(64, 2 * 4096, dtype=dtype).chunk(2, dim=-1)
            out = triton_ops.gated_activation_forward(gate, up, activation)
            triton_ops.gated_activation_backward(torch.zeros_like(out), gate, up, activation)
            x = torch.zeros(64, 3072, dtype=dtype)
            triton_ops.activation_backward(triton_ops.activation_forward(x, activation), x, activation)
            # Recording the range statistics of the output (amp_fx.watch).
            amax, counts = torch.zeros(8), torch.zeros(24, dtype=torch.int64)
            triton_ops.gated_activation_forward(gate, up, activation, (amax, counts, (5,)))
            triton_ops.activation_forward(x, activation, (amax, counts, (0,)))


def _range_stats_calls() -> None:
    # A GPT activation in each dtype (many programs, each looping), and a one-element value.
    amax, counts = torch.zeros(8), torch.zeros(24, dtype=torch.int64)
    for dtype in ALL_DTYPES:
        triton_ops.record_range_(torch.zeros(16, 1024, 768, dtype=dtype), amax, counts, 3)
    triton_ops.record_range_(torch.zeros(1, dtype=torch.float16), amax, counts, 0)


WRAPPER_CALLS: list[Callable[[], None]] = [
    _check_finite_calls,
    _adam_calls,
    _sgd_calls,
    _cross_entropy_calls,
    _batch_norm_calls,
    _max_pool_calls,
    _loss_scale_calls,
    _rotary_calls,
    _activation_calls,
    _norms_calls,
    _range_stats_calls,
]


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    """The distinct launches of all WRAPPER_CALLS, in first-seen order."""
    with _recording_launches() as recorded:
        for call in WRAPPER_CALLS:
            call()
    distinct: dict[str, dict] = {}
    for launch in recorded:
        distinct.setdefault(json.dumps(launch, sort_keys=True), launch)
    return list(distinct.values())


def _kernel_name(launch: dict) -> str:
    return f"{launch['module']}.{launch['kernel']}"


def _low_precision_types(launch: dict) -> tuple[str, ...]:
    """The 16-bit float types a launch handles (pointer element types and dtype constexprs), e.g.
    ("bf16",); () for an all-fp32 launch."""
    names = {v.get("tensor") or v.get("tl_dtype") for v in launch["args"].values() if isinstance(v, dict)}
    return tuple(sorted({"fp16", "bf16"} & {LOW_NAMES.get(n, n) for n in names}))


def _constexpr_branch(launch: dict) -> str:
    """The launch's constexpr arguments other than dtypes (flags, block and window sizes) and its
    launch options: what selects the code compiled, apart from the types."""
    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"]).fn
    parameters = inspect.signature(fn).parameters
    constexprs = {
        name: value
        for name, value in launch["args"].items()
        if "constexpr" in str(parameters[name].annotation) and not isinstance(value, dict)
    }
    return json.dumps([constexprs, launch["options"]], sort_keys=True)


def _default_subset(launches: list[dict]) -> list[dict]:
    """The first launch of each kernel per 16-bit type (fp16, bf16, none), where the compiler and
    the interpreter differ most (conversions to and from fp16/bf16), and per constexpr branch
    (`_constexpr_branch`), in first-seen order. Left for ``-m slow``: a branch again in another
    dtype, or the same code at other non-constexpr sizes."""
    first: dict[tuple, dict] = {}
    for launch in launches:
        first.setdefault((_kernel_name(launch), _low_precision_types(launch)), launch)
        first.setdefault((_kernel_name(launch), _constexpr_branch(launch)), launch)
    return list({json.dumps(launch, sort_keys=True): launch for launch in first.values()}.values())


def _launched_kernels() -> set[str]:
    """``module.name`` (where it is defined) of every @triton.jit function in amp_fx.kernels that a
    module launches (``name[grid](...)``); helpers called from kernels are compiled as part of them."""
    launched = set()
    for info in pkgutil.walk_packages(amp_fx.kernels.__path__, prefix="amp_fx.kernels."):
        module = importlib.import_module(info.name)
        source = inspect.getsource(module)
        for name, value in vars(module).items():
            if isinstance(value, KERNEL_CLASSES) and re.search(rf"\b{re.escape(name)}\[", source):
                launched.add(f"{value.fn.__module__}.{value.fn.__name__}")
    return launched


def _compile(launches: list[dict], tmp_path: Path) -> tuple[dict, list[dict]]:
    """hopper_compile.py's (canary result, results) for ``launches``, in a fresh process without
    TRITON_INTERPRET."""
    launches_file, results_file = tmp_path / "launches.json", tmp_path / "results.json"
    launches_file.write_text(json.dumps(launches, indent=1))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")  # compiled for real, not from a cache
    try:
        done = subprocess.run(
            [sys.executable, str(HOPPER_COMPILE), str(launches_file), str(results_file)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling {len(launches)} launches for sm_90 took over {COMPILE_TIMEOUT_S} s")
    assert done.returncode == 0, f"{HOPPER_COMPILE.name} failed:\n{done.stdout}\n{done.stderr}"
    output = json.loads(results_file.read_text())
    assert len(output["results"]) == len(launches)
    return output["canary"], output["results"]


def _assert_all_compile(launches: list[dict], tmp_path: Path) -> None:
    _skip_without_cuda_compiler()
    canary, results = _compile(launches, tmp_path)
    assert canary["error"] is not None and "power of 2" in canary["error"], (
        f"the check let through a kernel the compiler rejects (hopper_compile.CANARY_LAUNCH): {canary}"
    )
    failures = [
        f"{_kernel_name(launch)} does not compile for sm_90\n"
        f"  signature: {result['signature']}\n  constexprs: {result['constexprs']}\n"
        f"  options: {launch['options']}\n  error: {result['error']}"
        for launch, result in zip(launches, results, strict=True)
        if result["error"] is not None
    ]
    assert not failures, f"{len(failures)} of {len(launches)} launches fail:\n\n" + "\n\n".join(failures)


def test_every_launched_kernel_is_recorded(launches: list[dict]) -> None:
    recorded = {_kernel_name(launch) for launch in launches}
    missing = _launched_kernels() - recorded
    assert not missing, f"kernels launched by amp_fx.kernels but not by WRAPPER_CALLS: {sorted(missing)}"
    assert len(recorded) == 21, sorted(recorded)


def test_fp16_and_bf16_variants_are_recorded(launches: list[dict]) -> None:
    for kernel in {_kernel_name(launch) for launch in launches}:
        types = {
            t for launch in launches if _kernel_name(launch) == kernel for t in _low_precision_types(launch)
        }
        assert types in (set(), {"fp16", "bf16"}), f"{kernel} is launched with {types or 'fp32 only'}"


def test_each_kernel_compiles_for_sm90_per_dtype_and_branch(launches: list[dict], tmp_path: Path) -> None:
    _assert_all_compile(_default_subset(launches), tmp_path)


@pytest.mark.slow
def test_every_other_recorded_launch_compiles_for_sm90(launches: list[dict], tmp_path: Path) -> None:
    """The launches the default run leaves out: the other constexpr combinations and shapes."""
    default = {json.dumps(launch, sort_keys=True) for launch in _default_subset(launches)}
    _assert_all_compile([x for x in launches if json.dumps(x, sort_keys=True) not in default], tmp_path)
