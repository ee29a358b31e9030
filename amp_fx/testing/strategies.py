"""Hypothesis strategies for random models and matching inputs, to property-test conversions.

    >>> from hypothesis import given
    >>> import amp_fx
    >>> from amp_fx.testing import SMOOTH_ACTIVATIONS, assert_equivalent, models_and_inputs
    >>> @given(models_and_inputs(max_layers=3, activations=SMOOTH_ACTIVATIONS))
    ... def test_o2_bf16(model_and_inputs):
    ...     model, inputs = model_and_inputs
    ...     converted = amp_fx.convert(model, "O2", dtype=torch.bfloat16, device_type="cpu")
    ...     assert_equivalent(model, converted, inputs)

A drawn model is one of four families, by its input: ``"tokens"`` (int64 ids into an
Embedding), ``"sequence"`` (float (batch, tokens, features)), ``"image"`` (Conv2d over
(batch, channels, height, width)) and ``"signal"`` (Conv1d over (batch, channels, length)).
Its blocks are drawn from `SEQUENCE_LAYERS` or `SPATIAL_LAYERS`; every block keeps
activations O(1) (see `random_models.initialize_`), shapes are small (a forward and backward
take milliseconds on CPU), and the parameters and inputs come from a `torch.Generator` seeded
by a drawn integer, so a hypothesis example always rebuilds the same model. Models with
kinked activations (relu, ...) are compared with FP32 in their outputs only (``check_grads=False``):
their gradients jump at the kink.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from amp_fx.testing.random_models import (
    ACTIVATIONS,
    SPELLINGS,
    Activation,
    ChannelsFirst,
    Concat,
    MultiheadSelfAttention,
    RandomModel,
    Reduction,
    Residual,
    SelfAttention,
    SequenceHead,
    SoftmaxAttention,
    SoftmaxGate,
    SpatialHead,
    initialize_,
)

FAMILIES = ("tokens", "sequence", "image", "signal")
# Activations whose gradient is continuous (no kink), see `models_and_inputs`.
SMOOTH_ACTIVATIONS = tuple(a for a in ACTIVATIONS if a not in ("relu", "leaky_relu", "hardswish"))
SEQUENCE_LAYERS = (
    "linear",
    "layer_norm",
    "group_norm",
    "batch_norm",
    "activation",
    "residual_mlp",
    "sdpa_attention",
    "softmax_attention",
    "multihead_attention",
    "concat",
    "softmax",
    "reduction",
)
SPATIAL_LAYERS = (
    "conv",
    "batch_norm",
    "group_norm",
    "activation",
    "residual_conv",
    "concat",
    "softmax",
    "reduction",
)
# Widths stay small so that a forward and backward pass take milliseconds on CPU.
_WIDTHS = (5, 6, 8, 12, 16)
_MAX_WIDTH = 32
_SOFTMAX_SPELLINGS = ("module", "method", "function")
# A normalization over few values is ill-conditioned (two values map to ±1 whatever their
# difference): BatchNorm in train mode needs this many batch × positions values per channel (else
# the model gets GroupNorm instead), GroupNorm this many channels-per-group × positions.
_MIN_NORM_VALUES = 8


def _divisors(n: int, candidates: Sequence[int]) -> list[int]:
    return [c for c in candidates if n % c == 0]


def _group_norm(draw: st.DrawFn, channels: int, positions: int) -> nn.GroupNorm:
    groups = [g for g in _divisors(channels, (1, 2, 4)) if channels // g * positions >= _MIN_NORM_VALUES]
    return nn.GroupNorm(draw(st.sampled_from(groups or [1])), channels)


def _activation(draw: st.DrawFn, activations: Sequence[str]) -> Activation:
    return Activation(draw(st.sampled_from(tuple(activations))), draw(st.sampled_from(SPELLINGS)))


def _sequence_layer(
    draw: st.DrawFn, kind: str, width: int, tokens: int, activations: Sequence[str]
) -> tuple[nn.Module, int]:
    """One block for (batch, tokens, width) activations; returns it and its output width."""
    if kind == "linear":
        out = draw(st.sampled_from(_WIDTHS))
        return nn.Linear(width, out, bias=draw(st.booleans())), out
    if kind == "layer_norm":
        return nn.LayerNorm(width, elementwise_affine=draw(st.booleans())), width
    if kind == "group_norm":
        return ChannelsFirst(_group_norm(draw, width, tokens)), width
    if kind == "batch_norm":
        return ChannelsFirst(nn.BatchNorm1d(width)), width
    if kind == "activation":
        return _activation(draw, activations), width
    if kind == "residual_mlp":
        hidden = draw(st.sampled_from(_WIDTHS))
        body = nn.Sequential(
            nn.LayerNorm(width),
            nn.Linear(width, hidden),
            _activation(draw, activations),
            nn.Linear(hidden, width),
        )
        return Residual(body, draw(st.sampled_from(("operator", "function")))), width
    if kind == "sdpa_attention":
        heads = draw(st.sampled_from(_divisors(width, (1, 2, 4))))
        body = nn.Sequential(nn.LayerNorm(width), SelfAttention(width, heads, causal=draw(st.booleans())))
        return Residual(body), width
    if kind == "softmax_attention":
        spelling = draw(st.sampled_from(_SOFTMAX_SPELLINGS))
        return Residual(nn.Sequential(nn.LayerNorm(width), SoftmaxAttention(width, spelling))), width
    if kind == "multihead_attention":
        heads = draw(st.sampled_from(_divisors(width, (1, 2))))
        return Residual(nn.Sequential(nn.LayerNorm(width), MultiheadSelfAttention(width, heads))), width
    if kind == "concat":
        extra = draw(st.sampled_from(_WIDTHS))
        return Concat(
            nn.Sequential(nn.Linear(width, extra), _activation(draw, activations)), dim=-1
        ), width + extra
    if kind == "softmax":
        return SoftmaxGate(-1, draw(st.sampled_from(_SOFTMAX_SPELLINGS))), width
    if kind == "reduction":
        return Reduction(draw(st.sampled_from(("mean", "sum"))), (draw(st.sampled_from((1, -1))),)), width
    raise ValueError(f"unknown sequence layer {kind!r}; use one of {SEQUENCE_LAYERS}")


def _spatial_layer(
    draw: st.DrawFn,
    kind: str,
    channels: int,
    spatial_shape: tuple[int, ...],
    batch_norm_ok: bool,
    activations: Sequence[str],
) -> tuple[nn.Module, int]:
    """One block for (batch, channels, *spatial) activations; returns it and its output channels."""
    spatial_dims = len(spatial_shape)
    conv = nn.Conv1d if spatial_dims == 1 else nn.Conv2d

    def batch_norm(channels: int) -> nn.Module:
        if not batch_norm_ok:
            return nn.GroupNorm(1, channels)
        return (nn.BatchNorm1d if spatial_dims == 1 else nn.BatchNorm2d)(channels)

    if kind == "conv":
        out = draw(st.sampled_from(_WIDTHS))
        kernel = draw(st.sampled_from((1, 3)))
        groups = draw(st.sampled_from(_divisors(channels, (1, 2)) if out % 2 == 0 else [1]))
        return conv(channels, out, kernel, padding=kernel // 2, groups=groups, bias=draw(st.booleans())), out
    if kind == "batch_norm":
        return batch_norm(channels), channels
    if kind == "group_norm":
        return _group_norm(draw, channels, math.prod(spatial_shape)), channels
    if kind == "activation":
        return _activation(draw, activations), channels
    if kind == "residual_conv":
        body = nn.Sequential(
            batch_norm(channels), _activation(draw, activations), conv(channels, channels, 3, padding=1)
        )
        return Residual(body, draw(st.sampled_from(("operator", "function")))), channels
    if kind == "concat":
        extra = draw(st.sampled_from(_WIDTHS))
        return Concat(
            nn.Sequential(conv(channels, extra, 1), _activation(draw, activations)), dim=1
        ), channels + extra
    if kind == "softmax":
        return SoftmaxGate(1, draw(st.sampled_from(_SOFTMAX_SPELLINGS))), channels
    if kind == "reduction":
        dims = tuple(range(2, 2 + spatial_dims))
        return Reduction(draw(st.sampled_from(("mean", "sum"))), dims), channels
    raise ValueError(f"unknown spatial layer {kind!r}; use one of {SPATIAL_LAYERS}")


@st.composite
def models_and_inputs(
    draw: st.DrawFn,
    max_layers: int = 4,
    *,
    families: Sequence[str] = FAMILIES,
    layers: Sequence[str] | None = None,
    activations: Sequence[str] = ACTIVATIONS,
    allow_train_mode: bool = True,
) -> tuple[nn.Module, tuple[Any, ...]]:
    """Draw ``(model, inputs)``: a random `RandomModel` and a tuple of inputs it accepts.

    ``max_layers`` bounds the number of blocks (1..max_layers) between the stem and the head;
    ``families`` restricts the input kinds (`FAMILIES`); ``layers`` restricts the block kinds
    (names from `SEQUENCE_LAYERS` and `SPATIAL_LAYERS`; e.g. leave out
    ``"multihead_attention"`` for models without opaque nodes); ``activations`` restricts the
    activation functions (`ACTIVATIONS`; `SMOOTH_ACTIVATIONS` leaves out relu, leaky_relu and
    hardswish, whose gradient jumps at a kink: there a rounding error that moves an input across
    the kink changes the gradient by O(1), so gradients of such models match FP32 only in norm
    and only as closely as the kinks allow). The model is in train mode
    (BatchNorm uses batch statistics) or eval mode, drawn unless ``allow_train_mode`` is False.
    It has no dropout, so both modes are deterministic.

        >>> strategy = models_and_inputs(max_layers=2, families=("image",))
        >>> model, (x,) = strategy.example()  # doctest: +SKIP
    """
    if max_layers < 1:
        raise ValueError(f"max_layers must be at least 1, got {max_layers}")
    unknown = set(families) - set(FAMILIES)
    if unknown or not families:
        raise ValueError(f"families must be a non-empty subset of {FAMILIES}, got {tuple(families)}")
    allowed = set(SEQUENCE_LAYERS) | set(SPATIAL_LAYERS) if layers is None else set(layers)
    if not activations or set(activations) - set(ACTIVATIONS):
        raise ValueError(f"activations must be a non-empty subset of {ACTIVATIONS}, got {tuple(activations)}")
    if unknown_layers := allowed - set(SEQUENCE_LAYERS) - set(SPATIAL_LAYERS):
        raise ValueError(
            f"unknown layers {sorted(unknown_layers)}; use names from SEQUENCE_LAYERS and SPATIAL_LAYERS"
        )

    # Module constructors draw their default init from torch's global RNG; fork it so that drawing
    # a model leaves the caller's RNG as it was (initialize_ then overwrites every value anyway).
    with torch.random.fork_rng(devices=[]):
        model, make_input = _draw_model(draw, max_layers, families, allowed, activations, allow_train_mode)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    initialize_(model, generator)
    return model, (make_input(generator),)


def _draw_model(
    draw: st.DrawFn,
    max_layers: int,
    families: Sequence[str],
    allowed: set[str],
    activations: Sequence[str],
    allow_train_mode: bool,
) -> tuple[RandomModel, Callable[[torch.Generator], torch.Tensor]]:
    """The model (its ``training`` flag drawn) and a function drawing its input from a generator."""
    family = draw(st.sampled_from(tuple(families)))
    spatial_dims = {"image": 2, "signal": 1}.get(family, 0)
    kinds = [k for k in (SPATIAL_LAYERS if spatial_dims else SEQUENCE_LAYERS) if k in allowed]
    batch = draw(st.integers(2, 3), label="batch")
    width = draw(st.sampled_from(_WIDTHS), label="width")
    stem: nn.Module
    if spatial_dims:
        in_channels = draw(st.integers(1, 4), label="in_channels")
        shape = (batch, in_channels, *(draw(st.integers(1, 5)) for _ in range(spatial_dims)))
        stem = (nn.Conv1d if spatial_dims == 1 else nn.Conv2d)(in_channels, width, 3, padding=1)

        def make_input(generator: torch.Generator) -> torch.Tensor:
            return torch.randn(shape, generator=generator)

    elif family == "tokens":
        vocab = draw(st.integers(8, 32), label="vocab")
        shape = (batch, draw(st.integers(1, 6), label="tokens"))
        stem = nn.Embedding(vocab, width)

        def make_input(generator: torch.Generator) -> torch.Tensor:
            return torch.randint(vocab, shape, generator=generator)

    else:
        in_features = draw(st.sampled_from(_WIDTHS), label="in_features")
        shape = (batch, draw(st.integers(1, 6), label="tokens"), in_features)
        stem = nn.Linear(in_features, width)

        def make_input(generator: torch.Generator) -> torch.Tensor:
            return torch.randn(shape, generator=generator)

    training = allow_train_mode and draw(st.booleans(), label="train_mode")
    values_per_channel = math.prod(shape[2:]) * batch if spatial_dims else math.prod(shape[:2])
    batch_norm_ok = not training or values_per_channel >= _MIN_NORM_VALUES
    if not batch_norm_ok:
        kinds = [k for k in kinds if k != "batch_norm"]
    blocks: list[nn.Module] = []
    depth = draw(st.integers(1, max_layers), label="depth") if kinds else 0
    previous = None
    for _ in range(depth):
        # Two activations in a row squeeze the values (sigmoid(sigmoid(x)) spans 0.62-0.73), and a
        # normalization after them would amplify their rounding error: another ill-conditioned model.
        choices = [
            k
            for k in kinds
            if (k != "concat" or width <= _MAX_WIDTH // 2) and not (k == "activation" == previous)
        ]
        if not choices:  # e.g. only concat allowed and already wide, or only activations
            break
        kind = previous = draw(st.sampled_from(choices))
        if spatial_dims:
            block, width = _spatial_layer(draw, kind, width, shape[2:], batch_norm_ok, activations)
        else:
            block, width = _sequence_layer(draw, kind, width, shape[1], activations)
        blocks.append(block)

    classes = draw(st.integers(1, 5), label="classes")
    return_features = draw(st.booleans(), label="return_features")
    head: nn.Module
    if spatial_dims:
        head = SpatialHead(width, classes, spatial_dims, return_features)
    else:
        pool = draw(st.booleans(), label="pool")
        head = SequenceHead(width, classes, pool=pool, return_features=return_features)
    return RandomModel(family, stem, blocks, head).train(training), make_input
