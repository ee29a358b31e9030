"""Every docstring example in the installed amp_fx package runs and prints what it shows.

Walks `amp_fx` with pkgutil, so `passes/` and `kernels/` are collected as the modules users import
(`amp_fx.passes`, `amp_fx.kernels`), not as top-level directories. Examples that need CUDA or a
network carry `# doctest: +SKIP`.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from typing import Any

import pytest

from amp_fx.kernels import FORCE_TRITON_ENV

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# `python -m amp_fx` runs the CLI on import.
NOT_IMPORTED = {"amp_fx.__main__"}


# pyproject's package-dir maps these from other directories, so walking amp_fx/ does not reach them.
ROOT_PACKAGES = ("amp_fx", "amp_fx.passes", "amp_fx.kernels")


def _module_names() -> list[str]:
    names = set(ROOT_PACKAGES)
    for root in ROOT_PACKAGES:
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{root}."):
            names.add(info.name)
    return sorted(names - NOT_IMPORTED)


def _modules_with_examples() -> list[Any]:
    """Each module with examples; one that needs a library this machine lacks (a trainer
    integration on the GPU image) is skipped, naming the library."""
    finder = doctest.DocTestFinder()
    found = []
    for name in _module_names():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is None or error.name.split(".")[0] == "amp_fx":
                raise
            found.append(pytest.param(name, marks=pytest.mark.skip(reason=f"needs {error.name}")))
            continue
        if any(test.examples for test in finder.find(module)):
            found.append(name)
    return found


@pytest.mark.parametrize("module_name", _modules_with_examples())
def test_docstring_examples(module_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The examples run as a user runs them: AMP_FX_FORCE_TRITON unset (tests/conftest.py sets it).
    monkeypatch.delenv(FORCE_TRITON_ENV, raising=False)
    module = importlib.import_module(module_name)
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=report.append)
    assert not report, "".join(report)
