"""Where a training step's GPU time goes, by kind of kernel: a few steps under torch.profiler,
each kernel's time summed into one of a few categories by its name (`RULES`, first match wins).

Triton kernels written by hand (amp_fx's, Liger-Kernel's) are named by their family, the package
folder they come from (``triton amp_fx cross_entropy``, ``triton liger rms_norm``): every Triton
function loaded in the process is looked up by name. Inductor's generated kernels
(``triton_poi_fused_...``) are classified by the ops they fuse: pure casts, norms, attention, or
by their kind (pointwise: elementwise; reductions). On a CPU the same rules sort the ops' self CPU
time, so the code runs anywhere; the figures that matter are the GPU's.

Example:
    >>> classify("void at::native::vectorized_elementwise_kernel<4, direct_copy_kernel_cuda>", {})
    'casts/copies'
    >>> classify("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3", {})
    'norms'
    >>> classify("_rms_norm_forward_kernel", {"_rms_norm_forward_kernel": "liger rms_norm"})
    'triton liger rms_norm'
"""

from __future__ import annotations

import inspect
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch


# Whole op names inside a longer name (``aten::mm``, ``CUDAFunctor_add``), not parts of words.
def _ops(*names: str) -> str:
    return r"(^|[^a-z])(" + "|".join(names) + r")([^a-z]|$)"


# (category, pattern searched in the lower-cased kernel or op name), in order: the first match wins.
RULES: list[tuple[str, str]] = [
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|\bmha"),
    (
        "GEMM",
        r"gemm|gemv|xmma|cutlass|nvjet|cublas|splitk|matmul|" + _ops("b?mm", "addmm", "baddbmm", "linear"),
    ),
    ("optimizer", r"adam|sgd|multi_tensor_apply|optimizer|non_finite_check|unscale|loss_scale|update_scale"),
    ("norms", r"norm|rsqrt|welford"),
    ("casts/copies", r"copy|memcpy|convert_element_type|\bcast"),
    (
        "reductions",
        r"reduce|softmax|logsumexp|cross_entropy|nll_loss|" + _ops("sum", "mean", "amax", "max", "var"),
    ),
    (
        "elementwise",
        r"elementwise|pointwise|fill|memset|zero|gelu|silu|relu|tanh|sigmoid|dropout|where|"
        + _ops("add", "sub", "mul", "div", "pow", "exp", "neg", "clamp", "sqrt"),
    ),
]
OTHER = "other"
# Inductor's generated kernels: triton_<kind>_fused_<ops>_<n>. A kernel that fuses casts only is a
# cast; any other goes by the rules above, then by its kind.
INDUCTOR_KERNEL = re.compile(r"^triton_(poi|red|per|tem)_fused_(.*?)_?\d*$")
INDUCTOR_KINDS = {"poi": "elementwise", "red": "reductions", "per": "reductions", "tem": "GEMM"}
INDUCTOR_CAST_OPS = re.compile(r"_?(to_copy|convert_element_type|clone|copy)")
# Packages of hand-written Triton kernels: module prefix -> owner; the folder after it names the family.
TRITON_OWNERS: dict[str, str] = {"amp_fx.kernels.": "amp_fx", "liger_kernel.ops.": "liger"}

_COMPILED_RULES = [(category, re.compile(pattern)) for category, pattern in RULES]


def _by_rules(name: str) -> str | None:
    for category, pattern in _COMPILED_RULES:
        if pattern.search(name):
            return category
    return None


def classify(name: str, triton_families: dict[str, str]) -> str:
    """The category of one kernel (or CPU op) name; ``triton_families`` maps the names of
    hand-written Triton kernels to their family (`triton_kernel_families`)."""
    if name in triton_families:
        return f"triton {triton_families[name]}"
    lowered = name.lower()
    inductor = INDUCTOR_KERNEL.match(lowered)
    if inductor is not None:
        kind, ops = inductor.groups()
        if ops and not INDUCTOR_CAST_OPS.sub("", ops).strip("_"):
            return "casts/copies"
        category = _by_rules(INDUCTOR_CAST_OPS.sub("", ops))
        return category or INDUCTOR_KINDS[kind]
    return _by_rules(lowered) or OTHER


