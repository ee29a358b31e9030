"""FP8 linear layers: `fp8_linear`, ``F.linear`` with its three matrix products in float8.

A linear layer runs three products: the output ``y = x @ w.T (+ b)``, the input gradient
``grad_x = grad_y @ w`` and the weight gradient ``grad_w = grad_y.T @ x``. A recipe
(``amp_fx.kernels.fp8.recipes``: ``"tensorwise"``, ``"rowwise"``, ``"rowwise_hp_wgrad"``) says
which run in FP8, in which formats and with which scaling; each FP8 product quantises its two
operands along the dimension it sums over (K, N and the tokens), with dynamic scales from their
current amax, and multiplies them with ``torch._scaled_mm`` (``amp_fx.kernels.fp8``, which has
the math). The others run in the high dtype, as ``F.linear`` would.

The three products are one op, ``amp_fx::fp8_linear``, a ``torch.library`` custom op whose
autograd formula runs the two gradient products: it works eagerly, under ``torch.compile`` (the
backward is traced as torch ops, which Inductor fuses) and in ``torch.export`` graphs as one node;
eager calls skip the custom op's dispatch (`amp_fx.ops.dispatch.fused_op`).
The forward saves the high-precision x and w, as ``F.linear`` does, and the backward quantises
them again along the axes its products need.

Every call is checked against CUDA's rules for an FP8 product before anything runs, on every
device (`fp8_linear_refusals`): the CPU's ``torch._scaled_mm`` accepts shapes and dtypes that a
GPU refuses, so a model that passes its CPU tests also runs on an H100. Non-finite values are not
hidden: an inf or NaN in x, w or grad_y makes the outputs that read it NaN (a plain cast to e4m3
would clamp an inf to 448), with no host synchronization.

    >>> x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    >>> y = fp8_linear(x, w, recipe="rowwise")
    >>> y.shape, y.dtype
    (torch.Size([2, 16, 64]), torch.bfloat16)
    >>> y.sum().backward(); x.grad.dtype, w.grad.shape
    (torch.bfloat16, torch.Size([64, 32]))
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from amp_fx.kernels.fp8.arguments import fp8_product_refusal
from amp_fx.kernels.fp8.recipes import PRODUCTS, Fp8Recipe, recipe_named
from amp_fx.ops.dispatch import fused_op
from amp_fx.ops.outputs import reshaped_output

__all__ = ["fp8_linear", "fp8_linear_or_linear", "fp8_linear_refusals", "fp8_linear_unchecked"]

_HIGH_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Each product as the layer's tensors make it, for the refusals.
_PRODUCT_TERMS = {
    "output": "input @ weight.T",
    "grad_input": "grad_output @ weight",
    "grad_weight": "grad_output.T @ input",
}


def _product_shape(product: str, tokens: int, in_features: int, out_features: int) -> tuple[int, int, int]:
    """The (m, k, n) of ``product``'s (m, k) @ (k, n) for a layer of these sizes."""
    return {
        "output": (tokens, in_features, out_features),
        "grad_input": (tokens, out_features, in_features),
        "grad_weight": (out_features, tokens, in_features),
    }[product]


def fp8_linear_refusals(
    tokens: int,
    in_features: int,
    out_features: int,
    dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    recipe: str,
) -> dict[str, str | None]:
    """Per product of a linear layer (``"output"``, ``"grad_input"``, ``"grad_weight"``), why
    CUDA's FP8 product refuses it under ``recipe``, with the fix; None where it runs (in FP8, or in
    the high dtype as the recipe says). Shapes and dtypes only: a policy can ask before any tensor
    exists. ``tokens`` is the input's rows (its leading dimensions' product).

    Example:
        >>> refusals = fp8_linear_refusals(24, 64, 64, torch.bfloat16, None, "rowwise")
        >>> refusals["output"] is None, refusals["grad_weight"][:57]
        (True, 'grad_output.T @ input (64 x 24 @ 24 x 64) in FP8: K = 24,')
    """
    fp8_recipe = recipe_named(recipe)
    refusals: dict[str, str | None] = {}
    for product in PRODUCTS:
        formats = fp8_recipe.formats(product)
        if formats is None:
            refusals[product] = None
            continue
        m, k, n = _product_shape(product, tokens, in_features, out_features)
        refusal = fp8_product_refusal(
            m, k, n, *formats, fp8_recipe.scaling, dtype, bias_dtype if product == "output" else None
        )
        if refusal is not None:
            refusal = f"{_PRODUCT_TERMS[product]} ({m} x {k} @ {k} x {n}) in FP8: {refusal}"
            if product == "grad_weight" and k % 16:
                refusal += (
                    " (the sum is over the tokens; recipe 'rowwise_hp_wgrad' runs it in the high dtype)"
                )
        refusals[product] = refusal
    return refusals


