"""benchmarks/mutation_check.py stays runnable: each mutation's text is in its file exactly once and
its tests exist (the check itself, a test run per mutation, is run by hand: minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_mutation_check():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "benchmarks" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mutation_check = _load_mutation_check()
MUTATIONS = mutation_check.MUTATIONS


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once_to_existing_code_and_names_existing_tests(mutation) -> None:
    assert (ROOT / mutation.path).read_text().count(mutation.old) == 1
    assert mutation.old != mutation.new
    for test in mutation.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), test
        assert not name or f"def {name}(" in (ROOT / path).read_text(), test


def test_the_copy_holds_the_package_and_its_mapped_folders(tmp_path: Path) -> None:
    mutation_check.copy_repository(tmp_path)
    for folder in ("amp_fx/kernels", "amp_fx/passes"):
        assert (tmp_path / folder / "__init__.py").is_file(), folder
    assert (tmp_path / "tests" / "conftest.py").is_file()
