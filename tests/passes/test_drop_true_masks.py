"""drop_true_masks removes SDPA masks that are True for every size and keeps every other mask;
the attention output is unchanged (against the same graph run with the mask)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_fx.passes.drop_true_masks import SDPA, drop_true_masks


class Attention(nn.Module):
    def __init__(self, make_mask) -> None:
        super().__init__()
        self.make_mask = make_mask

    def forward(self, q: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask = self.make_mask(q, keep)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask.expand(q.shape[0], 1, -1, -1))


def _positions(q: torch.Tensor) -> torch.Tensor:
    return torch.arange(q.shape[-2], device=q.device) + 0


ALL_TRUE = {
    "arange >= 0": lambda q, keep: (_positions(q) >= 0)[None, None, None, :],
    "arange > -1": lambda q, keep: (_positions(q) > -1)[None, None, :, None],
    "new_ones & (arange >= 0)": lambda q, keep: (
        q.new_ones((), dtype=torch.bool) & (_positions(q) >= 0)[None, None, None, :]
    ),
    "(arange >= 0) | keep": lambda q, keep: ((_positions(q) >= 0)[None, :] | keep)[:, None, None, :],
}
NOT_ALL_TRUE = {
    "causal": lambda q, keep: (_positions(q)[None, :] <= _positions(q)[:, None])[None, None],
    "padding": lambda q, keep: keep[:, None, None, :],
    "arange >= 1": lambda q, keep: (_positions(q) >= 1)[None, None, None, :],
    "padding & (arange >= 0)": lambda q, keep: (keep & (_positions(q) >= 0)[None, :])[:, None, None, :],
}


def _export(make_mask):
    q, keep = torch.randn(2, 1, 5, 8), torch.tensor([[True] * 5, [True, True, False, False, True]])
    gm = torch.export.export(Attention(make_mask), (q, keep), strict=False).module()
    return gm, (q, keep)


def _mask_of(gm):
    (node,) = gm.graph.find_nodes(op="call_function", target=SDPA)
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


@pytest.mark.parametrize("name", sorted(ALL_TRUE))
def test_all_true_masks_are_dropped(name):
    gm, inputs = _export(ALL_TRUE[name])
    before = gm(*inputs)
    assert _mask_of(drop_true_masks(gm)) is None
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.arange.default)
    torch.testing.assert_close(gm(*inputs), before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(NOT_ALL_TRUE))
def test_other_masks_stay(name):
    gm, inputs = _export(NOT_ALL_TRUE[name])
    before = gm(*inputs)
    assert _mask_of(drop_true_masks(gm)) is not None
    assert torch.equal(gm(*inputs), before)
