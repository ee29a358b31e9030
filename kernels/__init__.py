"""Triton kernels beside their pure-torch references; installed as `amp_fx.kernels`."""
