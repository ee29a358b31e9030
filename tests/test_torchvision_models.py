"""Every torchvision classification model converts at O0-O3, in fp16 and bf16, and still computes.

How "agrees with FP32" is checked on a whole deep network, and why this way:

- O0 is bit-identical to the model (outputs and all gradients).
- O1 on CPU is bit-identical to the model run under ``torch.autocast("cpu", dtype)``, the
  definition of O1 (outputs and all gradients), and every output and gradient is finite.
- O3 is bit-identical to Apex's O3, the model cast to fp16/bf16 (outputs and all gradients).
- O2's outputs and gradients are finite, and O2 is at least as accurate as the established
  recipes (torch.autocast, i.e. O1, and the pure low-precision model, i.e. Apex O3), up to a
  factor of `REFERENCE_FACTOR`, in the norm-wise error against FP32 of the logits, of the input
  gradient and of all parameter gradients together; errors below the dtype's tolerance
  (`amp_fx.testing.tolerances` / `grad_tolerances`) always pass.

A fixed tolerance against FP32 (what the random-model property tests use) is not meaningful
for a deep network with random weights: its gradient is ill-conditioned. Measured on resnet18
in FP32, perturbing the input by a relative 1e-4 (a tenth of fp16's rounding) moves the input
gradient by 2% and the parameter gradients by 1%: every ReLU and max-pool whose input crosses a
kink routes the gradient differently. fp16/bf16 rounding does the same at every layer, so even
the established recipes (torch.autocast, ``model.half()``) differ from FP32 by 3-45% in their
gradients, more than any tolerance that would still catch a bug. The reference is therefore the
error of the least accurate established recipe on the same model and inputs: a conversion that
loses accuracy (a lost FP32 island, a cast in the wrong place, an overflow) stands out against it.

The models run in eval mode (dropout and stochastic depth off, so runs are deterministic), with
BatchNorm running statistics calibrated on a separate random batch first: at initialization they
are (0, 1), which leaves deep networks with vanishing activations (mobilenet_v3_small's logits are
1e-10 and underflow in fp16), unlike a trained network. Inputs are batch 2 at each model's
smallest valid size. A cheap subset runs by default; the full matrix runs with ``pytest -m slow``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torchvision
from torch import nn

import amp_fx
from amp_fx.testing import (
    ForwardBackward,
    assert_equivalent,
    compare_tensors,
    forward_backward,
    grad_tolerances,
    low_precision_copy,
    normwise_error,
    tolerances,
    with_autocast,
)

# O2 may be this many times less accurate than the references (O1 = torch.autocast, and the pure
# low-precision model = Apex O3) before the test fails: rounding in a deep network is chaotic, so
# two recipes of similar accuracy differ by up to ~1.5x on one input (measured on the default subset).
REFERENCE_FACTOR = 2.0
LOW_DTYPES = (torch.float16, torch.bfloat16)
CLASSES = 10
# Random images the BatchNorm statistics are calibrated on: at the smallest input sizes the last
# stages see one position per image, and with fewer images the estimated variances are so noisy
# that deep networks blow up (efficientnet_b0's logits reach 2e4 after calibrating on 8).
CALIBRATION_BATCH = 64


@dataclass(frozen=True)
class Case:
    name: str
    # Smallest input height/width the architecture accepts (found by trying sizes).
    size: int
    extra: tuple[tuple[str, object], ...] = ()

    def build(self) -> nn.Module:
        return getattr(torchvision.models, self.name)(weights=None, num_classes=CLASSES, **dict(self.extra))


@dataclass(frozen=True)
class TinyViT(Case):
    """torchvision's VisionTransformer (the class of vit_b_16) at 2 layers of width 32: a transformer
    in the default run (vit_b_16 itself, at 32 px, takes ~2 minutes here; it runs with -m slow)."""

    def build(self) -> nn.Module:
        return torchvision.models.VisionTransformer(
            image_size=self.size, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
            num_classes=CLASSES,
        )  # fmt: skip


DEFAULT = [
    Case("resnet18", 16),
    TinyViT("vit_tiny", 32),
    Case("mobilenet_v3_small", 16),
    Case("squeezenet1_0", 24),
    Case("shufflenet_v2_x1_0", 16),
]
NO_AUX = (("aux_logits", False), ("init_weights", True))
SLOW = [
    Case("resnet50", 16),
    Case("resnext50_32x4d", 16),
    Case("wide_resnet50_2", 16),
    Case("mobilenet_v2", 16),
    Case("efficientnet_b0", 16),
    Case("efficientnet_v2_s", 16),
    Case("regnet_y_400mf", 16),
    Case("mnasnet0_5", 16),
    Case("densenet121", 32),
    Case("alexnet", 64),
    Case("vgg11", 32),
    Case("googlenet", 16, NO_AUX),
    Case("inception_v3", 75, NO_AUX),
    Case("convnext_tiny", 32),
    Case("vit_b_16", 32, (("image_size", 32),)),
    Case("swin_t", 16),
    Case("maxvit_t", 224),
]


@pytest.fixture(autouse=True)
def _one_thread():
    """Run each model on one intra-op thread, and restore the setting afterwards.

    The tensors are tiny, so threads only add synchronization; on a busy 2-core machine each op's
    OpenMP barrier waits for a descheduled thread: shufflenet_v2_x1_0's fp16 forward and backward
    took 52 s on 2 threads and 0.25 s on one.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prepare(case: Case) -> tuple[nn.Module, torch.Tensor]:
    """The model in eval mode with calibrated BatchNorm statistics, and its input batch."""
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = case.build()
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        for norm in norms:
            norm.reset_running_stats()
            norm.momentum = None  # a plain average over the calibration batch
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(torch.randn(CALIBRATION_BATCH, 3, case.size, case.size, generator=generator))
    model.eval()
    return model, torch.randn(2, 3, case.size, case.size, generator=generator)