def _products_run(input: Tensor, weight: Tensor) -> dict[str, bool]:
    """Which products a call runs: the gradients only where autograd will ask for them."""
    grad = torch.is_grad_enabled()
    return {
        "output": True,
        "grad_input": grad and input.requires_grad,
        "grad_weight": grad and weight.requires_grad,
    }


def _check_arguments(input: Tensor, weight: Tensor, bias: Tensor | None, recipe: str) -> None:
    """Refuse what F.linear refuses, and what CUDA's FP8 product would refuse in any product this
    call runs (the gradients' only where autograd will ask for them)."""
    for name, tensor in (("input", input), ("weight", weight)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if weight.dim() != 2 or input.dim() < 1 or input.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"input {tuple(input.shape)} and weight {tuple(weight.shape)} do not make a linear layer: the "
            "weight must be (out_features, in_features) with in_features the input's last size"
        )
    if input.numel() == 0:
        raise ValueError(f"input {tuple(input.shape)} has no elements; an FP8 product needs at least one row")
    if input.dtype != weight.dtype or input.dtype not in _HIGH_DTYPES:
        raise ValueError(
            f"input is {input.dtype} and weight {weight.dtype}; fp8_linear takes one of float16, bfloat16, "
            "float32 for both (cast the weight to the input's dtype, as O2's low copies are)"
        )
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be None or a ({weight.shape[0]},) tensor, got {bias!r:.80}")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.device != input.device:
            raise ValueError(f"{name} is on {tensor.device} but input on {input.device}; move it with .to()")
    tokens = input.numel() // input.shape[-1]
    refusals = fp8_linear_refusals(
        tokens, weight.shape[1], weight.shape[0], input.dtype, None if bias is None else bias.dtype, recipe
    )
    runs = _products_run(input, weight)
    for product in PRODUCTS:
        if runs[product] and refusals[product] is not None:
            raise ValueError(f"fp8_linear with recipe {recipe!r} cannot run {refusals[product]}")


# ---- the products -----------------------------------------------------------------------------


def _kernels(tensor: Tensor) -> ModuleType:
    # Imported on first use: importing amp_fx must not load Triton.
    from amp_fx.kernels import implementation_for

    return implementation_for([tensor])


def _product(
    a: Tensor, b: Tensor, product: str, recipe: Fp8Recipe, out_dtype: torch.dtype, bias: Tensor | None = None
) -> Tensor:
    """``a @ b (+ bias)`` for (M, K) ``a`` and (K, N) ``b`` (any layouts): in FP8 as ``recipe``
    says for ``product``, each operand scaled along K (per row of a and per column of b, or per
    tensor), or in the high dtype."""
    formats = recipe.formats(product)
    if formats is None:
        return a @ b if bias is None else torch.addmm(bias, a, b)
    kernels = _kernels(a)
    rowwise = recipe.scaling == "rowwise"
    options = {"power_of_two": recipe.power_of_two_scales}
    a_data, a_scale = kernels.fp8_quantize(a, formats[0], along=1 if rowwise else None, **options)
    b_data, b_scale = kernels.fp8_quantize(
        b, formats[1], along=0 if rowwise else None, column_major=True, **options
    )
    return kernels.fp8_scaled_mm(a_data, b_data, a_scale, b_scale, bias=bias, out_dtype=out_dtype)


