"""amp_fx.core.op_lists against the installed torch: the dispatcher's registrations and autocast's behaviour.

Each sampled op runs under torch.autocast with floating inputs and the result is compared, bit for
bit, with running the op outside autocast on inputs cast the way the list says (lower -> low
dtype, fp32 -> float32, promote -> widest input dtype, passthrough -> unchanged). That is exactly
what amp_fx's O1 does with explicit casts, so these tests are the ground truth for the O1 oracle.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from amp_fx.core.op_lists import (
    AUTOCAST_OP_LISTS,
    DEVICE_TYPES,
    KNOWN_OPS,
    OPAQUE_OP,
    PASSTHROUGH_OPS,
    autocast_op_lists,
    canonical_op_name,
    is_known_op,
    register_op,
)
from amp_fx.testing import tolerances

LOW_DTYPES = (torch.float16, torch.bfloat16)


class Inputs:
    """Makes a sample's tensors: the same values every run, floating ones in the requested dtypes.

    `dtypes` gives the dtype of the 1st, 2nd, ... floating tensor (the last repeats); `cast_to`
    then casts each floating tensor (explicit-cast reference). Integer tensors are never cast.
    """

    def __init__(self, device: str, dtypes: tuple[torch.dtype, ...], cast_to: torch.dtype | None = None):
        self.device, self.dtypes, self.cast_to = device, dtypes, cast_to
        self.generator = torch.Generator().manual_seed(0)
        self.count = 0

    def __call__(self, *shape: int, kind: str = "normal") -> torch.Tensor:
        # Inputs are made outside autocast, whatever context the sample runs in.
        with torch.autocast(self.device, enabled=False):
            return self._make(shape, kind)

    def _make(self, shape: tuple[int, ...], kind: str) -> torch.Tensor:
        if kind == "index":
            return torch.randint(0, 3, shape, generator=self.generator).to(self.device)
        values = torch.randn(shape, generator=self.generator)
        if kind == "positive":
            values = values.abs() + 0.5
        elif kind == "prob":
            values = torch.sigmoid(values)
        elif kind == "unit":
            values = torch.tanh(values)
        elif kind == "sign":
            values = values.sign()
        elif kind == "spd":
            values = values @ values.mT + shape[-1] * torch.eye(shape[-1])
        dtype = self.dtypes[min(self.count, len(self.dtypes) - 1)]
        self.count += 1
        tensor = values.to(dtype)
        if self.cast_to is not None:
            tensor = tensor.to(self.cast_to)
        return tensor.to(self.device)


Sample = Callable[[Inputs], torch.Tensor]

# One call per op name: the op named is the one the call reaches first (checked below against the
# lists). Small shapes: these run on 2 CPU cores.
SAMPLES: dict[str, Sample] = {
    # lower_precision_fp (both devices)
    "linear": lambda t: F.linear(t(2, 3), t(4, 3), t(4)),
    "conv1d": lambda t: F.conv1d(t(1, 2, 5), t(3, 2, 2)),
    "conv2d": lambda t: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3), t(3)),
    "conv3d": lambda t: F.conv3d(t(1, 2, 3, 3, 3), t(2, 2, 2, 2, 2)),
    "conv_transpose1d": lambda t: F.conv_transpose1d(t(1, 2, 4), t(2, 3, 2)),
    "conv_transpose2d": lambda t: F.conv_transpose2d(t(1, 2, 3, 3), t(2, 3, 2, 2)),
    "conv_transpose3d": lambda t: F.conv_transpose3d(t(1, 2, 2, 2, 2), t(2, 1, 2, 2, 2)),
    "matmul": lambda t: torch.matmul(t(2, 3, 4), t(4, 5)),
    "mm": lambda t: torch.mm(t(2, 3), t(3, 4)),
    "bmm": lambda t: torch.bmm(t(2, 3, 4), t(2, 4, 5)),
    "addmm": lambda t: torch.addmm(t(2, 4), t(2, 3), t(3, 4)),
    "baddbmm": lambda t: torch.baddbmm(t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)),
    "addbmm": lambda t: torch.addbmm(t(3, 5), t(2, 3, 4), t(2, 4, 5)),
    "linalg_vecdot": lambda t: torch.linalg.vecdot(t(3, 4), t(3, 4)),
    "prelu": lambda t: F.prelu(t(2, 3, 4), t(3)),
    "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention(
        t(1, 2, 3, 4), t(1, 2, 3, 4), t(1, 2, 3, 4)
    ),
    "einsum": lambda t: torch.einsum("bij,bjk->bik", t(2, 3, 4), t(2, 4, 5)),
    "addmv": lambda t: torch.addmv(t(3), t(3, 4), t(4)),
    "mv": lambda t: torch.mv(t(3, 4), t(4)),
    "addr": lambda t: torch.addr(t(3, 4), t(3), t(4)),
    # fp32 (CPU list and/or CUDA list)
    "mse_loss": lambda t: F.mse_loss(t(3, 4), t(3, 4)),
    "l1_loss": lambda t: F.l1_loss(t(3, 4), t(3, 4)),
    "smooth_l1_loss": lambda t: F.smooth_l1_loss(t(3, 4), t(3, 4)),
    "huber_loss": lambda t: F.huber_loss(t(3, 4), t(3, 4)),
    "nll_loss": lambda t: F.nll_loss(t(3, 4), t(3, kind="index")),
    "kl_div": lambda t: F.kl_div(t(3, 4), t(3, 4, kind="prob"), reduction="batchmean"),
    "binary_cross_entropy_with_logits": lambda t: F.binary_cross_entropy_with_logits(
        t(3, 4), t(3, 4, kind="prob")
    ),
    "cosine_embedding_loss": lambda t: F.cosine_embedding_loss(t(3, 4), t(3, 4), t(3, kind="sign")),
    "margin_ranking_loss": lambda t: F.margin_ranking_loss(t(3), t(3), t(3, kind="sign")),
    "hinge_embedding_loss": lambda t: F.hinge_embedding_loss(t(3, 4), t(3, 4, kind="sign")),
    "soft_margin_loss": lambda t: F.soft_margin_loss(t(3, 4), t(3, 4, kind="sign")),
    "triplet_margin_loss": lambda t: F.triplet_margin_loss(t(3, 4), t(3, 4), t(3, 4)),
    "multi_margin_loss": lambda t: F.multi_margin_loss(t(3, 4), t(3, kind="index")),
    "poisson_nll_loss": lambda t: F.poisson_nll_loss(t(3, 4), t(3, 4, kind="positive")),
    "cdist": lambda t: torch.cdist(t(3, 4), t(2, 4)),
    "avg_pool3d": lambda t: F.avg_pool3d(t(1, 2, 4, 4, 4), 2),
    "max_pool3d": lambda t: F.max_pool3d(t(1, 2, 4, 4, 4), 2),
    "adaptive_avg_pool3d": lambda t: F.adaptive_avg_pool3d(t(1, 2, 4, 4, 4), 2),
    "reflection_pad2d": lambda t: F.pad(t(1, 2, 4, 4), (1, 1, 1, 1), mode="reflect"),
    "replication_pad2d": lambda t: F.pad(t(1, 2, 4, 4), (1, 1, 1, 1), mode="replicate"),
    "grid_sampler": lambda t: torch.grid_sampler(t(1, 2, 4, 4), t(1, 3, 3, 2, kind="unit"), 0, 0, False),
    "trace": lambda t: torch.trace(t(4, 4)),
    "inverse": lambda t: torch.inverse(t(4, 4, kind="spd")),
    "linalg_inv": lambda t: torch.linalg.inv(t(4, 4, kind="spd")),
    "linalg_svdvals": lambda t: torch.linalg.svdvals(t(4, 3)),
    "quantile": lambda t: torch.quantile(t(8), 0.3),
    "fft_rfft": lambda t: torch.fft.rfft(t(8)).real,
    "exp": lambda t: torch.exp(t(3, 4)),
    "log": lambda t: torch.log(t(3, 4, kind="positive")),
    "pow": lambda t: torch.pow(t(3, 4), 2),
    "rsqrt": lambda t: torch.rsqrt(t(3, 4, kind="positive")),
    "layer_norm": lambda t: F.layer_norm(t(2, 3, 4), (4,), t(4), t(4)),
    "group_norm": lambda t: F.group_norm(t(2, 4, 3), 2, t(4), t(4)),
    "cosine_similarity": lambda t: F.cosine_similarity(t(3, 4), t(3, 4)),
    "logsumexp": lambda t: torch.logsumexp(t(3, 4), dim=1),
    "upsample_nearest2d": lambda t: torch._C._nn.upsample_nearest2d(t(1, 2, 3, 3), (6, 6)),
    "upsample_bilinear2d": lambda t: torch._C._nn.upsample_bilinear2d(t(1, 2, 3, 3), (6, 6), False),
    # fp32_set_opt_dtype (CUDA) / passthrough (CPU) except prod, on the CPU fp32 list
    "prod": lambda t: torch.prod(t(3, 4, kind="positive"), dim=1),
    "softmax": lambda t: torch.softmax(t(3, 4), dim=1),
    "log_softmax": lambda t: torch.log_softmax(t(3, 4), dim=1),
    "cumsum": lambda t: torch.cumsum(t(3, 4), dim=1),
    "sum": lambda t: torch.sum(t(3, 4), dim=1),
    "linalg_vector_norm": lambda t: torch.linalg.vector_norm(t(3, 4), dim=1),
    # fp32_append_dtype (CUDA)
    "norm": lambda t: torch.norm(t(3, 4), dim=1),
    # promote
    "cat": lambda t: torch.cat([t(2, 3), t(2, 3)]),
    "stack": lambda t: torch.stack([t(2, 3), t(2, 3)]),
    "index_copy": lambda t: t(4, 3).index_copy(0, torch.tensor([0, 2], device=t.device), t(2, 3)),
    "addcmul": lambda t: torch.addcmul(t(3), t(3), t(3)),
    "addcdiv": lambda t: torch.addcdiv(t(3), t(3), t(3, kind="positive")),
    "atan2": lambda t: torch.atan2(t(3), t(3)),
    "dot": lambda t: torch.dot(t(4), t(4)),
    "cross": lambda t: torch.linalg.cross(t(2, 3), t(2, 3)),
    "tensordot": lambda t: torch.tensordot(t(2, 3, 4), t(3, 4, 5), dims=2),
    "scatter_add": lambda t: t(3, 4).scatter_add(
        0, torch.zeros(2, 4, dtype=torch.long, device=t.device), t(2, 4)
    ),
    "bilinear": lambda t: F.bilinear(t(2, 3), t(2, 4), t(5, 3, 4)),
    # passthrough
    "relu": lambda t: F.relu(t(3, 4)),
    "gelu": lambda t: F.gelu(t(3, 4)),
    "silu": lambda t: F.silu(t(3, 4)),
    "sigmoid": lambda t: torch.sigmoid(t(3, 4)),
    "tanh": lambda t: torch.tanh(t(3, 4)),
    "hardswish": lambda t: F.hardswish(t(3, 4)),
    "leaky_relu": lambda t: F.leaky_relu(t(3, 4)),
    "add": lambda t: torch.add(t(3, 4), t(3, 4)),
    "mul": lambda t: torch.mul(t(3, 4), t(3, 4)),
    "div": lambda t: torch.div(t(3, 4), t(3, 4, kind="positive")),
    "mean": lambda t: torch.mean(t(3, 4), dim=1),
    "max_pool2d": lambda t: F.max_pool2d(t(1, 2, 4, 4), 2),
    "avg_pool2d": lambda t: F.avg_pool2d(t(1, 2, 4, 4), 2),
    "adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t(1, 2, 4, 4), 1),
    "batch_norm": lambda t: F.batch_norm(t(2, 3, 4), t(3), t(3, kind="positive"), t(3), t(3), training=False),
    "embedding": lambda t: F.embedding(t(2, 3, kind="index"), t(4, 5)),
    "transpose": lambda t: t(3, 4).transpose(0, 1),
    "flatten": lambda t: t(2, 3, 4).flatten(1),
    "dropout": lambda t: F.dropout(t(3, 4), p=0.5, training=False),
    "pad": lambda t: F.pad(t(1, 2, 4, 4), (1, 1, 1, 1)),
    "unfold": lambda t: F.unfold(t(1, 2, 4, 4), 2),
    "std": lambda t: torch.std(t(3, 4), dim=1),
    "where": lambda t: torch.where(t(3, 4) > 0, t(3, 4), t(3, 4)),
}


def _expected_dtype(
    category: str | None, low: torch.dtype, in_dtypes: tuple[torch.dtype, ...]
) -> torch.dtype:
    if category == "lower_precision_fp":
        return low
    if category in ("fp32", "fp32_set_opt_dtype", "fp32_append_dtype"):
        return torch.float32
    if category == "promote":
        return torch.float32 if torch.float32 in in_dtypes else low
    raise AssertionError(category)


def _check_list_behaviour(device: str, name: str, low: torch.dtype) -> None:
    lists = autocast_op_lists(device)
    category = lists.category(name)
    sample = SAMPLES[name]
    if category is None:
        # Passthrough: autocast must not touch the op, for fp32 and for low-precision inputs.
        assert name in PASSTHROUGH_OPS or name in KNOWN_OPS, name
        for in_dtype in (torch.float32, low):
            try:
                plain = sample(Inputs(device, (in_dtype,)))
            except (RuntimeError, NotImplementedError) as error:
                # No kernel for this dtype (e.g. cuFFT in bf16): autocast leaves the op alone, so it
                # must fail the same way under autocast.
                with pytest.raises(type(error)), torch.autocast(device, dtype=low):
                    sample(Inputs(device, (in_dtype,)))
                continue
            with torch.autocast(device, dtype=low):
                under = sample(Inputs(device, (in_dtype,)))
            assert under.dtype == plain.dtype, (name, in_dtype)
            assert torch.equal(under, plain), (name, in_dtype)
        return
    # fp32 ops are tested from low inputs (the interesting direction), the others from fp32 inputs,
    # and promote ops from mixed inputs (low first, then fp32) as well as all-low inputs.
    if category == "promote":
        input_dtypes = [(low, torch.float32), (low,)]
    elif category == "lower_precision_fp":
        input_dtypes = [(torch.float32,)]
    else:
        input_dtypes = [(low,), (torch.float32,)]
    for in_dtypes in input_dtypes:
        expected = _expected_dtype(category, low, in_dtypes)
        with torch.autocast(device, dtype=low):
            under = sample(Inputs(device, in_dtypes))
        assert under.dtype == expected, (name, category, in_dtypes, under.dtype)
        reference = sample(Inputs(device, in_dtypes, cast_to=expected))
        if category in ("fp32_set_opt_dtype", "fp32_append_dtype"):
            # These pass dtype=float32 instead of casting the input: same maths, accumulation
            # order may differ in the last bit.
            rtol, atol = tolerances(torch.float32)
            torch.testing.assert_close(under, reference, rtol=rtol, atol=atol)
        else:
            assert torch.equal(under, reference), (name, category, in_dtypes)


def _ops_in_this_torch(names: frozenset[str]) -> set[str]:
    return {name for name in names if hasattr(torch.ops.aten, name)}


def _registered(device: str) -> set[str] | None:
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device]
    try:
        registrations = torch._C._dispatch_get_registrations_for_dispatch_key(key)
    except RuntimeError:
        return None
    # "aten::conv2d.padding" -> "conv2d"
    return {entry.split("::", 1)[1].split(".", 1)[0] for entry in registrations if entry.startswith("aten::")}


@pytest.mark.parametrize("device", DEVICE_TYPES)
def test_lists_match_the_dispatchers_autocast_registrations(device: str) -> None:
    registered = _registered(device)
    if not registered:
        pytest.skip(f"this torch build registers no Autocast{device.upper()} kernels")
    lists = AUTOCAST_OP_LISTS[device]
    listed = lists.all_ops() - lists.composite
    assert registered - listed == set(), "autocast registers ops the lists miss"
    # The lists cover torch 2.11 and 2.14: an op listed but not registered must not exist in this torch.
    assert _ops_in_this_torch(listed - registered) == set()
    # Composite ops reach listed ops; they have no autocast kernel of their own.
    assert lists.composite & registered == set()


@pytest.mark.parametrize("device", DEVICE_TYPES)
def test_an_op_is_on_at_most_one_list(device: str) -> None:
    lists = AUTOCAST_OP_LISTS[device]
    for first, second in itertools.combinations(lists.CATEGORIES, 2):
        assert getattr(lists, first) & getattr(lists, second) == frozenset(), (first, second)


def test_known_ops_cover_every_list_and_passthrough_is_on_none() -> None:
    for lists in AUTOCAST_OP_LISTS.values():
        assert lists.all_ops() <= KNOWN_OPS
        assert PASSTHROUGH_OPS & lists.all_ops() == frozenset()
    assert PASSTHROUGH_OPS <= KNOWN_OPS and OPAQUE_OP in KNOWN_OPS
    assert all(not name.endswith("_") for name in PASSTHROUGH_OPS)
    assert {
        "relu",
        "gelu",
        "getitem",
        "view",
        "to",
        "batch_norm",
        "embedding",
        "max_pool2d",
    } <= PASSTHROUGH_OPS
    assert set(SAMPLES) <= KNOWN_OPS


def test_canonical_names_and_registration() -> None:
    assert canonical_op_name("cross_entropy") == "cross_entropy_loss"
    assert canonical_op_name("nll_loss_nd") == "nll_loss"  # torch.export's F.nll_loss: FP32 as nll_loss
    assert canonical_op_name("relu_") == "relu"
    assert canonical_op_name("add_") == "add"
    assert canonical_op_name("__add__") == "__add__"
    assert not is_known_op("my_custom_gelu_for_test")
    register_op("my_custom_gelu_for_test")
    assert is_known_op("my_custom_gelu_for_test")
    with pytest.raises(ValueError, match="identifier"):
        register_op("not an op")
    with pytest.raises(ValueError, match="device_type='cuda'"):
        autocast_op_lists("mps")


@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_cpu_lists_match_torch_autocast(name: str, low: torch.dtype) -> None:
    lists = autocast_op_lists("cpu")
    if lists.category(name) == "composite":
        pytest.skip("composite ops are checked by test_cpu_composites_are_changed_by_autocast")
    _check_list_behaviour("cpu", name, low)


@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
def test_cpu_composites_are_changed_by_autocast(low: torch.dtype) -> None:
    # Ops on no CPU list whose result autocast still changes: O1 must run them in an autocast island.
    composites: dict[str, Sample] = {
        "einsum": SAMPLES["einsum"],
        "bilinear": SAMPLES["bilinear"],
        "tensordot": SAMPLES["tensordot"],
        "linalg_multi_dot": lambda t: torch.linalg.multi_dot([t(2, 3), t(3, 4), t(4, 2)]),
        "rnn_tanh": lambda t: torch.rnn_tanh(
            t(3, 2, 4), t(1, 2, 4), [t(4, 4), t(4, 4), t(4), t(4)], True, 1, 0.0, False, False, False
        )[0],
        "gru": lambda t: torch.gru(
            t(3, 2, 4), t(1, 2, 4), [t(12, 4), t(12, 4), t(12), t(12)], True, 1, 0.0, False, False, False
        )[0],
    }
    lists = autocast_op_lists("cpu")
    for name, sample in composites.items():
        assert lists.category(name) == "composite", name
        with torch.autocast("cpu", dtype=low):
            under = sample(Inputs("cpu", (torch.float32,)))
        plain = sample(Inputs("cpu", (torch.float32,)))
        assert under.dtype != plain.dtype or not torch.equal(under, plain), name


@pytest.mark.gpu
@pytest.mark.parametrize("low", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_cuda_lists_match_torch_autocast(name: str, low: torch.dtype) -> None:
    lists = autocast_op_lists("cuda")
    category = lists.category(name)
    if category == "composite":
        pytest.skip("composite ops have no autocast kernel of their own")
    if name in CUDA_LIST_DIFFERENCES_BEFORE_2_14 and TORCH_VERSION < (2, 14):
        with pytest.raises(AssertionError if name == "trace" else RuntimeError):
            _check_list_behaviour("cuda", name, low)
        return
    _check_list_behaviour("cuda", name, low)


# The lists follow torch 2.14.1. Seen on an H200 with torch 2.11: CUDA autocast runs `trace` in
# fp32, and `torch.linalg.cross` on mixed fp16/fp32 inputs is not promoted (it raises). Kept
# as expectations so that a change on either side shows up.
CUDA_LIST_DIFFERENCES_BEFORE_2_14 = frozenset({"trace", "cross"})
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
