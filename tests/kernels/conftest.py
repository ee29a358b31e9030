"""The `device` every kernel test runs on: the CPU under TRITON_INTERPRET=1 (as `make test` and CI
run them) and CUDA (marked `gpu`, skipped without a GPU)."""

from __future__ import annotations

import os

import pytest

KERNEL_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=KERNEL_DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    # Module scope: hypothesis tests may use it (it refuses function-scoped fixtures).
    return request.param