def _rows(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


@fused_op("amp_fx::fp8_linear")
def fp8_linear_unchecked(input: Tensor, weight: Tensor, bias: Tensor | None, recipe: str) -> Tensor:
    """``F.linear(input, weight, bias)`` with the output product as ``recipe`` says, the custom op
    `fp8_linear` calls after its checks (a call that breaks CUDA's rules runs on the CPU here and
    fails on a GPU); its autograd runs the two gradient products likewise."""
    out = _product(_rows(input), weight.t(), "output", recipe_named(recipe), input.dtype, bias)
    return reshaped_output(out, (*input.shape[:-1], weight.shape[0]))


@fp8_linear_unchecked.register_fake
def _fp8_linear_fake(input: Tensor, weight: Tensor, bias: Tensor | None, recipe: str) -> Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs: tuple, output: Tensor) -> None:
    input, weight, bias, recipe = inputs
    ctx.save_for_backward(input, weight)
    ctx.recipe = recipe_named(recipe)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
    input, weight = ctx.saved_tensors
    needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    grad_rows, input_rows = _rows(grad_output), _rows(input)
    grad_input = grad_weight = grad_bias = None
    if needs_input:
        grad_input = _product(grad_rows, weight, "grad_input", ctx.recipe, input.dtype).view(input.shape)
    if needs_weight:
        grad_weight = _product(grad_rows.t(), input_rows, "grad_weight", ctx.recipe, weight.dtype)
    if needs_bias and ctx.has_bias:
        grad_bias = grad_rows.sum(0)
    return grad_input, grad_weight, grad_bias, None


fp8_linear_unchecked.register_autograd(_backward, setup_context=_setup_context)


# ---- what converted graphs call ---------------------------------------------------------------


def fp8_linear(
    input: Tensor, weight: Tensor, bias: Tensor | None = None, *, recipe: str = "rowwise"
) -> Tensor:
    """``F.linear(input, weight, bias)`` with its output, input-gradient and weight-gradient
    products in FP8 as ``recipe`` says (``"tensorwise"``, ``"rowwise"`` or ``"rowwise_hp_wgrad"``;
    ``amp_fx.kernels.fp8.recipes``). Output and input gradient in input's dtype, weight gradient in
    weight's, bias gradient in bias's.

    input (..., K) and weight (N, K) share one dtype (float16, bfloat16 or float32); K and N are
    multiples of 16, and so are the tokens (input's rows) when the weight gradient runs in FP8; a
    bias has the output's dtype (none with float32 output). A ValueError names the rule broken and
    the fix, on every device.

    Example:
        >>> x = torch.randn(16, 32, dtype=torch.bfloat16)
        >>> w = torch.randn(48, 32, dtype=torch.bfloat16)
        >>> y = fp8_linear(x, w, torch.zeros(48, dtype=torch.bfloat16), recipe="tensorwise")
        >>> exact = torch.nn.functional.linear(x.float(), w.float())
        >>> bool(((y.float() - exact).norm() / exact.norm()) < 0.1)
        True
    """
    _check_arguments(input, weight, bias, recipe)
    return fp8_linear_unchecked(input, weight, bias, recipe)


def fp8_linear_or_linear(
    input: Tensor, weight: Tensor, bias: Tensor | None = None, *, recipe: str = "rowwise"
) -> Tensor:
    """`fp8_linear`, or ``F.linear`` for a call whose token count CUDA's FP8 product refuses: what
    `amp_fx.passes.use_fp8_linears` puts in graphs. The pass checks the layer's sizes when it
    converts; the tokens (input's rows, the sum of the weight-gradient product) are known only
    per call, and a ragged batch (tokens not a multiple of 16) must not stop a training step, so
    such a call runs its three products in the high dtype instead. Shapes only: no host sync.

    Example:
        >>> w = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
        >>> x = torch.randn(5, 32, dtype=torch.bfloat16)  # 5 tokens: the weight gradient refused
        >>> torch.equal(fp8_linear_or_linear(x, w), torch.nn.functional.linear(x, w))
        True
    """
    tokens = input.numel() // input.shape[-1] if input.dim() else 0
    refusals = fp8_linear_refusals(
        tokens, weight.shape[1], weight.shape[0], input.dtype, None if bias is None else bias.dtype, recipe
    )
    runs = _products_run(input, weight)
    if tokens == 0 or any(runs[product] and refusals[product] for product in PRODUCTS):
        return torch.nn.functional.linear(input, weight, bias)
    return fp8_linear(input, weight, bias, recipe=recipe)
