"""Shared test setup: hypothesis profiles, the `gpu` marker and the `device` Triton kernels run on."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

REPO_ROOT = Path(__file__).resolve().parent.parent


def _is_repo_root(entry: str) -> bool:
    return Path(entry or os.getcwd()).resolve() == REPO_ROOT


def _repo_root_last() -> None:
    """Put the repository root behind every other entry of sys.path: ``python -m pytest`` (and
    pytest-xdist's workers, also through PYTHONPATH) put it first, where its top-level ``kernels/``
    (imported as ``amp_fx.kernels``) would hide Hugging Face's ``kernels`` package, which newer
    transformers import. Last, it still serves ``tests.*`` (here and in spawned ranks, which inherit
    sys.path) and nothing installed is shadowed; PYTHONPATH, which subprocesses read before their
    site-packages, loses it."""
    sys.path[:] = [entry for entry in sys.path if not _is_repo_root(entry)] + [str(REPO_ROOT)]
    kept = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and not _is_repo_root(e)]
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)


_repo_root_last()

# Fused ops on CPU tensors run their kernels' pure-torch reference (AMP_FX_FORCE_TRITON=0): what the
# Triton kernels are tested against, computing what they compute on a GPU. Unset, an eager CPU call
# computes the op's torch expression instead (what CPU users run, `amp_fx.kernels.kernels_run_for`);
# the tests of that default unset it. Spawned ranks and subprocesses inherit the setting.
from amp_fx.kernels import FORCE_TRITON_ENV  # noqa: E402  (after the sys.path fix above)

os.environ.setdefault(FORCE_TRITON_ENV, "0")

# CI runs on 2 CPU cores with a 10-minute budget for the whole suite: bounded examples, no deadline
# (the first call of a Triton kernel under the interpreter or of torch.fx tracing is slow).
settings.register_profile(
    "ci", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# `make thorough`: many more examples, drawn afresh each run (not derandomized), each failure printed
# with the blob that reproduces it (@reproduce_failure).
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(autouse=True, scope="session")
def pinned_thread_count():
    """One intra-op thread in every test: CPU reductions split their work by thread count, so the
    bits that tests compare (and their speed on CI's 2 shared cores) depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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


def spy_on_triton_ops(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the calls into ``amp_fx.kernels.triton_ops``, by kernel name: every op and optimizer
    looks its kernel up on the module ``implementation_for`` returns at call time, so a call that
    silently took the reference path leaves the count at zero. Skips the test without Triton."""
    pytest.importorskip("triton")
    from amp_fx.kernels import triton_ops

    calls: Counter[str] = Counter()

    def counting(name: str, kernel: Callable) -> Callable:
        def counted(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return counted

    for name in triton_ops.__all__:
        monkeypatch.setattr(triton_ops, name, counting(name, getattr(triton_ops, name)))
    return calls


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Force the Triton kernels (AMP_FX_FORCE_TRITON=1, on CPU under TRITON_INTERPRET=1) and count
    the calls of each (`spy_on_triton_ops`): a test named for the Triton path asserts on them."""
    from amp_fx.kernels import FORCE_TRITON_ENV

    calls = spy_on_triton_ops(monkeypatch)
    monkeypatch.setenv(FORCE_TRITON_ENV, "1")
    return calls


@pytest.fixture(
    params=[
        "reference",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
            ),
        ),
    ]
)
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs the test once on the pure-torch reference kernels and once on the Triton kernels (on CPU
    tensors, under TRITON_INTERPRET=1), chosen through AMP_FX_FORCE_TRITON; yields which. Each run
    checks afterwards that it took the path it names: the Triton run called a Triton kernel, the
    reference run none (counted by `spy_on_triton_ops`)."""
    from amp_fx.kernels import FORCE_TRITON_ENV

    calls = spy_on_triton_ops(monkeypatch) if request.param == "triton" or _has_triton() else Counter()
    monkeypatch.setenv(FORCE_TRITON_ENV, "1" if request.param == "triton" else "0")
    yield request.param
    if request.param == "triton":
        assert calls, "the [triton] run called no Triton kernel: AMP_FX_FORCE_TRITON was not followed"
    else:
        assert not calls, f"the [reference] run called Triton kernels: {dict(calls)}"


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def torch_functions_unpatched() -> Iterator[None]:
    """amp.initialize at O1 patches torch's FP32 functions while its session is current, as Apex
    did; a test's session ends with the test, so the next test starts with torch's own functions."""
    yield
    patches = sys.modules.get("amp_fx.amp._fp32_functions")
    if patches is not None:
        patches.restore()


@pytest.fixture
def mkldnn_disabled():
    """Run the test with oneDNN (mkldnn) off, so CPU convolutions take torch's native kernels.

    For tests that compare bf16 convolution gradients bit for bit: on CPUs with avx512_bf16 (seen on
    an AMD EPYC with torch 2.14), oneDNN's bf16 convolution backward is nondeterministic and at times
    wrong (``test_torchvision_models.test_bf16_convolution_backward_without_mkldnn``). Set through the
    ``enabled`` property, not ``torch.backends.mkldnn.flags()``, which also sets oneDNN's TF32 switch
    and warns that it is for Intel GPUs.
    """
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = enabled


# Every way Python code reads a tensor's value on the host (each one a device synchronization on CUDA).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.fixture
def no_host_reads() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context manager factory: inside ``with no_host_reads():`` any of `HOST_READS` on a tensor
    raises AssertionError. Checks on CPU what ``torch.cuda.set_sync_debug_mode("error")`` checks on a
    GPU, for the Python side (a read inside an ATen kernel is not seen)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    @contextlib.contextmanager
    def region() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as patch:
            for name in HOST_READS:
                patch.setattr(torch.Tensor, name, forbidden)
            yield

    return region


@pytest.fixture(autouse=True)
def grad_mode_kept() -> Iterator[None]:
    """Each test leaves grad mode on, as it found it. One that leaves it off fails here, by name,
    and the mode is put back: else every later test of its worker that runs a backward would fail
    ("does not require grad"), far from the cause."""
    yield
    enabled = torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    assert enabled, "the test left torch's grad mode off (a no_grad() entered and never exited?)"
