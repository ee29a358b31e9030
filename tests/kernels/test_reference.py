"""The kernel contract: ``amp_fx.kernels.reference`` and ``amp_fx.kernels.triton_ops`` define every
kernel the families name (``amp_fx.kernels.families``), with one signature."""

from __future__ import annotations

import importlib
import inspect

import pytest

from amp_fx.kernels import reference
from amp_fx.kernels.families import FAMILIES, KERNEL_NAMES


def test_reference_implements_the_triton_contract() -> None:
    """implementation_for() returns either module: each defines every kernel the families name, with
    one signature, which is each family's reference's and Triton kernel's."""
    triton_ops = pytest.importorskip("amp_fx.kernels.triton_ops")
    assert list(triton_ops.__all__) == list(KERNEL_NAMES)
    for name in KERNEL_NAMES:
        assert name in reference.__all__, name
        expected = inspect.signature(getattr(triton_ops, name))
        assert inspect.signature(getattr(reference, name)) == expected, name
    for family in FAMILIES:
        implementations = [
            importlib.import_module(f"{family.__name__}.{kind}") for kind in ("reference", "triton")
        ]
        for name in family.KERNELS:
            assert getattr(reference, name) is getattr(implementations[0], name), name
            assert getattr(triton_ops, name) is getattr(implementations[1], name), name
