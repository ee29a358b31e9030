"""Where a Triton kernel launches: on its tensors' GPU, not the current one."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["on_device"]


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The context to launch a kernel on ``device`` in: Triton launches on the current CUDA device,
    which may not be the tensors'. A no-op off CUDA (the interpreter runs on the CPU).

    Example:
        >>> with on_device(torch.device("cpu")):
        ...     pass
    """
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
