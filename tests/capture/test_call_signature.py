"""`call_signature(gm).matches` decides as `accepts` does (the reference) for calls whose
arguments are tensors and constants, on graphs with static and dynamic sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_fx.capture.call_signature import accepts, call_signature
from amp_fx.capture.export import export_graph


class Tagger(nn.Module):
    """Keyword arguments, an optional tensor, a constant flag and a size shared by two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, ids, mask=None, scale=None, double=False):
        out = self.embed(ids)
        if mask is not None:
            out = out * mask[..., None]
        if scale is not None:
            out = out * scale
        return out * 2 if double else out


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 16, (batch, length))


def _call(batch: int = 2, length: int = 5, **changes):
    kwargs = {"mask": torch.ones(batch, length), "double": False}
    kwargs.update(changes)
    return (_ids(batch, length),), kwargs


CALLS = {
    "as captured": _call(),
    "another length": _call(length=7),
    "another batch": _call(batch=3),
    "mask of another length": ((_ids(2, 5),), {"mask": torch.ones(2, 6), "double": False}),
    "mask in float64": _call(mask=torch.ones(2, 5, dtype=torch.float64)),
    "mask of another rank": _call(mask=torch.ones(2, 5, 1)),
    "flag changed": _call(double=True),
    "flag as an int": _call(double=0),
    "mask left out": ((_ids(2, 5),), {"double": False}),
    "mask None": _call(mask=None),
    "extra keyword": _call(scale=torch.ones(())),
    "ids as a keyword": ((), {"ids": _ids(2, 5), "mask": torch.ones(2, 5), "double": False}),
    "mask not a tensor": _call(mask=1.0),
}


@pytest.fixture(scope="module", params=[False, True], ids=["static", "dynamic"])
def graph(request):
    torch.manual_seed(0)
    model = Tagger()
    args, kwargs = _call()
    return export_graph(model, args, kwargs, dynamic=request.param)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_matches_decides_as_accepts(graph, name):
    args, kwargs = CALLS[name]
    signature = call_signature(graph)
    assert signature is not None
    assert signature.matches(args, kwargs) == accepts(graph, args, kwargs)


def test_a_container_argument_leaves_only_accepts():
    class Pair(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    gm = export_graph(Pair(), ((torch.ones(2), torch.ones(2)),), {})
    assert call_signature(gm) is None and accepts(gm, ((torch.ones(2), torch.ones(2)),), {})
