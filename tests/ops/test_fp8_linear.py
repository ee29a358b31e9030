"""`amp_fx.ops.fp8_linear`: the three products of a linear layer in FP8, per recipe.

- against a dequantise-then-FP32 autograd reference: each product's operands quantised with the
  recipe's formats along the axis that product sums over, dequantised to float32, and run through
  torch's ``F.linear`` with autograd; the op must match it to within float32 summation (on CUDA,
  the FP8 tensor cores' for the FP8 products) and one rounding to the output dtype
  (`product_tolerance`);
- against float64 on the unquantised values, within the bound the formats' rounding gives
  (`operand_error`, `quantised_product_error`);
- hypothesis over shapes (multiples of 16 up to 64), magnitudes, all-zero rows and tensors, and
  values far beyond the formats' range; inf and NaN in each input, forward and backward; CUDA's
  rules refused up front on the CPU; torch.compile and torch.export, one case per recipe; on a GPU
  (marked `gpu`) the CUDA results against the CPU reference, one case per recipe, and on the CPU
  that case with CUDA's FP8 sums emulated, to check that bound where no GPU runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from amp_fx.kernels import reference
from amp_fx.kernels.fp8.recipes import PRODUCTS, RECIPES, Fp8Recipe
from amp_fx.ops.fp8_linear import fp8_linear, fp8_linear_refusals, fp8_linear_unchecked
from tests.kernels.test_fp8_scaled_mm import (
    emulated_cuda_scaled_mm,
    operand_error,
    product_tolerance,
    quantised_product_error,
    tensor_core_magnitudes,
)
from tests.ops.dynamo_graphs import calls_amp_fx_ops, compile_keeping_graphs

SIZES = [16, 32, 48, 64]
RECIPE_NAMES = list(RECIPES)


# ---- the references -------------------------------------------------------------------------------


def _along(recipe: Fp8Recipe, operand: str) -> int | None:
    """The axis a scale is constant over, for a product's "first" (per row) or "second" (per
    column) operand: each is scaled along the dimension the product sums over."""
    if recipe.scaling == "tensorwise":
        return None
    return 1 if operand == "first" else 0


def _quantised(tensor: torch.Tensor, fp8_dtype, along, recipe: Fp8Recipe) -> tuple[torch.Tensor, ...]:
    """``tensor`` quantised as the op's products quantise it: (data, scale)."""
    return reference.fp8_quantize(tensor, fp8_dtype, along=along, power_of_two=recipe.power_of_two_scales)


def _counted(tensor: torch.Tensor, fp8_dtype, along, recipe: Fp8Recipe) -> torch.Tensor | None:
    """`tensor_core_magnitudes` of ``tensor`` as the op's products quantise it (None for an
    operand in the high dtype)."""
    if fp8_dtype is None:
        return None
    return tensor_core_magnitudes(*_quantised(tensor, fp8_dtype, along, recipe))


def _dequantised(tensor: torch.Tensor, fp8_dtype, along, recipe: Fp8Recipe) -> torch.Tensor:
    """``tensor`` quantised as the op's products quantise it, back in float32 (itself, in float32,
    for an operand the recipe keeps in the high dtype)."""
    if fp8_dtype is None:
        return tensor.float()
    data, scale = _quantised(tensor, fp8_dtype, along, recipe)
    return data.float() * scale


