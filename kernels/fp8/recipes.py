"""FP8 recipes: which of a linear layer's three products run in FP8, in which formats, with which
scaling.

A linear layer ``y = x @ w.T (+ b)`` (x (T, K) tokens by features in, w (N, K)) runs three
matrix products, each summing over a different dimension, so each scales its operands along that
dimension (``amp_fx.kernels.fp8`` has the quantiser)::

    product       first operand           second operand     sums over   writes
    output        x       (T, K)          w.T    (K, N)      K           y in x's dtype
    grad_input    grad_y  (T, N)          w      (N, K)      N           grad_x in x's dtype
    grad_weight   grad_y.T (N, T)         x      (T, K)      T (tokens)  grad_w in w's dtype

Rowwise scaling therefore quantises w twice (per output row along K for the output, per column
along N for the input gradient), and grad_y and x along tokens for the weight gradient: per-row
scales of one product are not the scales another product needs. Per-tensor scales are the same
along every axis.

The recipes (torchao's three, with its formats):

- ``tensorwise``: one scale per tensor; x and w e4m3, grad_y e5m2 (gradients need range more than
  precision, and one scale must cover a whole tensor's); scales exactly FP8_MAX / amax.
- ``rowwise``: one scale per row of the first operand and per column of the second; every operand
  e4m3 (the per-row scales give the range); scales rounded down to powers of 2, as torchao does:
  ``t * scale`` and ``data * (1 / scale)`` are then exact in fp32, so quantising rounds once (to
  fp8) and dequantising not at all, at the cost of at most one binade of the format's range (a
  group's amax lands in [FP8_MAX / 2, FP8_MAX]).
- ``rowwise_hp_wgrad``: ``rowwise`` for the output and input gradient; the weight gradient, whose
  sum over every token is the longest and feeds the optimizer directly, in the high dtype (torchao's
  ``rowwise_with_gw_hp``).

Example:
    >>> RECIPES["rowwise_hp_wgrad"].formats("grad_weight") is None
    True
    >>> RECIPES["tensorwise"].formats("grad_input")
    (torch.float8_e5m2, torch.float8_e4m3fn)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PRODUCTS", "RECIPES", "SCALINGS", "Fp8Recipe", "recipe_named"]

# A linear layer's three matrix products, in the order they run.
PRODUCTS = ("output", "grad_input", "grad_weight")
SCALINGS = ("tensorwise", "rowwise")

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
Formats = tuple[torch.dtype, torch.dtype]


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear layer's products run: per product (`PRODUCTS`) the FP8 formats of its first
    and second operand, or None for the high dtype; one scaling for all FP8 products."""

    name: str
    scaling: str
    power_of_two_scales: bool
    output: Formats | None
    grad_input: Formats | None
    grad_weight: Formats | None

    def formats(self, product: str) -> Formats | None:
        """The (first, second) operand formats of ``product``, None when it runs in the high dtype.

        Example:
            >>> RECIPES["rowwise"].formats("output")
            (torch.float8_e4m3fn, torch.float8_e4m3fn)
        """
        if product not in PRODUCTS:
            raise ValueError(f"product {product!r} is not one of {', '.join(PRODUCTS)}")
        return getattr(self, product)


RECIPES: dict[str, Fp8Recipe] = {
    recipe.name: recipe
    for recipe in (
        Fp8Recipe("tensorwise", "tensorwise", False, (_E4M3, _E4M3), (_E5M2, _E4M3), (_E5M2, _E4M3)),
        Fp8Recipe("rowwise", "rowwise", True, (_E4M3, _E4M3), (_E4M3, _E4M3), (_E4M3, _E4M3)),
        Fp8Recipe("rowwise_hp_wgrad", "rowwise", True, (_E4M3, _E4M3), (_E4M3, _E4M3), None),
    )
}


def recipe_named(name: object) -> Fp8Recipe:
    """The recipe called ``name``; a ValueError naming the recipes for any other name.

    Example:
        >>> recipe_named("rowwise").scaling
        'rowwise'
    """
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"FP8 recipe {name!r} is not one of {', '.join(RECIPES)}; pick one of those names")
    return RECIPES[name]
