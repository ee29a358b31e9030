"""Where torch's own Python files are: a frame there is torch's code, not the user's.

The front ends name the user's line that stopped a capture, the innermost frame outside torch.

    >>> import torch.nn.functional as F
    >>> F.__file__.startswith(TORCH_DIR)
    True
"""

from __future__ import annotations

import os

import torch

__all__ = ["TORCH_DIR"]

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
