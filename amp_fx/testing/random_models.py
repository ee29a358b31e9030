"""Building blocks of the random models that `amp_fx.testing.models_and_inputs` draws.

Each block is a small `nn.Module` whose forward uses one of the spellings a real model uses
(module, `torch.nn.functional`, `torch.*` function or tensor method), so that a converted graph
meets every spelling the passes normalize. `RandomModel` chains a stem, the blocks and a head.
Parameters are (re)initialized from a `torch.Generator` (`initialize_`) so that one integer
seed fixes the whole model, with scales chosen to keep activations O(1): fan-in scaled weights,
norm layers with affine parameters near (1, 0), BatchNorm running statistics near (0, 1).

    >>> block = Residual(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)))
    >>> block(torch.randn(2, 3, 8)).shape
    torch.Size([2, 3, 8])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = ("relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "hardswish", "elu")
SPELLINGS = ("module", "function", "method")

_ACTIVATION_MODULES = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "leaky_relu": nn.LeakyReLU,
    "hardswish": nn.Hardswish,
    "elu": nn.ELU,
}
_ACTIVATION_FUNCTIONS = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "leaky_relu": F.leaky_relu,
    "hardswish": F.hardswish,
    "elu": F.elu,
}
# Activations that exist as tensor methods (x.relu(), ...).
_ACTIVATION_METHODS = {"relu", "tanh", "sigmoid"}


class Activation(nn.Module):
    """An elementwise activation in the spelling given: ``nn.GELU()``, ``F.gelu(x)`` or ``x.tanh()``."""

    def __init__(self, kind: str, spelling: str = "module") -> None:
        super().__init__()
        if kind not in _ACTIVATION_MODULES:
            raise ValueError(f"unknown activation {kind!r}; use one of {ACTIVATIONS}")
        if spelling == "method" and kind not in _ACTIVATION_METHODS:
            spelling = "function"
        self.kind = kind
        self.spelling = spelling
        self.module = _ACTIVATION_MODULES[kind]() if spelling == "module" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.module is not None:
            return self.module(x)
        if self.spelling == "method":
            return getattr(x, self.kind)()
        return _ACTIVATION_FUNCTIONS[self.kind](x)

    def extra_repr(self) -> str:
        return f"{self.kind}, spelling={self.spelling}"


class Residual(nn.Module):
    """``x + body(x)``: a residual add, spelled with ``+`` or ``torch.add``."""

    def __init__(self, body: nn.Module, spelling: str = "operator") -> None:
        super().__init__()
        self.body = body
        self.spelling = spelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spelling == "operator":
            return x + self.body(x)
        return torch.add(x, self.body(x))


class ChannelsFirst(nn.Module):
    """Apply a channels-first module (BatchNorm1d, GroupNorm) to a (batch, tokens, features) tensor."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    """Multi-head self-attention with ``F.scaled_dot_product_attention`` on (batch, tokens, dim)."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, T, 3·D) -> (3, B, heads, T, D/heads)
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=self.causal)
        return self.proj(y.transpose(1, 2).flatten(2))


class SoftmaxAttention(nn.Module):
    """Single-head attention written out: ``softmax(q @ kᵀ · scale) @ v``, softmax in a given spelling."""

    def __init__(self, dim: int, spelling: str = "method") -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)
        self.spelling = spelling
        self.softmax = nn.Softmax(dim=-1) if spelling == "module" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-2, -1)) * self.scale
        if self.softmax is not None:
            weights = self.softmax(scores)
        elif self.spelling == "method":
            weights = scores.softmax(dim=-1)
        else:
            weights = F.softmax(scores, dim=-1)
        return weights @ self.v(x)