def _kernel_function(value: Any) -> Any:
    """The Python function of a Triton kernel ``value`` is (a JITFunction, or an InterpretedFunction
    under TRITON_INTERPRET=1) or wraps (autotuners and heuristics keep it as ``.fn``); else None."""
    from triton.runtime.jit import KernelInterface

    if not isinstance(value, KernelInterface):
        return None
    for _ in range(4):
        value = getattr(value, "fn", None)
        if not isinstance(value, KernelInterface):
            return value if inspect.isfunction(value) else None
    return None


def triton_kernel_families() -> dict[str, str]:
    """Kernel name -> family of every hand-written Triton kernel loaded now (`TRITON_OWNERS`)."""
    try:
        import triton.runtime.jit  # noqa: F401
    except ImportError:
        return {}
    families = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(tuple(TRITON_OWNERS)):
            continue
        for value in list(vars(module).values()):
            function = _kernel_function(value)
            if function is None:
                continue
            # The module that defines the kernel names its family, not one that imports it.
            defined_in = function.__module__
            prefix = next((p for p in TRITON_OWNERS if defined_in.startswith(p)), None)
            if prefix is not None:
                families[function.__name__] = (
                    f"{TRITON_OWNERS[prefix]} {defined_in[len(prefix) :].split('.')[0]}"
                )
    return families


def breakdown_from_events(events: Iterable[Any], steps: int, device_type: str) -> dict[str, float]:
    """Milliseconds per step by category: GPU kernels' times on CUDA (annotations left out: they
    span kernels), ops' self CPU times on a CPU."""
    families = triton_kernel_families()
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        on_device = event.device_type != torch.autograd.DeviceType.CPU
        if device_type == "cuda":
            if not on_device or getattr(event, "is_user_annotation", False):
                continue
            microseconds = event.time_range.elapsed_us()
        else:
            if on_device:
                continue
            microseconds = event.self_cpu_time_total
        totals[classify(event.name, families)] += microseconds / 1e3 / steps
    return dict(totals)


def profile_breakdown(step: Callable[[], Any], device: torch.device, steps: int = 3) -> dict[str, float]:
    """Run ``steps`` more steps under torch.profiler; milliseconds per step by category.

    Example:
        >>> layer = torch.nn.Linear(8, 8)
        >>> ms = profile_breakdown(lambda: layer(torch.randn(4, 8)).sum().backward(), torch.device("cpu"))
        >>> "GEMM" in ms
        True
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return breakdown_from_events(profiler.events(), steps, device.type)


def device_ms(step: Callable[[], Any], device: torch.device, steps: int = 10) -> float:
    """Milliseconds of kernel time per step (`profile_breakdown`'s sum): what a step costs the GPU,
    apart from the host time that bounds a small op's wall-clock time.

    Example:
        >>> layer = torch.nn.Linear(8, 8)
        >>> device_ms(lambda: layer(torch.randn(4, 8)).sum().backward(), torch.device("cpu")) > 0
        True
    """
    return sum(profile_breakdown(step, device, steps).values())


def format_breakdown(
    columns: dict[str, dict[str, float]],
    unit: str = "GPU ms/step",
    step_ms: dict[str, float | None] | None = None,
) -> str:
    """A markdown table: one row per category (largest first), one column per profiled variant,
    the total, and each variant's timed step (``step_ms``): what the total leaves is idle time.

    Example:
        >>> print(format_breakdown({"o2": {"GEMM": 2.0, "norms": 0.5}}, step_ms={"o2": 2.6}))
        GPU ms/step, by kind of kernel:
        <BLANKLINE>
        | kind | o2 |
        |---|---:|
        | GEMM | 2.00 |
        | norms | 0.50 |
        | **total** | **2.50** |
        | timed step | 2.60 |
        <BLANKLINE>
    """
    categories = sorted(
        {c for ms in columns.values() for c in ms},
        key=lambda c: -max(ms.get(c, 0.0) for ms in columns.values()),
    )
    lines = ["| " + " | ".join(["kind", *columns]) + " |", "|---|" + "---:|" * len(columns)]
    for category in categories:
        cells = [f"{ms.get(category, 0.0):.2f}" for ms in columns.values()]
        lines.append("| " + " | ".join([category, *cells]) + " |")
    lines.append(
        "| **total** | " + " | ".join(f"**{sum(ms.values()):.2f}**" for ms in columns.values()) + " |"
    )
    if step_ms:
        cells = [f"{step_ms[c]:.2f}" if step_ms.get(c) is not None else "-" for c in columns]
        lines.append("| timed step | " + " | ".join(cells) + " |")
    return f"{unit}, by kind of kernel:\n\n" + "\n".join(lines) + "\n"
