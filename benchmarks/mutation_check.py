"""Mutation check: do the tests named for a behaviour fail when that behaviour is removed?

Each mutation is a small bug (one exact text replacement in one source file). For each, the
repository is copied to a temporary folder (tracked and untracked files git does not ignore, the
package-dir mappings of pyproject.toml linked as an editable install maps them), the bug is put
into the copy (never into the working tree) and the mutation's tests run there. A mutation no test
catches is a hole in the suite. Run from the repository root::

    python benchmarks/mutation_check.py               # every mutation
    python benchmarks/mutation_check.py --list        # their names
    python benchmarks/mutation_check.py write_back_keeps_deleted_attribute ...

It prints one row per mutation (caught or not, and by which tests) and exits 1 if any was missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, run with -k `select` when given
    select: str | None = None


MUTATIONS = [
    Mutation(
        "force_triton_ignored",
        "kernels/__init__.py",
        'if os.environ.get(FORCE_TRITON_ENV) != "1" and (first is None or not first.is_cuda):',
        "if first is None or not first.is_cuda:",
        (
            "tests/ops/test_norms.py",
            "tests/ops/test_cross_entropy.py",
            "tests/ops/test_linear_cross_entropy.py",
            "tests/ops/test_batch_norm.py",
            "tests/ops/test_chunked_cross_entropy.py",
        ),
        select="triton",
    ),
    Mutation(
        "force_triton_ignored_in_fixture_runs",
        "kernels/__init__.py",
        'if os.environ.get(FORCE_TRITON_ENV) != "1" and (first is None or not first.is_cuda):',
        "if first is None or not first.is_cuda:",
        ("tests/ops/test_chunked_cross_entropy.py::test_triton_kernel_path",),
    ),
    Mutation(
        "skipped_steps_not_restored",
        "amp_fx/integrations/_hf_scaler.py",
        "        self._skipped_loaded = skipped\n        if self._skipped is not None:\n"
        "            self._skipped.fill_(skipped)",
        "        self._skipped_loaded = 0\n        if self._skipped is not None:\n"
        "            self._skipped.fill_(0)",
        ("tests/integrations/test_transformers_trainer.py",),
        select="resume",
    ),
    Mutation(
        "write_back_replaces_nested_list",
        "amp_fx/core/containers.py",
        "        old[:] = [_merged(old[i] if i < len(old) else None, item) for i, item in enumerate(new)]\n"
        "        return old",
        "        return [_merged(old[i] if i < len(old) else None, item) for i, item in enumerate(new)]",
        ("tests/core/test_containers.py",),
        select="write_back",
    ),
    Mutation(
        "write_back_keeps_deleted_attribute",
        "amp_fx/core/containers.py",
        "    for name in [name for name in old_state if name not in new_state]:\n"
        "        del old_state[name]\n",
        "",
        ("tests/core/test_containers.py",),
        select="write_back",
    ),
    Mutation(
        "captured_output_off_by_25_percent",
        "amp_fx/capture/captured_model.py",
        "            log_islands(self, journal.islands)\n        return output\n",
        "            log_islands(self, journal.islands)\n"
        "        return output * 1.25 if isinstance(output, torch.Tensor) else output\n",
        ("tests/capture/test_fx_drop_in.py::test_o2_with_captured_children_trains_every_parameter",),
    ),
    Mutation(
        "host_read_in_unscale",
        "amp_fx/training/loss_scaler.py",
        "            self.defer_unscale_(optimizer)\n            optimizer.apply_grad_multiplier_()\n",
        "            self.defer_unscale_(optimizer)\n            optimizer.apply_grad_multiplier_()\n"
        "            self._scale.cpu().numpy()\n",
        ("tests/training/test_loss_scaler.py",),
        select="host",
    ),
    Mutation(
        "sliding_window_count_baked_in",
        "amp_fx/core/containers.py",
        "    if isinstance(value, _LEAF_TYPES) or (within and type(value) is int):",
        "    if isinstance(value, _LEAF_TYPES):",
        ("tests/capture/test_export_drop_in.py::test_generate_on_a_sliding_window_cache_gives_autocasts_tokens",),
    ),
    Mutation(
        "sliding_window_taken_for_causal",
        "passes/simplify_attention/affine_masks.py",
        "    if b is True or a == b:\n        return a\n    return None\n\n\ndef _or(",
        "    if b is True or a == b or a == CAUSAL:\n        return a\n    return None\n\n\ndef _or(",
        # Not caught by the generate test: generate passes a padding mask, which keeps the mask whole.
        ("tests/passes/test_simplify_attention.py",),
    ),
    Mutation(
        "found_inf_not_agreed_across_ranks",
        "amp_fx/training/distributed.py",
        "        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)",
        "        pass",
        ("tests/training/test_fsdp_export.py::test_an_inf_in_one_ranks_shard_skips_the_step_on_all_ranks",),
        select="gpt2",
    ),
    Mutation(
        # Turning simplify_casts off is no mutation here: it removes no cast from the tiny GPT-2's
        # and Llama's O2 graphs (their bytes are the same with and without it).
        "norms_not_fused",
        "amp_fx/pipeline.py",
        "    *(_fusion_pass(fusion) for fusion in FUSIONS),\n",
        '    *(_fusion_pass(fusion) for fusion in FUSIONS if fusion.pass_name != "fuse_norms"),\n',
        ("tests/test_bytes_written.py",),
    ),
    Mutation(
        "matmul_fp32_without_out_dtype",
        "amp_fx/ops/head_matmuls.py",
        "        return torch.mm(a, b, out_dtype=torch.float32)",
        "        return torch.mm(a, b)",
        ("tests/ops/test_head_matmuls.py",),
    ),
]


def copy_repository(destination: Path) -> None:
    """The files git tracks or would track (untracked, not ignored), and the package-dir links."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if source.is_file() and not source.is_symlink():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in mapping.items():
        link = destination / package.replace(".", "/")
        if folder != package.replace(".", "/") and not link.exists():
            link.symlink_to(os.path.relpath(destination / folder, link.parent))


def apply(mutation: Mutation, copy: Path) -> None:
    path = copy / mutation.path
    text = path.read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"{mutation.name}: the text to mutate occurs {count} times in {mutation.path}")
    path.write_text(text.replace(mutation.old, mutation.new))


def failed_tests(mutation: Mutation, copy: Path, timeout_s: int) -> tuple[list[str], str]:
    """The tests that fail with the mutation in place, and pytest's summary line."""
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *mutation.tests]
    if mutation.select:
        command += ["-k", mutation.select]
    env = {**os.environ, "TRITON_INTERPRET": "1", "HYPOTHESIS_PROFILE": "ci"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, flags=re.MULTILINE)))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    return failed, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutations' names and exit")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per mutation's test run")
    args = parser.parse_args()
    by_name = {m.name: m for m in MUTATIONS}
    if args.list:
        print("\n".join(by_name))
        return 0
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutations {unknown}; --list shows them")
    missed = []
    print("| mutation | caught | by |\n|---|---|---|")
    for mutation in [by_name[n] for n in args.names] or MUTATIONS:
        with tempfile.TemporaryDirectory(prefix="amp_fx_mutation_") as folder:
            copy = Path(folder)
            copy_repository(copy)
            apply(mutation, copy)
            failed, summary = failed_tests(mutation, copy, args.timeout)
        if not failed:
            missed.append(mutation.name)
        shown = ", ".join(failed[:6]) + (f" and {len(failed) - 6} more" if len(failed) > 6 else "")
        print(f"| {mutation.name} | {'yes' if failed else 'NO'} | {shown or summary} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