def _assert_identical(actual: ForwardBackward, expected: ForwardBackward, what: str) -> None:
    pairs = [
        (f"output[{i}]", a, e) for i, (a, e) in enumerate(zip(actual.outputs, expected.outputs, strict=True))
    ]
    pairs += [(f"grad of {n!r}", actual.param_grads.get(n), g) for n, g in expected.param_grads.items()]
    pairs += [("grad of the input", actual.input_grads[0], expected.input_grads[0])]
    for name, a, e in pairs:
        assert a is not None, f"{what}: no {name}"
        mismatch = compare_tensors(a, e, rtol=0.0, atol=0.0, name=name)
        assert mismatch is None, f"{what} is not bit-identical: {mismatch.name}: {mismatch.message}"


# An unscaled low-precision gradient whose FP32 value is within this factor of the dtype's largest
# number may overflow on the way (partial sums, rounding): a loss scaler's job, not a cast's.
OVERFLOW_HEADROOM = 16.0


def _overflowed_near_the_limit(run: ForwardBackward, fp32: ForwardBackward, dtype: torch.dtype) -> set[str]:
    """Parameters whose gradient in ``run`` is not finite while their FP32 gradient leaves less than
    OVERFLOW_HEADROOM to ``dtype``'s largest value."""
    limit = torch.finfo(dtype).max / OVERFLOW_HEADROOM
    return {
        name
        for name, grad in run.param_grads.items()
        if not torch.isfinite(grad).all() and fp32.param_grads[name].abs().max() > limit
    }


def _errors(
    run: ForwardBackward, fp32: ForwardBackward, what: str, require_finite: bool, skip: set[str] = frozenset()
) -> dict[str, float]:
    """Norm-wise errors against FP32: logits, input gradient, all parameter gradients together
    (but those in ``skip``)."""
    names = [n for n in fp32.param_grads if n not in skip]
    missing = [n for n in names if n not in run.param_grads]
    assert not missing, f"{what}: parameters without a gradient: {missing}"
    if require_finite:
        bad = [n for n in names if not torch.isfinite(run.param_grads[n]).all()]
        assert not bad, f"{what}: non-finite gradients of {bad}"
        assert all(torch.isfinite(o).all() for o in run.outputs), f"{what}: non-finite outputs"
    return {
        "logits": normwise_error(run.outputs[0], fp32.outputs[0]),
        "input grad": normwise_error(run.input_grads[0], fp32.input_grads[0]),
        "param grads": normwise_error(
            torch.cat([run.param_grads[n].double().flatten() for n in names]),
            torch.cat([fp32.param_grads[n].double().flatten() for n in names]),
        ),
    }


def _assert_as_accurate_as(
    errors: dict[str, float], references: list[dict[str, float]], dtype: torch.dtype, what: str
) -> None:
    floors = {"logits": tolerances(dtype)[0], "input grad": grad_tolerances(dtype)[0]}
    floors["param grads"] = floors["input grad"]
    for key, error in errors.items():
        # NaN or inf in a reference (pure fp16 overflows in some networks) gives it no say.
        reference = max([r[key] for r in references if math.isfinite(r[key])], default=0.0)
        bound = max(floors[key], REFERENCE_FACTOR * reference)
        assert error <= bound, (
            f"{what}: {key} norm-wise error {error:.3g} vs FP32 exceeds {bound:.3g} "
            f"({REFERENCE_FACTOR}x the references' {reference:.3g}, floor {floors[key]:g}); "
            f"all errors {errors}, references' {references}"
        )


