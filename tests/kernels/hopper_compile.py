"""Compile recorded Triton kernel launches for an H100/H200 (sm_90) without a GPU.

Run as a script by ``test_compiles_for_hopper.py``, in a process WITHOUT ``TRITON_INTERPRET``: there
``@triton.jit`` objects are JITFunctions, which the real compiler needs (an InterpretedFunction
helper cannot be called from compiled code).

    python hopper_compile.py LAUNCHES.json RESULTS.json

LAUNCHES.json is a list of launches as the test records them::

    {"module": "amp_fx.kernels.adam.triton", "kernel": "_adam_kernel",
     "args": {"tensor_table": {"tensor": "int64", "aligned": true}, "lr": 0.001,
              "PARAM_DTYPE": {"tl_dtype": "fp16"}, ...},
     "options": {"num_warps": 8}}

Each launch is specialized the way ``JITFunction.run`` specializes a real one (Triton's own
``native_specialize_impl``: pointer element types, i32/i64 by value, ints equal to 1 as constants,
16-divisibility of pointers and ints as ``tt.divisibility`` hints, ``do_not_specialize`` honoured)
and compiled through ptxas to a cubin, in one process per available core. RESULTS.json:
``{"canary": ..., "results": [...]}``, one result per launch, in order: ``{"signature": {...},
"constexprs": {...}, "error": null | "<compiler error>", "seconds": 1.2}``; "canary" is
CANARY_LAUNCH's (it must fail).

Example:
    $ env -u TRITON_INTERPRET python tests/kernels/hopper_compile.py launches.json results.json
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, native_specialize_impl

TARGET = GPUTarget("cuda", 90, 32)

# A launch the compiler must reject (tl.arange needs a power-of-two range; N = 3), compiled before
# the others: the test checks its error comes back, i.e. that a failing kernel would be seen.
CANARY_LAUNCH = {
    "module": "__main__",
    "kernel": "_canary_kernel",
    "args": {"out_ptr": {"tensor": "float32", "aligned": True}, "N": 3},
    "options": {},
}


@triton.jit
def _canary_kernel(out_ptr, N: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, N), 0.0)


class _Pointer:
    """What native_specialize_impl reads from a tensor argument: its dtype and data pointer."""

    def __init__(self, dtype: torch.dtype, aligned: bool) -> None:
        self.dtype = dtype
        self._data_ptr = 0 if aligned else 4

    def data_ptr(self) -> int:
        return self._data_ptr


def _decode(value: object) -> object:
    if isinstance(value, dict) and "tensor" in value:
        return _Pointer(getattr(torch, value["tensor"]), value["aligned"])
    if isinstance(value, dict) and "tl_dtype" in value:
        return tl.dtype(value["tl_dtype"])
    return value


def _kernel(launch: dict) -> JITFunction:
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    if not isinstance(kernel, JITFunction):
        raise TypeError(
            f"{launch['module']}.{launch['kernel']} is {type(kernel).__name__}, not a JITFunction"
        )
    return kernel


def _specialize(kernel: JITFunction, args: dict, backend) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for ASTSource, as JITFunction's binder and _pack_args make them."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = _decode(args[param.name])
        if param.is_constexpr:
            kind, attr = "constexpr", None
        else:
            specialize = not param.do_not_specialize
            align = not param.do_not_specialize_on_alignment
            kind, attr = native_specialize_impl(backend, value, param.is_const, specialize, align)[:2]
            annotation = getattr(param, "annotation_type", None)
            if isinstance(annotation, str) and annotation:
                # An annotated parameter keeps its type; floats and bools are never specialized.
                if not specialize or annotation == "u1" or annotation[:2] in ("fp", "bf"):
                    kind, attr = annotation, None
                else:
                    kind = annotation
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = value
        elif isinstance(attr, str):
            attrs[(index,)] = backend.parse_attr(attr)
    return signature, constexprs, attrs


def _describe(exc: BaseException) -> str:
    """The error and its causes: a CompilationError raised in a helper the kernel calls points at
    the call in the kernel; the reason is in its cause."""
    parts = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 5:
        parts.append("".join(traceback.format_exception_only(seen)).strip())
        seen = seen.__cause__ or seen.__context__
    return "\ncaused by: ".join(parts)


def compile_launch(launch: dict) -> dict:
    """Compile one recorded launch to a cubin; the error (None if it compiled) and what was compiled."""
    started = time.perf_counter()
    signature: dict = {}
    constexprs: dict = {}
    error = None
    try:
        kernel = _kernel(launch)
        backend = make_backend(TARGET)
        signature, constexpr_values, attrs = _specialize(kernel, launch["args"], backend)
        constexprs = {kernel.arg_names[i]: str(v) for (i,), v in constexpr_values.items()}
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexpr_values, attrs=attrs),
            target=TARGET,
            options=launch["options"],
        )
        if not compiled.asm.get("cubin"):
            error = "the compiler returned no cubin"
    except Exception as exc:  # noqa: BLE001 - every failure is reported to the test, by launch
        error = _describe(exc)
    return {
        "signature": signature,
        "constexprs": constexprs,
        "error": error,
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str]) -> int:
    launches = json.loads(Path(argv[1]).read_text())
    # One compiler process per core (forked: the kernels' modules are imported once, here); the
    # results come back in the launches' order.
    workers = max(1, min(len(os.sched_getaffinity(0)), len(launches) + 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        canary, *results = pool.map(compile_launch, [CANARY_LAUNCH, *launches])
    Path(argv[2]).write_text(json.dumps({"canary": canary, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