class MultiheadSelfAttention(nn.Module):
    """``nn.MultiheadAttention`` (an opaque leaf for amp_fx) used as self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class SoftmaxGate(nn.Module):
    """``x * (0.5 + softmax(x, dim))``; the softmax spelled ``x.softmax``, ``torch.softmax``, ``nn.Softmax``.

    A softmax used as a bounded gate rather than on its own: a bare softmax's outputs are all
    near 1/n with little spread, and a normalization layer after it would amplify that spread's
    rounding error without bound (an ill-conditioned model, not a test of the conversion); a gate
    ``x * softmax(x) * n`` would grow the largest element n-fold per layer and overflow fp16.
    """

    def __init__(self, dim: int, spelling: str = "method") -> None:
        super().__init__()
        self.dim = dim
        self.spelling = spelling
        self.softmax = nn.Softmax(dim=dim) if spelling == "module" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.softmax is not None:
            weights = self.softmax(x)
        elif self.spelling == "method":
            weights = x.softmax(self.dim)
        else:
            weights = torch.softmax(x, dim=self.dim)
        return x * (0.5 + weights)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, spelling={self.spelling}"


class Concat(nn.Module):
    """``torch.cat([branch(x), x], dim)``: the output is wider by the branch's width."""

    def __init__(self, branch: nn.Module, dim: int) -> None:
        super().__init__()
        self.branch = branch
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch(x), x], dim=self.dim)


class Reduction(nn.Module):
    """``x * sigmoid(x.mean(dims, keepdim=True))`` (or ``torch.sum``): a reduction gating x.

    A gate (as in squeeze-and-excitation) rather than ``x + x.sum(...)``: adding a sum makes the
    mean the dominant part of x, and a normalization after it subtracts that mean again, a
    cancellation that amplifies rounding error without bound.
    """

    def __init__(self, kind: str, dims: tuple[int, ...]) -> None:
        super().__init__()
        if kind not in ("mean", "sum"):
            raise ValueError(f"unknown reduction {kind!r}; use 'mean' or 'sum'")
        self.kind = kind
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mean":
            return x * torch.sigmoid(x.mean(self.dims, keepdim=True))
        return x * torch.sigmoid(torch.sum(x, dim=self.dims, keepdim=True))

    def extra_repr(self) -> str:
        return f"{self.kind}, dims={self.dims}"


class SequenceHead(nn.Module):
    """Logits from (batch, tokens, dim): per token, or after a mean over tokens."""

    def __init__(self, dim: int, classes: int, pool: bool, return_features: bool) -> None:
        super().__init__()
        self.pool = pool
        self.return_features = return_features
        self.linear = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        features = x.mean(dim=1) if self.pool else x
        logits = self.linear(features)
        return (logits, features) if self.return_features else logits


class SpatialHead(nn.Module):
    """Logits from (batch, channels, *spatial): global average pool, then a linear layer."""

    def __init__(self, channels: int, classes: int, spatial_dims: int, return_features: bool) -> None:
        super().__init__()
        self.dims = tuple(range(2, 2 + spatial_dims))
        self.return_features = return_features
        self.linear = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        features = x.mean(self.dims)
        logits = self.linear(features)
        return (logits, features) if self.return_features else logits


class RandomModel(nn.Module):
    """``head(blocks(stem(x)))``: what `models_and_inputs` builds; ``family`` names the input kind."""

    def __init__(self, family: str, stem: nn.Module, blocks: list[nn.Module], head: nn.Module) -> None:
        super().__init__()
        self.family = family
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def extra_repr(self) -> str:
        return f"family={self.family!r}"


def initialize_(model: nn.Module, generator: torch.Generator) -> nn.Module:
    """Set every parameter and buffer of ``model`` from ``generator``, in place; returns ``model``.

    Weights are uniform with variance 1/fan_in (activations keep their scale through linear
    layers), embeddings standard normal, norm scales 1 + 0.1·N(0, 1), biases 0.1·N(0, 1),
    BatchNorm running mean 0.1·N(0, 1) and running variance uniform in [0.5, 1.5].

        >>> layer = initialize_(nn.Linear(4, 2), torch.Generator().manual_seed(0))
        >>> bool(layer.weight.abs().max() <= math.sqrt(3 / 4))
        True
    """
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, nn.Embedding):
                    param.copy_(torch.randn(param.shape, generator=generator))
                elif param.ndim >= 2:
                    bound = math.sqrt(3.0 / param[0].numel())
                    param.copy_((torch.rand(param.shape, generator=generator) * 2 - 1) * bound)
                elif isinstance(module, norms) and name == "weight":
                    param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
                else:
                    param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=generator))
                module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=generator))
    return model