def check_model(case: Case) -> None:
    model, x = _prepare(case)
    inputs = (x,)
    gm = amp_fx.convert(model, "O0", device_type="cpu")
    assert_equivalent(model, gm, inputs, exact=True)
    fp32 = forward_backward(model, inputs)
    assert all(torch.isfinite(o).all() for o in fp32.outputs)
    for dtype in LOW_DTYPES:
        pure = forward_backward(low_precision_copy(model, dtype), inputs)
        o3 = amp_fx.convert(model, "O3", dtype=dtype, device_type="cpu")
        _assert_identical(forward_backward(o3, inputs), pure, f"{case.name} O3 {dtype}")

        o1 = amp_fx.convert(model, "O1", dtype=dtype, device_type="cpu")
        o1_run = forward_backward(o1, inputs)
        _assert_identical(o1_run, forward_backward(with_autocast(model, "cpu", dtype), inputs), f"O1 {dtype}")
        # O1 is autocast, bit for bit (above): where autocast's unscaled fp16 gradients overflow
        # (efficientnet_b0's depthwise weights sit near 65504 here, on either side from run to
        # run), that is torch's result, and a loss scaler's job; it then gives O2 no reference.
        o2 = amp_fx.convert(model, "O2", dtype=dtype, device_type="cpu")
        o2_run = forward_backward(o2, inputs)
        # O2's fp16 gradients are fp16 math, as `.half()`'s: efficientnet_b0's depthwise weights have
        # FP32 gradients of 13k-25k here, and their unscaled fp16 gradients overflowed in one make
        # slow run (not in others). Those are left out of O2's and the references' errors alike;
        # every other gradient must be finite and as accurate.
        near_limit = _overflowed_near_the_limit(o2_run, fp32, dtype)
        o2_errors = _errors(o2_run, fp32, f"O2 {dtype}", require_finite=True, skip=near_limit)
        o1_errors = _errors(o1_run, fp32, f"O1 {dtype}", require_finite=False, skip=near_limit)
        pure_errors = _errors(pure, fp32, f"pure {dtype}", require_finite=False, skip=near_limit)
        references = [o1_errors, pure_errors]
        _assert_as_accurate_as(o2_errors, references, dtype, f"{case.name} O2 {dtype}")


# Bit comparisons of bf16 convolutions run without oneDNN: its bf16 backward is nondeterministic on
# some CPUs (`test_bf16_convolution_backward_without_mkldnn`).
@pytest.mark.usefixtures("mkldnn_disabled")
@pytest.mark.parametrize("case", DEFAULT, ids=[c.name for c in DEFAULT])
def test_default_models(case: Case) -> None:
    check_model(case)


@pytest.mark.slow
@pytest.mark.usefixtures("mkldnn_disabled")
@pytest.mark.parametrize("case", SLOW, ids=[c.name for c in SLOW])
def test_all_models(case: Case) -> None:
    check_model(case)


def test_every_classification_model_is_listed() -> None:
    listed = {c.name for c in DEFAULT + SLOW if not isinstance(c, TinyViT)}
    required = {
        "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2", "mobilenet_v3_small",
        "efficientnet_b0", "efficientnet_v2_s", "regnet_y_400mf", "mnasnet0_5", "shufflenet_v2_x1_0",
        "squeezenet1_0", "densenet121", "alexnet", "vgg11", "googlenet", "inception_v3", "convnext_tiny",
        "vit_b_16", "swin_t", "maxvit_t",
    }  # fmt: skip
    assert required <= listed
    assert listed <= set(torchvision.models.list_models(torchvision.models))


def test_bf16_convolution_backward_without_mkldnn(mkldnn_disabled: None) -> None:
    """bf16 convolution gradients are deterministic and accurate with oneDNN off, as the bit
    comparisons above run them.

    Why they run that way (torch 2.14.1 CPU, AMD EPYC with avx512_bf16): with oneDNN on, this same
    backward of a bf16 resnet18 gives different parameter gradients on consecutive passes over the
    same input; layer4[0].conv1.weight's largest gradient was 1.6e36 on one pass and 0.27 on the
    next (norm-wise error against float64 1.5e35, then 0.09), so O3 and `.to(torch.bfloat16)`,
    identical graphs, were "not bit-identical". Not asserted here, as it depends on the CPU; see
    docs/DESIGN.md, "Known torch issues".
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=CLASSES).eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    def grads(net: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        net.zero_grad()
        net(inputs).float().sum().backward()
        return torch.cat([p.grad.double().flatten() for p in net.parameters()])

    bf16 = model.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    # The reference: the same bf16 weights and input in float64.
    reference = grads(low_precision_copy(bf16, torch.float64), x.double())
    runs = [grads(bf16, x) for _ in range(3)]
    for run in runs[1:]:
        assert torch.equal(run, runs[0]), "bf16 convolution backward without oneDNN is not deterministic"
    # bf16 rounding through 18 layers: measured 0.08; oneDNN's bad passes were 1e35.
    assert normwise_error(runs[0], reference) < 0.25
