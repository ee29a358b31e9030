"""A deep copy of a model, also of one that caches computed tensors: for the two front ends,
which convert a copy and never the user's model."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["copy_model"]


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, also for a model that caches computed tensors in plain attributes.

    torch refuses to deep-copy a tensor that is not a graph leaf; eval-mode caches hold such
    tensors (timm's LeViT keeps its attention biases in a dict after a forward). Each is copied
    as a detached clone, which is what a cache of computed values is.

    >>> class Cached(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.w = nn.Parameter(torch.ones(2))
    ...         self.cache = {"w2": self.w * 2}
    >>> copy_model(Cached()).cache["w2"]
    tensor([2., 2.])
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in module.__dict__.values():
            for leaf in _tensors_in(value):
                if leaf.grad_fn is not None and id(leaf) not in memo:
                    memo[id(leaf)] = leaf.detach().clone()
    return copy.deepcopy(model, memo)


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
