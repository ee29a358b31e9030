"""The package's layers import one way, and its folders are its rooms.

    amp_fx/            __init__, __main__, convert, pipeline, and the rooms:
      capture/         the torch.fx and torch.export front ends and the captured model
      training/        loss scaler, clipping, the CUDA-graph step, DDP/FSDP2, saving
      inspect/         report, summary, DOT, the command line
      optim/ amp/ integrations/ testing/
    amp_fx.pipeline    the passes in order            (passes/ installs as amp_fx.passes)
    amp_fx.core, .ops  policy data, the ops graphs call
    amp_fx.kernels     Triton beside torch references  (kernels/)

- capture, training and inspection sit above the pipeline: the pipeline imports only the passes,
  core, ops and kernels, and nothing below the rooms imports them; inspection reads capture, never
  training; capture and training import no inspection, integration or Apex API;
- a pass imports only amp_fx.core, amp_fx.ops, amp_fx.kernels, the passes' shared helpers
  (amp_fx.passes.shared) and its own folder (a pass with a helper of its own is a package), never
  another pass; a shared helper serves two passes or more;
- importing any pass loads none of the user API (checked by importing it, in a child process);
- kernels/, amp_fx/core/ and amp_fx/ops/ import neither the passes nor the user API, and kernels/
  imports nothing of amp_fx outside amp_fx.kernels;
- no module imports itself back through others (no import circles);
- the top of amp_fx/ holds only the entries `TOP_FLOOR` lists.

The static checks read every ``import`` statement with `ast`, also those inside functions.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import amp_fx

REPOSITORY = Path(__file__).resolve().parent.parent
# Where each package's files are (pyproject.toml installs passes/ and kernels/ under amp_fx).
PACKAGE_DIRECTORIES = {
    "amp_fx.passes": REPOSITORY / "passes",
    "amp_fx.kernels": REPOSITORY / "kernels",
    "amp_fx.core": REPOSITORY / "amp_fx" / "core",
    "amp_fx.ops": REPOSITORY / "amp_fx" / "ops",
}
BELOW_THE_PASSES = ("amp_fx.kernels", "amp_fx.core", "amp_fx.ops")
SHARED_PASS_HELPERS = "amp_fx.passes.shared"
# What a pass may import of amp_fx.
PASS_IMPORTS = ("amp_fx.core", "amp_fx.ops", "amp_fx.kernels", SHARED_PASS_HELPERS)
# The entries of amp_fx/ beside its rooms: a new module goes into a room.
TOP_FLOOR = frozenset(
    {"__init__.py", "__main__.py", "convert.py", "pipeline.py"}
    | {"capture", "training", "inspect", "core", "ops", "optim", "amp", "integrations", "testing"}
)
PIPELINE = ("amp_fx.pipeline", "amp_fx.passes")
ROOMS = ("amp_fx.capture", "amp_fx.training", "amp_fx.inspect")
# What the rooms may not import: the layers they serve.
ROOM_REFUSALS = {
    "amp_fx.capture": (
        "amp_fx.inspect",
        "amp_fx.integrations",
        "amp_fx.amp",
        "amp_fx.testing",
        "amp_fx.convert",
    ),
    "amp_fx.training": (
        "amp_fx.inspect",
        "amp_fx.integrations",
        "amp_fx.amp",
        "amp_fx.testing",
        "amp_fx.convert",
    ),
    "amp_fx.inspect": ("amp_fx.training", "amp_fx.integrations", "amp_fx.amp", "amp_fx.testing"),
}


def _user_api_modules() -> frozenset[str]:
    """Every module and package of amp_fx/ above the passes: all of it but core/ and ops/."""
    top = REPOSITORY / "amp_fx"
    modules = {f"amp_fx.{path.stem}" for path in top.glob("*.py") if path.stem != "__init__"}
    packages = {
        f"amp_fx.{path.parent.name}"
        for path in top.glob("*/__init__.py")
        # a link (a checkout's amp_fx/passes -> ../passes) is another package's directory
        if path.parent.name not in ("core", "ops") and not path.parent.is_symlink()
    }
    return frozenset(modules | packages)


USER_API = _user_api_modules()


def _is_within(name: str, packages: tuple[str, ...] | frozenset[str]) -> bool:
    return any(name == package or name.startswith(f"{package}.") for package in packages)


def _module_name(package: str, path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIRECTORIES[package]).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def _imported_names(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `path` imports. ``from a.b import c`` gives ``a.b.c``
    (a submodule, or a name defined in a.b: both lie within a.b); a name of amp_fx's lazy
    exports (``from amp_fx import convert``) gives the module that defines it."""
    is_package = path.name == "__init__.py"
    names: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if base == "amp_fx" and alias.name in amp_fx._EXPORTS:
                    names.append((node.lineno, amp_fx._EXPORTS[alias.name]))
                else:
                    names.append((node.lineno, base if alias.name == "*" else f"{base}.{alias.name}"))
    return names


