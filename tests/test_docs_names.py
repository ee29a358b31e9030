"""Every amp_fx name and repository path that the documents write in backticks exists.

README.md, BENCHMARKS.md and docs/*.md name modules and functions (`amp_fx.ops.max_pool.max_pool2d`)
and files (`benchmarks/bench_train.py`, `capture/fx.py`). A move or a rename that misses a document
leaves a name that points nowhere; this test finds it. A dotted name must resolve (the longest
prefix that is a module, then its attributes); a path must be a file or folder of the repository,
written whole or as its tail (`capture/fx.py`, `fx.py`), since the documents name files relative to
the folder they describe.

What counts as a path: a backticked word of path characters that ends in `/` or in a file suffix
of this repository (`.py`, `.md`, ...). Metric names (`amp_fx/loss_scale`), arithmetic (`1/scale`)
and other projects' files (`aten/src/ATen/autocast_mode.h`) do not end so.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from functools import cache
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
DOCUMENTS = (
    REPOSITORY / "README.md",
    REPOSITORY / "BENCHMARKS.md",
    *sorted((REPOSITORY / "docs").glob("*.md")),
)
# The folders that hold the repository's own files (not a virtual environment or build output).
SOURCE_FOLDERS = ("amp_fx", "passes", "kernels", "tests", "benchmarks", "examples", "docs")
PATH_SUFFIXES = (".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".json", ".yaml", ".yml", ".sh")
# Named in backticks, not part of the repository.
NOT_IN_THE_REPOSITORY = {
    ".wheels/": "the local folder of downloaded wheels (Liger-Kernel's), never committed",
    "cifar-10-batches-py/": "the CIFAR-10 download an example reads",
    "all.md": "what the sweep command of docs/HF_SWEEP.md writes",
}
# Names that describe how the code was before a move, each where the text says so.
HISTORIC = {
    ("docs/DESIGN.md", "amp_fx/captured_model.py"): "where capture lived before issue 39",
    ("docs/DESIGN.md", "passes/trace.py"): "where capture lived before issue 39",
    ("docs/DESIGN.md", "passes/export.py"): "where capture lived before issue 39",
}
# A recipe's stand-in name (DESIGN: "Kernel families": `kernels/foo/`, `amp_fx.kernels.foo`).
PLACEHOLDER = re.compile(r"(?:^|[./_])foo(?:$|[./_])")

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
# A span opens with a run of backticks and closes at the next run of as many (``a `b` c``).
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
DOTTED_NAME = re.compile(r"(?<![\w./])amp_fx(?:\.[A-Za-z_]\w*)+")
PATH_WORD = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")


def _code_texts(text: str) -> list[str]:
    """The text inside fenced blocks and inline code spans."""
    fences = FENCE.findall(text)
    return fences + [span for _, span in CODE_SPAN.findall(FENCE.sub("", text))]


def _paths_in(code: str) -> set[str]:
    """The words of `code` that are paths: a pytest id's test name and punctuation around dropped."""
    words = (word.split("::")[0].strip("\"'(),;:") for word in code.split())
    return {
        word
        for word in words
        if PATH_WORD.fullmatch(word) and (word.endswith("/") or word.endswith(PATH_SUFFIXES))
    }


def _named(document: Path) -> tuple[set[str], set[str]]:
    """The dotted amp_fx names and the paths written in `document`'s code."""
    names, paths = set(), set()
    for code in _code_texts(document.read_text()):
        names.update(DOTTED_NAME.findall(code))
        paths.update(_paths_in(code))
    return names, paths


@cache
def _repository_entries() -> tuple[frozenset[str], frozenset[str]]:
    """Every file and folder of the repository's own folders, as paths from the root."""
    files = {p.name for p in REPOSITORY.iterdir() if p.is_file()}
    folders = set(SOURCE_FOLDERS)
    for top in SOURCE_FOLDERS:
        for root, directories, names in os.walk(REPOSITORY / top):
            directories[:] = [d for d in directories if d != "__pycache__"]
            relative = Path(root).relative_to(REPOSITORY).as_posix()
            folders.update(f"{relative}/{d}" for d in directories)
            files.update(f"{relative}/{n}" for n in names)
    return frozenset(files), frozenset(folders)


def _path_exists(path: str) -> bool:
    files, folders = _repository_entries()
    entries = folders if path.endswith("/") else files
    wanted = path.rstrip("/")
    return any(entry == wanted or entry.endswith("/" + wanted) for entry in entries)


def _name_resolves(name: str) -> bool:
    """`name` is a module, or attributes of the longest module prefix that exists."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            spec = importlib.util.find_spec(module_name)
        except ModuleNotFoundError:
            spec = None  # a parent is no package
        if spec is None:
            continue
        if end == len(parts):
            return True  # found, not run (`amp_fx.__main__` would start the command line)
        found = importlib.import_module(module_name)
        for attribute in parts[end:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def _written() -> list[tuple[str, str, str]]:
    """(document, "name" or "path", what is written) for everything the documents name."""
    written = []
    for document in DOCUMENTS:
        relative = document.relative_to(REPOSITORY).as_posix()
        names, paths = _named(document)
        written += [(relative, "name", name) for name in sorted(names)]
        written += [(relative, "path", path) for path in sorted(paths)]
    return written


WRITTEN = _written()
CASES = [
    (document, kind, name)
    for document, kind, name in WRITTEN
    if not PLACEHOLDER.search(name) and (document, name) not in HISTORIC and name not in NOT_IN_THE_REPOSITORY
]


def test_the_documents_name_things() -> None:
    # Guards the extraction itself: a broken pattern would otherwise pass every document.
    kinds = {(document, kind) for document, kind, _ in CASES}
    assert {("README.md", "name"), ("README.md", "path"), ("BENCHMARKS.md", "path")} <= kinds
    assert ("docs/DESIGN.md", "name") in kinds and ("docs/DESIGN.md", "path") in kinds


def test_a_stale_name_is_found() -> None:
    # Guards the resolution: names and paths from before issue 39's move resolve no longer.
    assert not _name_resolves("amp_fx.pooling.max_pool2d")
    assert not _name_resolves("amp_fx.ops.max_pool.max_pool3d")
    assert not _name_resolves("amp_fx.reporting")
    assert not _path_exists("passes/trace.py") and not _path_exists("kernels/pooling/")
    assert _name_resolves("amp_fx.ops.max_pool.max_pool2d") and _name_resolves("amp_fx.CudaGraphStep")
    assert _path_exists("amp_fx/capture/fx.py") and _path_exists("capture/fx.py") and _path_exists("fx.py")


@pytest.mark.parametrize(("document", "kind", "written"), CASES)
def test_a_written_name_exists(document: str, kind: str, written: str) -> None:
    if kind == "name":
        assert _name_resolves(written), (
            f"{document} names `{written}`, which does not import: write the name the code has now"
        )
    else:
        assert _path_exists(written), (
            f"{document} names `{written}`, which is no file or folder of the repository: "
            "write the path the code has now"
        )


def test_the_exceptions_are_still_needed() -> None:
    # An exception whose name the documents no longer write, or that now exists, is dropped.
    written = {(document, name) for document, _, name in WRITTEN}
    for document, name in HISTORIC:
        assert (document, name) in written, f"{name} is no longer in {document}: drop it from HISTORIC"
        assert not _path_exists(name), f"{name} exists again: drop it from HISTORIC"
    for name in NOT_IN_THE_REPOSITORY:
        assert any(name == n for _, n in written), f"no document names {name}: drop it"
        assert not _path_exists(name), f"{name} is in the repository: drop it"
