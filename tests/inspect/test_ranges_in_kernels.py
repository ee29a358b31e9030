"""amp_fx.watch and the fused ops: where a fused kernel of ours writes a watched value (a norm's
output and sum, an activation's output, a rotary embedding's), that kernel records it. The
statistics are what a separate record of the value gives, the model computes the same bits, and the
separate launches are fewer by one per such value; a request no kernel takes is recorded apart,
and by no later op."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_fx
from amp_fx.kernels import reference
from amp_fx.ops.range_record import (
    KERNEL_RECORDING_OPS,
    RangeClock,
    RangeRecorder,
    expect_kernel_records,
    kernel_record,
    range_begin,
    record_range,
)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's GELU, written out: fuse_activations makes it one fp32_activation."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    """A Llama MLP after an RMSNorm, and a GPT-2 MLP between two residual add + LayerNorms: at O2
    an rms_norm_fp32, a fp32_gated_activation, a fp32_activation and two add_layer_norm_fp32."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm, self.ln, self.ln_out = nn.RMSNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.gate, self.up = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.fc_in, self.fc_out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        h = self.fc_out(gelu_new(self.fc_in(self.ln(x))))
        return self.ln_out(x + h)


class LanguageModel(nn.Module):
    """Token embeddings into a `Block`: with ``low_precision_residual`` the stream, and so the sums
    of the residual adds, are bf16."""

    def __init__(self, vocabulary: int = 32, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocabulary, width)
        self.block = Block(width)
        with torch.no_grad():
            self.wte.weight[0, :4] = 3e38  # overflows bf16 in the norms' sums and outputs

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.block(self.wte(idx))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryAttention(nn.Module):
    """Llama's rotary embeddings of a query and a key: at O2 two rotary_embedding calls, the
    query's written in bf16 (the cast for the matmul folded in), the key's in fp32."""

    def __init__(self, width: int = 16, heads: int = 2, seq: int = 5) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)
        angles = torch.arange(seq)[:, None] * torch.arange(width // heads // 2) / 3.0
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos()[None, None])
        self.register_buffer("sin", angles.sin()[None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, -1).transpose(1, 2)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        return (q @ k.transpose(-1, -2)).softmax(-1)


@pytest.fixture
def separate_records(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the separate record launches (``record_range_`` of either implementation, as
    `RangeRecorder.record` calls it), under "launches"."""
    from amp_fx.kernels import triton_ops

    calls = {"launches": 0}
    for module in (reference, triton_ops):
        if module is None:
            continue
        kernel = module.record_range_

        def counted(*args, kernel=kernel, **kwargs):
            calls["launches"] += 1
            return kernel(*args, **kwargs)

        monkeypatch.setattr(module, "record_range_", counted)
    return calls


@contextlib.contextmanager
def no_kernel_records() -> Iterator[None]:
    """Within it, no fused op is asked to record in its kernel: the watch records apart, as before
    the kernels could."""
    saved = set(KERNEL_RECORDING_OPS)
    KERNEL_RECORDING_OPS.clear()
    try:
        yield
    finally:
        KERNEL_RECORDING_OPS.update(saved)


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(x)
    (out.float() * 1e3).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _watched_step(model, x, counter) -> tuple[list[dict], int, tuple]:
    """(each node's recorded ranges, separate record launches, the step's output and gradients)."""
    before = counter["launches"]
    watch = amp_fx.watch(model, every=1)
    result = _step(model, x)
    ranges = [r.to_dict() for r in watch.ranges()]
    watch.remove()
    return ranges, counter["launches"] - before, result


def _in_kernel_and_apart(model, x, counter) -> tuple[list[dict], list[dict], int]:
    """A watched step with the fused kernels recording and one with every record apart: (the
    in-kernel ranges, the separate ones, how many fewer separate launches the first took). Checks
    that watching changed no bit of the output or gradients."""
    unwatched = _step(copy.deepcopy(model), x)
    in_kernel, launches, watched = _watched_step(model, x, counter)
    for expected, got in zip((unwatched[0], *unwatched[1]), (watched[0], *watched[1]), strict=True):
        assert torch.equal(expected.view(torch.int8), got.view(torch.int8))
    with no_kernel_records():
        apart, launches_apart, _ = _watched_step(model, x, counter)
    return in_kernel, apart, launches_apart - launches


@pytest.mark.parametrize("front_end", ["fx", "export"])
@pytest.mark.parametrize("low_stream", [False, True], ids=["fp32_stream", "bf16_stream"])
def test_fused_kernels_record_what_a_separate_record_does(
    kernels, front_end, low_stream, separate_records
) -> None:
    torch.manual_seed(0)
    policy = amp_fx.preset("O2", torch.bfloat16, "cpu", low_precision_residual=low_stream)
    model = amp_fx.convert(LanguageModel(), policy=policy, front_end=front_end)
    idx = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(1))
    idx[0, 0] = 0
    in_kernel, apart, launches_saved = _in_kernel_and_apart(model, idx, separate_records)
    assert in_kernel == apart
    # The kernels recorded the bf16 values they wrote: the RMSNorm's, the two activations' and the
    # first add + LayerNorm's output, and with a bf16 stream the two sums too.
    assert launches_saved == (6 if low_stream else 4)
    recorded = {r["node"]: r for r in in_kernel}
    assert recorded["fp32_gated_activation"]["forward"]["numel"] == 2 * idx.numel() * 16
    assert recorded["fp32_gated_activation"]["backward"]["numel"] == 2 * idx.numel() * 16
    assert any(r["forward"]["overflowed"] for r in in_kernel)


@pytest.mark.parametrize("front_end", ["fx", "export"])
def test_the_rotary_kernel_records_what_a_separate_record_does(kernels, front_end, separate_records) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)) * 1e3
    example = (x,) if front_end == "fx" else None  # the fx front end fuses where shapes are known
    model = amp_fx.convert(
        RotaryAttention(), "O2", dtype=torch.bfloat16, device_type="cpu", front_end=front_end,
        example_inputs=example,
    )  # fmt: skip
    in_kernel, apart, launches_saved = _in_kernel_and_apart(model, x, separate_records)
    assert in_kernel == apart
    assert launches_saved == 1  # the query's bf16 rotary output
    (query,) = (r for r in in_kernel if r["op"] == "rotary_embedding" and r["dtype"] == "bfloat16")
    assert query["forward"]["numel"] == query["backward"]["numel"] == x.numel()


def test_a_request_no_kernel_takes_is_recorded_apart_and_by_no_later_op() -> None:
    recorder = RangeRecorder(RangeClock(every=1, history=1), size=2, root=True, low_only=True)
    begin = range_begin(recorder)
    value = torch.tensor([3.0, 1e-6, -0.5], dtype=torch.float16)
    # Slot 0: the op computed its torch expression; no kernel took the request.
    expect_kernel_records(begin, ((None, 0),))
    record_range(value, begin, 0)
    assert kernel_record(torch.device("cpu"), [(None, torch.float16)]) is None
    # Slot 1: its kernel took the request and recorded; the record after it adds nothing more.
    expect_kernel_records(begin, ((None, 1),))
    amax, counts, (index,) = kernel_record(torch.device("cpu"), [(None, torch.float16)])
    reference.record_range_(value, amax, counts, index)
    record_range(value, begin, 1)
    amax, counts = recorder.totals()
    assert amax[:, 0].tolist() == [3.0, 3.0]
    assert counts[:, 0].tolist() == [[1, 0, 3], [1, 0, 3]]
    assert list(recorder.clock.order[recorder.clock.row]) == [(recorder, 0, 0), (recorder, 1, 0)]


def test_a_step_that_does_not_record_asks_no_kernel() -> None:
    recorder = RangeRecorder(RangeClock(every=2, history=1), size=1, root=True, low_only=True)
    range_begin(recorder)  # step 0 records
    begin = range_begin(recorder)  # step 1 does not
    expect_kernel_records(begin, ((None, 0),))
    assert kernel_record(torch.device("cpu"), [(None, torch.float16)]) is None