def _imports_of(package: str) -> list[tuple[str, Path, int, str]]:
    """(module, file, line, imported name) for every import in `package`'s files."""
    found = []
    for path in sorted(PACKAGE_DIRECTORIES[package].rglob("*.py")):
        module = _module_name(package, path)
        found.extend((module, path, line, name) for line, name in _imported_names(path, module))
    return found


def _where(path: Path, line: int, name: str) -> str:
    return f"{path.relative_to(REPOSITORY)}:{line} imports {name}"


def test_the_user_api_is_found():
    # The checks below are only as good as this list: it must hold the modules it names.
    assert {"amp_fx.convert", "amp_fx.pipeline", "amp_fx.amp", "amp_fx.optim", "amp_fx.testing"} <= USER_API
    assert set(ROOMS) <= USER_API
    assert _is_within("amp_fx.training.cuda_graph_step", USER_API)
    assert not _is_within("amp_fx.core.policy", USER_API)
    assert not _is_within("amp_fx.ops.cross_entropy", USER_API)


def test_import_reading_resolves_relative_and_lazy_imports(tmp_path: Path):
    source = tmp_path / "example.py"
    source.write_text(
        "import torch\nfrom . import arguments\nfrom .reference import adam\n"
        "def f():\n    from amp_fx import convert\n"
    )
    assert _imported_names(source, "amp_fx.kernels.example") == [
        (1, "torch"),
        (2, "amp_fx.kernels.arguments"),
        (3, "amp_fx.kernels.reference.adam"),
        (5, "amp_fx.convert"),
    ]


@pytest.mark.parametrize("package", BELOW_THE_PASSES)
def test_lower_layers_import_neither_passes_nor_user_api(package: str):
    upward = [
        _where(path, line, name)
        for _, path, line, name in _imports_of(package)
        if _is_within(name, ("amp_fx.passes",)) or _is_within(name, USER_API)
    ]
    assert not upward, f"{package} must not import the layers above it:\n" + "\n".join(upward)


def test_kernels_import_only_kernels_of_amp_fx():
    outside = [
        _where(path, line, name)
        for _, path, line, name in _imports_of("amp_fx.kernels")
        if _is_within(name, ("amp_fx",)) and not _is_within(name, ("amp_fx.kernels",))
    ]
    assert not outside, "kernels/ is the bottom layer, it imports only amp_fx.kernels:\n" + "\n".join(outside)


def _pass_of(module: str) -> str:
    """The pass a module of amp_fx.passes belongs to: ``amp_fx.passes.fuse_norms`` for itself and its
    helper ``amp_fx.passes.fuse_norms.norm_chains``; the shared helpers are no pass's."""
    return ".".join(module.split(".")[:3])


def test_passes_import_no_other_pass():
    wrong = [
        _where(path, line, name)
        for module, path, line, name in _imports_of("amp_fx.passes")
        if _is_within(name, ("amp_fx",))
        and not _is_within(name, PASS_IMPORTS)
        and not (
            module != SHARED_PASS_HELPERS
            and not _is_within(module, (SHARED_PASS_HELPERS,))
            and _is_within(name, (_pass_of(module),))
        )
    ]
    assert not wrong, (
        f"a pass imports only {', '.join(PASS_IMPORTS)}; move a helper that several passes need to "
        f"{SHARED_PASS_HELPERS}:\n" + "\n".join(wrong)
    )


