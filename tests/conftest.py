"""Shared test setup: hypothesis profiles, the `gpu` marker and the `device` Triton kernels run on."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI runs on 2 CPU cores with a 10-minute budget for the whole suite: bounded examples, no deadline
# (the first call of a Triton kernel under the interpreter or of torch.fx tracing is slow).
settings.register_profile(
    "ci", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Where Triton kernels are tested: the CPU under TRITON_INTERPRET=1 (as `make test` and CI run
# them) and CUDA (marked `gpu`, skipped without a GPU). A test that parametrizes "device" itself
# overrides this fixture.
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
