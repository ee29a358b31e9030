"""Where code comes from: torch's own files, and the user's line that stopped a capture.

The front ends name the line that stopped a capture: the innermost frame outside torch, else the
innermost one outside the tracing machinery.

    >>> import torch.nn.functional as F
    >>> F.__file__.startswith(TORCH_DIR)
    True
"""

from __future__ import annotations

import linecache
import os
import sys
import types
from collections.abc import Sequence

import torch
import torch.fx

__all__ = ["TORCH_DIR", "frames_after_current", "culprit_frame", "location"]

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# Files of the tracing machinery itself: never "the line that stopped the tracer".
_FX_DIR = os.path.dirname(torch.fx.__file__) + os.sep
_MACHINERY_FILES = {
    os.path.join(TORCH_DIR, name)
    for name in ("_tensor.py", "overrides.py", "__init__.py", "_jit_internal.py")
}


def frames_after_current(error: BaseException) -> list[types.FrameType]:
    """The frames `error` passed through below the one that caught it, outermost first."""
    frames = []
    tb = error.__traceback__
    tb = tb.tb_next if tb is not None else None  # skip the frame that caught it
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _is_machinery(filename: str, capture_file: str) -> bool:
    return (
        filename.startswith(_FX_DIR)
        or filename in _MACHINERY_FILES
        or filename == capture_file
        or "/torch/utils/" in filename
    )


def culprit_frame(frames: Sequence[types.FrameType], capture_file: str) -> types.FrameType | None:
    """The line that stopped the tracer: the innermost frame outside torch (user code), or else
    the innermost frame outside the tracing machinery (e.g. inside torch.nn's own modules).
    ``capture_file`` is the file of the code that ran the trace: its frames are machinery too."""
    outside_machinery = [f for f in frames if not _is_machinery(f.f_code.co_filename, capture_file)]
    outside_torch = [f for f in outside_machinery if not f.f_code.co_filename.startswith(TORCH_DIR)]
    chosen = outside_torch or outside_machinery
    # A library's own argument check (`raise RuntimeError(...)`) is not what the user must look
    # at; the call that passed it a traced value is.
    while len(chosen) > 1 and location(chosen[-1])[1].startswith("raise "):
        chosen = chosen[:-1]
    return chosen[-1] if chosen else None


def _short_path(filename: str) -> str:
    """A readable path: from the installed package's root for installed code (``torch/nn/...``),
    else relative to the working directory, else as it is."""
    roots = sorted((p for p in sys.path if p and filename.startswith(p + os.sep)), key=len, reverse=True)
    installed = [p for p in roots if os.path.basename(p) in ("site-packages", "dist-packages")]
    if installed:
        return os.path.relpath(filename, installed[0])
    try:
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            return relative
    except ValueError:  # another drive on Windows
        pass
    return os.path.relpath(filename, roots[0]) if roots else filename


def location(frame: types.FrameType | None) -> tuple[str, str]:
    """(``path:line``, stripped source line) of a frame."""
    if frame is None:
        return "<unknown location>", ""
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    source = linecache.getline(filename, lineno).strip()
    return f"{_short_path(filename)}:{lineno}", source
