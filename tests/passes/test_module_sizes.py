"""Every module of passes/ stays under 500 lines: a matcher or pass that grows past it has a part
to move out (a helper two passes use to passes/shared/, one of its own to its pass's folder)."""

from __future__ import annotations

from pathlib import Path

PASSES = Path(__file__).resolve().parents[2] / "passes"
MAX_LINES = 500


def test_every_pass_module_is_under_500_lines() -> None:
    sizes = {path: len(path.read_text().splitlines()) for path in PASSES.rglob("*.py")}
    assert len(sizes) > 20  # the walk found the passes
    too_long = {str(path.relative_to(PASSES)): lines for path, lines in sizes.items() if lines >= MAX_LINES}
    assert not too_long, f"modules of passes/ over {MAX_LINES} lines (split them): {too_long}"
