"""`AutocastIsland`: run one opaque module or function inside ``torch.autocast``.

An opaque node (a module the tracer could not see into, an ``fx.wrap``'ed function, or an op that
autocast changes only through the ops it calls, such as ``einsum`` on CPU) cannot get explicit
casts, so under O1/O2 it runs inside an autocast region of the policy's dtype, exactly as it
would under ``torch.autocast``. `insert_casts` turns such a node into a ``call_module`` of an
island, so the island is named in ``gm.print_readable()`` and counted by the report.

The island only *refers* to the module it runs: the module stays registered at its own path,
so parameter names, ``state_dict`` keys, ``.train()``/``.eval()`` and parameter casts are those
of the original model. Example::

    >>> island = AutocastIsland(torch.einsum, "cpu", torch.bfloat16, name="einsum")
    >>> island("ij,jk->ik", torch.randn(2, 3), torch.randn(3, 4)).dtype
    torch.bfloat16
    >>> island
    AutocastIsland(runs einsum under torch.autocast('cpu', dtype=torch.bfloat16))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["AutocastIsland"]


class AutocastIsland(nn.Module):
    """Calls ``wrapped(*args, **kwargs)`` inside ``torch.autocast(device_type, dtype=dtype)``.

    Args:
        wrapped: the module (kept registered elsewhere in the model, not as a child here, so its
            parameters keep their names) or the function to run.
        device_type: autocast's device type ("cuda" or "cpu").
        dtype: autocast's low-precision dtype (torch.float16 or torch.bfloat16).
        name: what the island runs, for ``repr`` and the report (the module's qualified name or the
            function's name).
    """

    def __init__(
        self, wrapped: nn.Module | Callable[..., Any], device_type: str, dtype: torch.dtype, name: str
    ) -> None:
        super().__init__()
        if not callable(wrapped):
            raise TypeError(f"AutocastIsland needs a module or a function to run, got {wrapped!r}")
        # Bypass nn.Module.__setattr__: registering the module as a child would rename its
        # parameters ("attn.in_proj_weight" -> "attn_autocast.wrapped.in_proj_weight").
        self.__dict__["wrapped"] = wrapped
        self.device_type = device_type
        self.dtype = dtype
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.wrapped(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"runs {self.name} under torch.autocast({self.device_type!r}, dtype={self.dtype})"