def test_a_shared_pass_helper_serves_two_passes_or_more():
    """passes/shared/ holds what two passes or more use; a helper of one pass lives in its folder."""
    imports: dict[str, set[str]] = {}
    for module, _, _, name in _imports_of("amp_fx.passes"):
        imports.setdefault(module, set()).add(name)
    shared = {m for m in imports if _is_within(m, (SHARED_PASS_HELPERS,)) and m != SHARED_PASS_HELPERS}

    def reached(module: str, seen: set[str]) -> set[str]:
        for name in imports.get(module, ()):
            target = next((m for m in shared if _is_within(name, (m,))), None)
            if target and target not in seen:
                seen.add(target)
                reached(target, seen)
        return seen

    users: dict[str, set[str]] = {helper: set() for helper in shared}
    for module in imports:
        if not _is_within(module, (SHARED_PASS_HELPERS,)) and module != "amp_fx.passes":
            for helper in reached(module, set()):
                users[helper].add(_pass_of(module))
    lonely = {helper: sorted(passes) for helper, passes in users.items() if len(passes) < 2}
    assert not lonely, f"shared helpers used by fewer than two passes (move each into its pass): {lonely}"


def test_the_pipeline_imports_only_passes_and_below():
    path = REPOSITORY / "amp_fx" / "pipeline.py"
    allowed = (*PIPELINE, *BELOW_THE_PASSES)
    wrong = [
        _where(path, line, name)
        for line, name in _imported_names(path, "amp_fx.pipeline")
        if _is_within(name, ("amp_fx",)) and not _is_within(name, allowed)
    ]
    assert not wrong, "the pipeline sits below capture, training and inspection:\n" + "\n".join(wrong)


@pytest.mark.parametrize("room", ROOMS)
def test_rooms_import_only_what_they_stand_on(room: str):
    modules = _source_modules()
    refused = ROOM_REFUSALS[room]
    wrong = [
        _where(path, line, name)
        for module, path in sorted(modules.items())
        if _is_within(module, (room,))
        for line, name in _imported_names(path, module)
        if _is_within(name, refused)
    ]
    assert not wrong, f"{room} may not import {', '.join(refused)}:\n" + "\n".join(wrong)


def test_the_top_floor_holds_only_the_rooms():
    entries = {
        path.name
        for path in (REPOSITORY / "amp_fx").iterdir()
        if path.name != "__pycache__" and not path.is_symlink()  # a checkout's links to passes/, kernels/
    }
    assert entries == TOP_FLOOR, (
        f"amp_fx/ holds {sorted(entries - TOP_FLOOR)} beyond its rooms (put a module in the room of its "
        f"idea) and lacks {sorted(TOP_FLOOR - entries)}"
    )


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of amp_fx it imports (a name defined in a module counts as that module)."""
    modules = _source_modules()

    def owner(name: str) -> str | None:
        parts = name.split(".")
        return next(
            (".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None
        )

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {owner(name) for _, name in _imported_names(path, module)}
        graph[module] = {t for t in targets if t and t != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_circles_are_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    circles = _circles(_import_graph())
    assert not circles, (
        "modules that import each other (one of them should own what both need):\n"
        + "\n".join(" <-> ".join(group) for group in circles)
    )


# Every module of amp_fx.passes but the package itself, relative to it ("trace", "shared.casts").
PASS_MODULES = sorted(
    _module_name("amp_fx.passes", path).removeprefix("amp_fx.passes.")
    for path in PACKAGE_DIRECTORIES["amp_fx.passes"].rglob("*.py")
    if path != PACKAGE_DIRECTORIES["amp_fx.passes"] / "__init__.py"
)

# Imports torch once (most of the cost), then forks one child per pass, as many at a time as there
# are cores: each child starts with no amp_fx module loaded, imports its pass and reports the amp_fx
# modules that are then loaded.
_IMPORT_EACH_PASS = """
import importlib, json, os, sys, traceback
import torch
assert not [m for m in sys.modules if m.split(".")[0] == "amp_fx"], "amp_fx loaded before the fork"

def start(name):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(f"amp_fx.passes.{name}")
            report = sorted(m for m in sys.modules if m.split(".")[0] == "amp_fx")
        except BaseException:
            report = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as pipe:
            json.dump(report, pipe)
        os._exit(0)
    os.close(write)
    return pid, read

results = {}
names = sys.argv[1:]
cores = len(os.sched_getaffinity(0))
for first in range(0, len(names), cores):
    started = {name: start(name) for name in names[first : first + cores]}
    for name, (pid, read) in started.items():
        with os.fdopen(read) as pipe:
            results[name] = json.loads(pipe.read() or '{"error": "no report"}')
        os.waitpid(pid, 0)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def loaded_by_each_pass() -> dict[str, list[str] | dict[str, str]]:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_PASS, *PASS_MODULES],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_every_pass_module_is_checked():
    assert {"shared", "insert_casts", "fuse_losses", "fuse_norms", "fuse_norms.norm_chains"} <= set(
        PASS_MODULES
    )


