"""The residual add fuses into the norm after it when the residual stream is a raw model input.

At O2 a floating input is cast at its first lowered reader, not at the entry, so a residual
stream that starts as the model's input (a time-series or point-cloud transformer with no
embedding table) is FP32, and the torch.fx front end without example inputs only assumes it is.
The fused add+norm reads its operands as they are and sums them in their promoted dtype at run
time, as the add did, so the assumption need not hold: the chain fuses, and the model matches
autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_fx
from amp_fx.testing import assert_equivalent

BF16 = torch.bfloat16


class InputStream(nn.Module):
    """Blocks whose residual stream starts as the raw input ``x`` (pre-norm, no embedding)."""

    def __init__(self, norm: type[nn.Module], width: int = 8) -> None:
        super().__init__()
        self.norms = nn.ModuleList([norm(width), norm(width)])
        self.mlp = nn.Sequential(nn.Linear(width, 16), nn.GELU(), nn.Linear(16, width))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        h = x + self.mlp(self.norms[0](x))  # the add reads the raw input
        return self.head(self.norms[1](h))


def _fused_names(model: nn.Module) -> list[str]:
    return [
        n.target.__name__
        for n in model.graph.nodes
        if n.op == "call_function" and getattr(n.target, "__name__", "").endswith("norm_fp32")
    ]


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_a_raw_input_residual_fuses_into_the_norm_after_it(norm) -> None:
    torch.manual_seed(0)
    model, x = InputStream(norm), 5 + 0.1 * torch.randn(2, 3, 8)  # carries an offset
    converted = amp_fx.convert(copy.deepcopy(model), "O2", dtype=BF16, device_type="cpu", front_end="fx")
    name = "layer_norm_fp32" if norm is nn.LayerNorm else "rms_norm_fp32"
    assert _fused_names(converted) == [name, f"add_{name}"]
    out = converted(x)
    assert type(out) is torch.Tensor and out.dtype == torch.float32
    assert_equivalent(model, converted, (x,))
