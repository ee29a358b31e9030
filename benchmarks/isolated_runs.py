"""Run groups of bench_train's variants each in a fresh process, and collect their results.

Two things need a process of their own: Liger-Kernel, which patches transformers' classes for the
whole process, and compiled peak memory, which a variant built after others can hide (memory
they freed, compiler caches they warmed). The parent runs bench_train.py again per group with the
same options, the group's ``--variants`` and ``--modes``, ``--isolate none`` and ``--json`` a
file the child writes its results to; the parent then prints one table.

Example:
    >>> argv = ["--models", "gpt", "--steps", "5", "--isolate=variant"]
    >>> child_argv(argv, "gpt", Group(["o2_fp16"], ["eager"]), "r.json")  # doctest: +NORMALIZE_WHITESPACE
    ['--steps', '5', '--models', 'gpt', '--variants', 'o2_fp16', '--modes', 'eager', '--isolate', 'none',
     '--json', 'r.json']
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

# Options the parent sets for each child itself (each takes a value).
PER_CHILD_OPTIONS = (
    "--models", "--model", "--variants", "--modes", "--isolate", "--json", "--markdown", "--time-budget"
)  # fmt: skip


@dataclass(frozen=True)
class Group:
    """What one process runs: these variants in these modes."""

    variants: list[str]
    modes: list[str]


def child_argv(
    argv: list[str], model_name: str, group: Group, json_path: str, time_budget: float | None = None
) -> list[str]:
    """The parent's command line without `PER_CHILD_OPTIONS`, then the child's own."""
    kept: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0]
        if name in PER_CHILD_OPTIONS:
            skip_value = "=" not in arg
            continue
        kept.append(arg)
    kept += ["--models", model_name, "--variants", ",".join(group.variants), "--modes", ",".join(group.modes)]
    kept += ["--isolate", "none", "--json", json_path]
    if time_budget is not None:
        kept += ["--time-budget", f"{time_budget:.0f}"]
    return kept


def run_groups(
    script: str, argv: list[str], model_name: str, groups: list[Group], deadline: float | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Run ``script`` once per group; every child's result rows (dicts with ``variant``, ``mode``
    and bench_train's Result fields) and notes. A child that dies leaves failed rows naming its
    exit code."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for index, group in enumerate(groups):
        budget = None
        if deadline is not None:
            budget = max(0.0, (deadline - time.perf_counter()) / (len(groups) - index))
        with tempfile.TemporaryDirectory() as folder:
            json_path = os.path.join(folder, "results.json")
            command = [sys.executable, script, *child_argv(argv, model_name, group, json_path, budget)]
            what = f"{', '.join(group.variants)} ({', '.join(group.modes)})"
            print(f"  {model_name}: process {index + 1}/{len(groups)}: {what}", flush=True)
            completed = subprocess.run(command, check=False)
            if completed.returncode != 0 or not os.path.exists(json_path):
                error = f"its process exited with code {completed.returncode}"
                rows += [
                    {"variant": v, "mode": m, "error": error} for v in group.variants for m in group.modes
                ]
                continue
            with open(json_path) as f:
                child = json.load(f)
        rows += child["results"]
        notes += child["notes"]
    return rows, notes


def write_results(path: str, rows: list[dict[str, Any]], notes: list[str]) -> None:
    """What a child hands its parent: result rows and notes (e.g. the capture cost), as JSON."""
    with open(path, "w") as f:
        json.dump({"results": rows, "notes": notes}, f)
