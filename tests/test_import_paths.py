"""The repository root never shadows an installed module.

The root holds ``kernels/`` and ``passes/`` (installed as ``amp_fx.kernels`` / ``amp_fx.passes``).
``python -m pytest`` and pytest-xdist put the root first on sys.path, where ``kernels/`` would
hide Hugging Face's ``kernels`` package, which transformers 5.25 imports: every transformers test
would fail with ImportError. conftest moves the root behind everything installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import site
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = sorted(p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file())


def _position(entries: list[str], wanted) -> list[int]:
    return [i for i, entry in enumerate(entries) if wanted(Path(entry or ".").resolve())]


def test_the_root_comes_after_every_installed_package() -> None:
    assert "kernels" in TOP_LEVEL  # the case this guards; the rule holds for every top-level folder
    roots = _position(sys.path, lambda path: path == REPO_ROOT)
    installed = _position(
        sys.path, lambda path: str(path) in {str(Path(p).resolve()) for p in site.getsitepackages()}
    )
    assert installed, sys.path
    assert all(r > max(installed) for r in roots), f"the repository root precedes site-packages: {sys.path}"


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_an_installed_module_of_a_root_folders_name_wins(name: str) -> None:
    # Where a distribution provides a module of this name, that is what `import name` finds.
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return
    in_repo = REPO_ROOT in Path(spec.origin).resolve().parents
    installed = [d for d in importlib.metadata.distributions() if name in _top_level_names(d)]
    assert not (installed and in_repo), (
        f"`import {name}` finds the repository's {spec.origin}, not {installed}"
    )


def _top_level_names(distribution: importlib.metadata.Distribution) -> set[str]:
    return {Path(str(f)).parts[0] for f in distribution.files or () if f.suffix == ".py" or "/" in str(f)}


def test_hugging_face_kernels_imports_where_installed() -> None:
    try:
        distribution = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's `kernels` is not installed (the sys.path order is checked above)")
    module = importlib.import_module("kernels")
    location = Path(module.__file__).resolve()
    assert REPO_ROOT not in location.parents, f"`import kernels` found the repository's folder {location}"
    assert Path(distribution.locate_file("kernels")).resolve() in location.parents