@pytest.mark.parametrize("name", PASS_MODULES)
def test_importing_a_pass_loads_no_user_api(name: str, loaded_by_each_pass):
    loaded = loaded_by_each_pass[name]
    assert isinstance(loaded, list), f"importing amp_fx.passes.{name} failed:\n{loaded}"
    assert f"amp_fx.passes.{name}" in loaded
    above = [m for m in loaded if _is_within(m, USER_API)]
    assert "amp_fx.convert" not in loaded and not above, (
        f"importing amp_fx.passes.{name} loads the user API: {above}"
    )


# Where each installed package's modules are found, the whole of amp_fx included.
SOURCE_ROOTS = {"amp_fx": REPOSITORY / "amp_fx", **PACKAGE_DIRECTORIES}


def _source_modules() -> dict[str, Path]:
    """Dotted name -> file of every module and package of the installed amp_fx."""
    modules = {}
    for package, directory in SOURCE_ROOTS.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_crossings(path: Path, module: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, name) of the imports in `path` that take a private name from another folder."""
    folder = path.parent
    found = []
    for line, name in _imported_names(path, module):
        parts = name.split(".")
        if parts[0] != "amp_fx":
            continue
        for index in range(1, len(parts)):
            owner = ".".join(parts[:index])
            if owner not in modules:
                break  # parts[index - 1] was a name defined in a module, not a module
            if not _is_private(parts[index]):
                continue
            owner_file = modules[owner]
            home = owner_file.parent  # a package's folder, or the folder of the file defining it
            private_package = modules.get(".".join(parts[: index + 1]))
            inside = private_package is not None and private_package.name == "__init__.py"
            if folder != home and not (inside and folder.is_relative_to(private_package.parent)):
                found.append((line, name))
            break
    return found


def test_no_private_name_crosses_a_package_folder():
    """No module imports a private name (a leading underscore, not a dunder) from a module of
    another folder: amp_fx/, amp_fx/core/, amp_fx/ops/, amp_fx/amp/, passes/, passes/shared/,
    kernels/, kernels/<family>/ ... are each a folder of their own, and a subpackage is not its
    parent's folder (amp_fx/integrations/ may not import amp_fx/_x.py nor amp_fx.inspect.cli._y).

    A private name is one underscored component of the imported path: a module (``_state`` of
    ``amp_fx.amp._state``) or a name defined in one (``_fused`` of ``amp_fx.ops.batch_norm._fused``).
    Its home is the folder that holds the module it is defined in (for a module, its package);
    only modules of that folder, and of a private package's own folder, may import it. What two
    folders share is public in its home. Only ``import`` statements are read (those inside
    functions too), not attribute access such as ``amp_fx.kernels._x``.
    """
    modules = _source_modules()
    crossings = [
        _where(path, line, name)
        for module, path in sorted(modules.items())
        for line, name in _private_crossings(path, module, modules)
    ]
    assert not crossings, "private names imported from another folder:\n" + "\n".join(crossings)


def test_private_crossings_are_found(tmp_path: Path):
    (tmp_path / "amp_fx" / "core").mkdir(parents=True)
    (tmp_path / "amp_fx" / "_hidden").mkdir()
    user = tmp_path / "amp_fx" / "convert.py"
    user.write_text(
        "from amp_fx.core.policy import _check, preset\nimport amp_fx.core._private\n"
        "from amp_fx._hidden.inner import thing\nfrom amp_fx.core import __version__\n"
    )
    inner = tmp_path / "amp_fx" / "_hidden" / "inner.py"
    inner.write_text("from amp_fx._hidden import _other\n")
    modules = {
        "amp_fx": tmp_path / "amp_fx" / "__init__.py",
        "amp_fx.convert": user,
        "amp_fx.core": tmp_path / "amp_fx" / "core" / "__init__.py",
        "amp_fx.core.policy": tmp_path / "amp_fx" / "core" / "policy.py",
        "amp_fx.core._private": tmp_path / "amp_fx" / "core" / "_private.py",
        "amp_fx._hidden": tmp_path / "amp_fx" / "_hidden" / "__init__.py",
        "amp_fx._hidden.inner": inner,
    }
    assert _private_crossings(user, "amp_fx.convert", modules) == [
        (1, "amp_fx.core.policy._check"),
        (2, "amp_fx.core._private"),
    ]
    assert _private_crossings(inner, "amp_fx._hidden.inner", modules) == []