def product_operands(
    x, w, grad, recipe: Fp8Recipe, dequantise
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per product, its (first, second) operands as ``dequantise(tensor, format, along)`` gives
    them: output x @ w.T, input gradient grad @ w, weight gradient grad.T @ x (x, grad as rows)."""
    pairs = {"output": (x, w.t()), "grad_input": (grad, w), "grad_weight": (grad.t(), x)}
    operands = {}
    for product, (first, second) in pairs.items():
        formats = recipe.formats(product) or (None, None)
        operands[product] = (
            dequantise(first, formats[0], _along(recipe, "first")),
            dequantise(second, formats[1], _along(recipe, "second")),
        )
    return operands


def autograd_reference(x, w, bias, grad, recipe: Fp8Recipe) -> dict[str, torch.Tensor]:
    """The op's results by torch's linear in FP32 with autograd over dequantised operands, each
    result's term magnitudes (the sum of |terms|, for the tolerance), and each FP8 product's sum of
    `tensor_core_magnitudes` (for the bound of CUDA's sums)."""
    ops = product_operands(x, w, grad, recipe, lambda t, f, a: _dequantised(t, f, a, recipe))
    x_out, w_out_t = ops["output"]
    output = F.linear(x_out, w_out_t.t(), None if bias is None else bias.float())
    grad_out, w_in = ops["grad_input"]
    x_leaf = torch.zeros_like(x_out, requires_grad=True)  # F.linear's input gradient: grad @ weight
    (grad_input,) = torch.autograd.grad(F.linear(x_leaf, w_in), x_leaf, grad_out)
    grad_t, x_in = ops["grad_weight"]
    w_leaf = torch.zeros(w.shape, requires_grad=True)  # F.linear's weight gradient: grad.T @ input
    (grad_weight,) = torch.autograd.grad(F.linear(x_in, w_leaf), w_leaf, grad_t.t())
    results = {"output": output, "grad_input": grad_input, "grad_weight": grad_weight}
    magnitudes = {product: first.abs() @ second.abs() for product, (first, second) in ops.items()}
    if bias is not None:
        magnitudes["output"] = magnitudes["output"] + bias.float().abs()
        results["grad_bias"], magnitudes["grad_bias"] = grad.float().sum(0), grad.float().abs().sum(0)
    fp8_products = [product for product in PRODUCTS if recipe.formats(product) is not None]
    counted = product_operands(x, w, grad, recipe, lambda t, f, a: _counted(t, f, a, recipe))
    summed = {product: counted[product][0] @ counted[product][1] for product in fp8_products}
    return {"results": results, "magnitudes": magnitudes, "tensor_core_magnitudes": summed, "k": _sums(x, w)}


def _sums(x: torch.Tensor, w: torch.Tensor) -> dict[str, int]:
    """How many terms each result sums."""
    tokens, in_features = x.shape
    return {"output": in_features, "grad_input": w.shape[0], "grad_weight": tokens, "grad_bias": tokens}


def run_op(x, w, bias, grad, recipe_name: str, function=fp8_linear) -> dict[str, torch.Tensor]:
    """The op's output and gradients (as rows) for upstream gradient ``grad``."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, bias)]
    out = function(*leaves, recipe=recipe_name)
    out.backward(grad.reshape(out.shape))
    x_leaf, w_leaf, b_leaf = leaves
    results = {"output": out.reshape(-1, w.shape[0]), "grad_input": x_leaf.grad.reshape(-1, w.shape[1])}
    results["grad_weight"] = w_leaf.grad
    if b_leaf is not None:
        results["grad_bias"] = b_leaf.grad
    assert results["output"].dtype == x.dtype and results["grad_input"].dtype == x.dtype
    assert results["grad_weight"].dtype == w.dtype
    return results


def worst_excesses(results: dict, expected: dict, tensor_cores: bool) -> dict[str, float]:
    """Per result, the largest amount by which it lies beyond `product_tolerance` of the reference
    (<= 0: within), its FP8 products summed in float32 or, with ``tensor_cores``, on CUDA's."""
    excesses = {}
    for name, value in results.items():
        reference_value = expected["results"][name].to(value.device)
        magnitude = expected["magnitudes"][name].to(value.device)
        summed = expected["tensor_core_magnitudes"].get(name) if tensor_cores else None
        summed = None if summed is None else summed.to(value.device)
        bound = product_tolerance(reference_value, magnitude, expected["k"][name], value.dtype, summed)
        error = (value.detach().double() - reference_value.double()).abs()
        excesses[name] = float((error - bound).max())
    return excesses


def assert_matches_reference(results: dict, expected: dict, tensor_cores: bool = False) -> None:
    for name, excess in worst_excesses(results, expected, tensor_cores).items():
        assert excess <= 0, f"{name}: worst excess {excess:.3g}"


# ---- cases --------------------------------------------------------------------------------------


@st.composite
def linear_cases(draw):
    """(x, w, bias, grad, recipe name): tokens, in and out features multiples of 16 up to 64, the
    input 2-D or 3-D, magnitudes over many binades; some rows or whole tensors zero (amax 0), some
    elements far above the rest (values that overflow the formats once scaled by the others')."""
    recipe = draw(st.sampled_from(RECIPE_NAMES))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    tokens, k, n = (draw(st.sampled_from(SIZES)) for _ in range(3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    # Magnitudes 2^e (and outliers 2^o times more) whose inputs and products the dtype holds:
    # float16 reaches 65504 only.
    low, high, outlier = (-6, 0, 6) if dtype == torch.float16 else (-40, 40, 12)
    exponents = [draw(st.integers(low, high)) for _ in range(3)]

    def tensor(*shape, exponent):
        values = torch.randn(*shape, generator=generator, dtype=torch.float64) * 2.0**exponent
        special = draw(st.sampled_from(["none", "zero row", "zero tensor", "outlier"]))
        if special == "zero row":
            values[draw(st.integers(0, shape[0] - 1))] = 0
        elif special == "zero tensor":
            values[:] = 0
        elif special == "outlier":  # far above the rest: the rest loses range, not precision
            values[draw(st.integers(0, shape[0] - 1)), draw(st.integers(0, shape[1] - 1))] *= 2.0**outlier
        return values.to(dtype)

    x, w, grad = tensor(tokens, k, exponent=exponents[0]), tensor(n, k, exponent=exponents[1]), None
    grad = tensor(tokens, n, exponent=exponents[2])
    bias = None
    if dtype != torch.float32 and draw(st.booleans()):
        bias = torch.randn(n, generator=generator).to(dtype)
    if tokens % 32 == 0 and draw(st.booleans()):
        x = x.reshape(2, tokens // 2, k)
    return x, w, bias, grad, recipe


@given(linear_cases())
def test_products_match_the_dequantised_fp32_autograd_reference(case) -> None:
    x, w, bias, grad, recipe = case
    results = run_op(x, w, bias, grad, recipe)
    expected = autograd_reference(x.reshape(-1, w.shape[1]), w, bias, grad, RECIPES[recipe])
    assert_matches_reference(results, expected)


@given(linear_cases())
def test_products_are_within_fp8_rounding_of_float64(case) -> None:
    """Against the products of the unquantised values in float64: each operand errs by at most
    half a unit of its format (and its subnormal step at its scale), and the product by what those
    errors give, plus float32 summation and the output's rounding."""
    x, w, bias, grad, recipe = case
    results = run_op(x, w, bias, grad, recipe)
    fp8_recipe = RECIPES[recipe]
    rows = x.reshape(-1, w.shape[1])
    exact = product_operands(rows, w, grad, fp8_recipe, lambda t, f, a: t.double())
    errors = product_operands(rows, w, grad, fp8_recipe, operand_error)
    sums = _sums(rows, w)
    for product in PRODUCTS:
        (first, second), (first_error, second_error) = exact[product], errors[product]
        value = first @ second
        magnitude = (first.abs() + first_error) @ (second.abs() + second_error)
        if product == "output" and bias is not None:
            value, magnitude = value + bias.double(), magnitude + bias.double().abs()
        bound = quantised_product_error(first, second, first_error, second_error) + product_tolerance(
            value, magnitude, sums[product], results[product].dtype
        )
        error = (results[product].double() - value).abs()
        assert (error <= bound).all(), f"{product}: worst excess {(error - bound).max():.3g}"


# ---- non-finite values --------------------------------------------------------------------------


def _poisoned(tensor: torch.Tensor, value: float, where: tuple[int, int]) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[where] = value
    return tensor


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("poisoned", ["input", "weight", "grad"])
@pytest.mark.parametrize("value", [float("inf"), -float("inf"), float("nan")])
def test_non_finite_values_surface_in_every_product_that_reads_them(recipe, poisoned, value) -> None:
    """An inf or NaN that a plain cast to e4m3 would clamp to 448 comes out non-finite wherever the
    high-precision products are non-finite, forward and backward; with rowwise scales exactly
    there (the other rows and columns stay finite), with one scale per tensor in all of it."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "input": torch.randn(32, 48, generator=generator).to(torch.bfloat16),
        "weight": torch.randn(16, 48, generator=generator).to(torch.bfloat16),
        "grad": torch.randn(32, 16, generator=generator).to(torch.bfloat16),
    }
    tensors[poisoned] = _poisoned(tensors[poisoned], value, (5, 7))
    x, w, grad = tensors["input"], tensors["weight"], tensors["grad"]
    results = run_op(x, w, None, grad, recipe)
    high = run_op(x, w, None, grad, recipe, function=lambda x, w, b, recipe: F.linear(x, w, b))
    for product in PRODUCTS:
        ours, theirs = ~results[product].isfinite(), ~high[product].isfinite()
        assert (ours >= theirs).all(), f"{product} hides a non-finite value"
        formats = RECIPES[recipe].formats(product)
        if formats is None or RECIPES[recipe].scaling == "rowwise":
            assert torch.equal(ours, theirs), product
        else:
            assert ours.all() == theirs.any(), product


def test_all_zero_inputs_give_zeros_not_nan() -> None:
    """amax 0 everywhere: finite scales, zero products, forward and backward, every recipe."""
    x, w, grad = torch.zeros(16, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16), None
    grad = torch.zeros(16, 16, dtype=torch.bfloat16)
    for recipe in RECIPE_NAMES:
        for name, value in run_op(x, w, torch.zeros(16, dtype=torch.bfloat16), grad, recipe).items():
            assert torch.equal(value, torch.zeros_like(value)), (recipe, name)


def test_no_value_is_read_on_the_host() -> None:
    """Forward and backward on meta tensors, which have no values: an .item() on an amax, or any
    branch on a value, would raise."""
    for recipe in RECIPE_NAMES:
        x = torch.empty(4, 16, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(48, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
        fp8_linear(x, w, recipe=recipe).sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


# ---- CUDA's rules, up front ---------------------------------------------------------------------


def _leaf(*shape, dtype=torch.bfloat16, requires_grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


_BF16, _F16, _F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    ("arguments", "recipe", "message"),
    [
        ((_leaf(16, 24), _leaf(32, 24), None), "rowwise", "K = 24"),
        ((_leaf(16, 32), _leaf(24, 32), None), "tensorwise", "N = 24"),
        ((_leaf(24, 32), _leaf(32, 32), None), "rowwise", r"input \(32 x 24 @ 24 x 32\).*rowwise_hp_wgrad"),
        (
            (_leaf(16, 32, dtype=_F32), _leaf(32, 32, dtype=_F32), _leaf(32, dtype=_F32)),
            "tensorwise",
            "no bias",
        ),
        ((_leaf(16, 32), _leaf(32, 32), _leaf(32, dtype=_F16)), "tensorwise", "bfloat16 bias"),
        ((_leaf(16, 32), _leaf(32, 32, dtype=_F32), None), "rowwise", "one of float16, bfloat16"),
        ((_leaf(16, 32), _leaf(32, 16), None), "rowwise", "do not make a linear layer"),
        ((_leaf(0, 32), _leaf(32, 32), None), "rowwise", "no elements"),
        ((_leaf(16, 32), _leaf(32, 32), None), "blockwise", "not one of tensorwise, rowwise"),
    ],
)
def test_refuses_what_cuda_would_before_running(arguments, recipe, message) -> None:
    with pytest.raises(ValueError, match=message):
        fp8_linear(*arguments, recipe=recipe)


def test_the_token_rule_applies_only_to_a_weight_gradient_in_fp8() -> None:
    """24 tokens: the FP8 weight gradient sums over them and is refused; a frozen weight, no grad
    mode, or the recipe with the weight gradient in the high dtype run."""
    x = torch.randn(24, 32, dtype=torch.bfloat16)
    frozen = torch.randn(32, 32, dtype=torch.bfloat16)
    assert fp8_linear(x, frozen, recipe="rowwise").shape == (24, 32)
    with torch.no_grad():
        assert fp8_linear(x, frozen.requires_grad_(), recipe="rowwise").shape == (24, 32)
    fp8_linear(x, frozen, recipe="rowwise_hp_wgrad").sum().backward()
    assert frozen.grad.shape == (32, 32)
    refusals = fp8_linear_refusals(24, 32, 32, torch.bfloat16, None, "rowwise_hp_wgrad")
    assert refusals == {"output": None, "grad_input": None, "grad_weight": None}


# ---- compiled and exported ----------------------------------------------------------------------


def _compile_case():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 32, generator=generator).to(torch.bfloat16)
    w = torch.randn(48, 32, generator=generator).to(torch.bfloat16)
    bias = torch.randn(48, generator=generator).to(torch.bfloat16)
    grad = torch.randn(32, 48, generator=generator).to(torch.bfloat16)
    return x, w, bias, grad


def _layer(x, w, b, recipe):
    return fp8_linear(x, w, b, recipe=recipe)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_dynamo_traces_one_op_without_graph_breaks(recipe: str) -> None:
    """fullgraph=True: no graph break (no value read on the host); the layer is one amp_fx op."""
    x, w, bias, _ = _compile_case()
    traced, graphs = compile_keeping_graphs(_layer)
    traced(x, w, bias, recipe)
    assert len(graphs) == 1 and calls_amp_fx_ops(graphs[0])


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_products_match_the_reference(recipe: str, backend: str) -> None:
    """Compiled forward and backward (AOT autograd traces the backward's quantisation and products
    as torch ops; Inductor compiles them, about 5 s a recipe on the CPU) within the reference's
    tolerance."""
    x, w, bias, grad = _compile_case()
    torch._dynamo.reset()
    compiled = torch.compile(_layer, backend=backend, fullgraph=True)
    results = run_op(x, w, bias, grad, recipe, function=compiled)
    assert_matches_reference(results, autograd_reference(x.reshape(-1, 32), w, bias, grad, RECIPES[recipe]))


def test_opcheck() -> None:
    """The custom op's fake implementation, autograd registration and schema agree with it."""
    x, w, bias, _ = _compile_case()
    for recipe in RECIPE_NAMES:
        arguments = (x.requires_grad_(), w.requires_grad_(), bias.requires_grad_(), recipe)
        torch.library.opcheck(fp8_linear_unchecked.op, arguments)


def test_exports_as_one_node() -> None:
    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(48, 32, dtype=torch.bfloat16))

        def forward(self, x):
            return fp8_linear(x, self.weight, recipe="rowwise")

    layer, x = Layer(), torch.randn(16, 32, dtype=torch.bfloat16)
    exported = torch.export.export(layer, (x,))
    targets = [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]
    assert targets == ["amp_fx.fp8_linear.default"]
    assert torch.equal(exported.module()(x), layer(x))


# ---- on a GPU -------------------------------------------------------------------------------------


def _cuda_case() -> tuple[torch.Tensor, ...]:
    """(x, w, bias, grad) of the GPU test, with an outlier: per-row and per-tensor scales differ."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(64, 64, generator=generator).to(torch.bfloat16)
    w = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(48, generator=generator).to(torch.bfloat16)
    grad = torch.randn(64, 48, generator=generator).to(torch.bfloat16)
    x[3, 5] = 300.0
    return x, w, bias, grad


# The output's worst excess over float32's bound on an H100 (torch 2.11, the GPU suite's log).
H100_OUTPUT_EXCESS = {"tensorwise": "0.000765", "rowwise": "0.000835", "rowwise_hp_wgrad": "0.000835"}


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_the_cuda_bound_holds_for_emulated_cuda_sums_and_can_fail(recipe: str, monkeypatch) -> None:
    """The GPU test's case with CUDA's FP8 products emulated (`emulated_cuda_scaled_mm`): each FP8
    product within the bound of CUDA's sums, and beyond float32's alone (the output by what the
    H100 showed, to its 3 digits); and each out of bound with a scale 2% off."""
    x, w, bias, grad = _cuda_case()
    expected = autograd_reference(x, w, bias, grad, RECIPES[recipe])
    fp8_products = expected["tensor_core_magnitudes"]
    monkeypatch.setattr(reference, "fp8_scaled_mm", emulated_cuda_scaled_mm)
    emulated = run_op(x, w, bias, grad, recipe)
    assert_matches_reference(emulated, expected, tensor_cores=True)
    float32_excesses = worst_excesses(emulated, expected, tensor_cores=False)
    assert all(float32_excesses[product] > 0 for product in fp8_products)
    assert f"{float32_excesses['output']:.3g}" == H100_OUTPUT_EXCESS[recipe]

    def scale_two_percent_off(a, b, scale_a, scale_b, **options):
        return emulated_cuda_scaled_mm(a, b, scale_a * 1.02, scale_b, **options)

    monkeypatch.setattr(reference, "fp8_scaled_mm", scale_two_percent_off)
    wrong = worst_excesses(run_op(x, w, bias, grad, recipe), expected, tensor_cores=True)
    assert all(wrong[product] > 0 for product in fp8_products)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_cuda_matches_the_cpu_reference(recipe: str) -> None:
    """Each recipe on CUDA (cuBLAS's FP8 kernels), eager and compiled with Inductor: quantised as on
    the CPU (the same scales and data), its products within the FP8 tensor cores' sums (float32's
    for a product in the high dtype) and one rounding of the reference."""
    x, w, bias, grad = _cuda_case()
    expected = autograd_reference(x, w, bias, grad, RECIPES[recipe])
    cuda = [t.cuda() for t in (x, w, bias, grad)]
    for function in (fp8_linear, torch.compile(_layer, fullgraph=True)):
        results = run_op(*cuda, recipe, function=function)
        assert all(value.is_cuda for value in results.values())
        assert_matches_reference(results, expected, tensor_cores=True)
