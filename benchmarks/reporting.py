"""What every benchmark reports with its table: the machine and versions, and where the table goes.

Example:
    >>> line = environment()  # e.g. "NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-30"
    >>> publish("| a | b |\\n", markdown=None)  # prints the table; a path would also get it appended
    | a | b |
    <BLANKLINE>
"""

from __future__ import annotations

import datetime
import os

import torch


def environment(device: torch.device | None = None) -> str:
    """The device (the current CUDA device by default; "CPU (n cores)" without CUDA), the torch
    and Triton versions and today's date: the line BENCHMARKS.md needs with every number."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"CPU ({os.cpu_count()} cores)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"{where}, torch {torch.__version__}, triton {triton_version}, {datetime.date.today().isoformat()}"


def publish(text: str, markdown: str | None) -> None:
    """Print ``text`` and, with a path, append it to that markdown file after a blank line."""
    print(text)
    if markdown:
        with open(markdown, "a") as f:
            f.write("\n" + text)
