"""Triton kernels beside their pure-torch references; installed as `amp_fx.kernels`.

``reference`` holds the fused-optimizer math in plain torch (runs anywhere).
"""

from amp_fx.kernels import reference

__all__ = ["reference"]
