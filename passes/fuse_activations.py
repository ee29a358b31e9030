"""A convert pass (O2): gated MLP activations and written-out tanh GELUs as one fp32 call.

At O2 an MLP's activation costs casts and elementwise kernels out of proportion to its math. A
gated MLP's ``silu(gate) * up`` (Llama, Mistral, Qwen) or ``gelu(gate) * up`` (Gemma's GeGLU) is
two kernels, the activation's output written and read back; a tanh GELU written out in torch ops
(Hugging Face's ``gelu_new``, GPT-2's and Phi's) is nine, with ``pow`` an FP32 island between two
casts. This pass finds those expressions by what they compute, in the graphs of both front ends
(canonical op names, `amp_fx.passes.shared.op_patterns`), and puts one call in their place:

    act(gate) * up          ->  fp32_gated_activation(gate, up, act)   (either operand order)
    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))
                            ->  fp32_activation(x, "gelu_tanh")

for act ``silu`` (``F.silu``, ``nn.SiLU``), ``gelu`` and ``gelu_tanh`` (``F.gelu`` / ``nn.GELU``,
``approximate="none"`` / ``"tanh"``), gate and up any two values (the two halves of one
projection's ``chunk`` too), and ``x**3`` as ``torch.pow(x, 3.0)``, ``x ** 3`` or ``x * x * x``;
``0.5 * x * (...)`` may also be ``x * (0.5 * (...))``, and a gated written-out tanh GELU fuses too.
The calls (`amp_fx.ops.activations`) compute in fp32 from the low-precision inputs and round once.

An expression is replaced only whole, from its inputs to its output:

- every input is a value of a known low-precision dtype (fp16/bf16), all of one dtype; amp_fx's
  casts of them that the expression read (the cast to float32 for ``pow``) go when nothing else
  reads them;
- every constant is the one written above (equal in float32), every op the one above (no in-place
  update, no extra argument, no module of another class or with hooks), and nothing outside the
  expression reads a value inside it;
- its output has the inputs' dtype, or is float32 (promoted by the island) and read, through
  reshapes only, by amp_fx's casts to the inputs' dtype alone, which go: the call's output is what
  they produced, rounded once instead of several times.

Anything else is left as it is. It runs only where ``policy.fused_activations`` (default: O2, on
every device; on a CPU an eager call computes the chain's torch expression). Each call's NodeInfo notes say
which nodes it replaced.

Example (O2, bf16; GPT-2's MLP as torch.export records it)::

    before                                          after
    view_10 = view(addmm_2, [2, 8, 128])            view_10 = view(addmm_2, [2, 8, 128])
    mul = mul(view_10, 0.5)                         fp32_activation = fp32_activation(view_10,
    view_10_to_float32 = view_10.to(float32)            'gelu_tanh')
    pow_1 = pow(view_10_to_float32, 3.0)            view_11 = view(fp32_activation, [-1, 128])
    ... (mul, add, mul, tanh, add, mul)             addmm_3 = addmm(bias, view_11, weight)
    view_11 = view(mul_3, [-1, 128])
    view_11_to_bfloat16 = view_11.to(bfloat16)
    addmm_3 = addmm(bias, view_11_to_bfloat16, weight)
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES, dtype_name
from amp_fx.core.node_info import NodeInfo, node_info
from amp_fx.core.policy import Rule
from amp_fx.ops.activations import fp32_activation, fp32_gated_activation
from amp_fx.passes.shared.cast_walk import output_readers
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.dtypes import dtype_is_assumed
from amp_fx.passes.shared.fused_calls import insert_call, replace_chain
from amp_fx.passes.shared.op_patterns import AnyOf, Const, Match, Op, Pattern, Var, match

logger = logging.getLogger(__name__)

__all__ = ["fuse_activations", "GATED_PATTERNS", "TANH_GELU_PATTERN"]


def _mul(a: Pattern, b: Pattern) -> Op:
    return Op("mul", (a, b), commutative=True)


def _add(a: Pattern, b: Pattern) -> Op:
    return Op("add", (a, b), commutative=True)


def tanh_gelu(x: Pattern) -> Pattern:
    """``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`` as torch code writes it."""
    cube = AnyOf((Op("pow", (x, Const(3.0))), _mul(_mul(x, x), x)))
    inner = _mul(Const(math.sqrt(2.0 / math.pi)), _add(x, _mul(Const(0.044715), cube)))
    one_plus_tanh = _add(Const(1.0), Op("tanh", (inner,)))
    return AnyOf(
        (
            _mul(_mul(Const(0.5), x), one_plus_tanh),  # 0.5 * x * (1 + tanh(...)), x * 0.5 * (...)
            _mul(x, _mul(Const(0.5), one_plus_tanh)),  # x * (0.5 * (1 + tanh(...)))
        )
    )


_GATE, _UP, _X = Var("gate"), Var("up"), Var("x")

# act(gate) * up, by the activation name `amp_fx.ops.activations` computes; tried first.
GATED_PATTERNS: dict[str, Pattern] = {
    "silu": _mul(Op("silu", (_GATE,)), _UP),
    "gelu": _mul(Op("gelu", (_GATE,), keywords={"approximate": "none"}), _UP),
    "gelu_tanh": _mul(AnyOf((Op("gelu", (_GATE,), keywords={"approximate": "tanh"}), tanh_gelu(_GATE))), _UP),
}
TANH_GELU_PATTERN: Pattern = tanh_gelu(_X)


def _low_dtype(found: Match) -> torch.dtype | None:
    """The inputs' one low-precision dtype, known (not assumed), or None."""
    dtypes = {node_info(node).out_dtype for node in found.inputs.values()}
    if len(dtypes) != 1 or any(dtype_is_assumed(node) for node in found.inputs.values()):
        return None
    (dtype,) = dtypes
    return dtype if dtype in LOW_PRECISION_DTYPES else None


def _output_casts(
    root: torch.fx.Node, low: torch.dtype
) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """How the expression's value leaves it: ([], []) when the root has the inputs' dtype; for a
    float32 root, (the reshapes it goes through, one after another, amp_fx's casts to ``low``
    that alone read it); else None."""
    out_dtype = node_info(root).out_dtype
    if out_dtype == low:
        return [], []
    if out_dtype != torch.float32:
        return None
    readers = output_readers(root)
    casts = list(readers.ends)
    if readers.metadata_reads or not readers.one_path or not casts:
        return None
    if not all(node_info(c).is_cast and node_info(c).out_dtype == low for c in casts):
        return None
    return list(readers.reshapes), casts


def _replace(
    gm: torch.fx.GraphModule,
    found: Match,
    activation: str,
    gated: bool,
    low: torch.dtype,
    reshapes: list[torch.fx.Node],
    casts: list[torch.fx.Node],
) -> torch.fx.Node:
    root = found.root
    inputs = (found.inputs["gate"], found.inputs["up"]) if gated else (found.inputs["x"],)
    function = fp32_gated_activation if gated else fp32_activation
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    replaced = sorted(found.nodes | set(casts), key=order.__getitem__)
    names = [node.name for node in inputs]
    expression = f"{activation}({names[0]}) * {names[1]}" if gated else f"{activation}({names[0]})"
    note = (
        f"fused: {expression} from {dtype_name(low)} as one call ({function.__name__}: float32 math, "
        f"one rounding, the activation recomputed in the backward); replaced "
        + ", ".join(node.name for node in replaced)
    )
    # The inputs' casts go with the expression where nothing else reads them.
    unread = [cast for cast in found.input_casts if set(cast.users) <= found.nodes]
    if unread:
        note += f", and {', '.join(cast.name for cast in unread)} (the inputs' casts nothing else read)"
    info = NodeInfo(
        op=function.__name__,
        rule=Rule.PASSTHROUGH,
        reason=f"fused_activations: {expression}",
        in_dtypes=tuple(low for _ in inputs),
        out_dtype=low,
        notes=[note],
    )
    value = root.meta.get("val")
    # Recorded as one call if the graph is traced again (its checks read tensor shapes).
    fused = insert_call(
        gm,
        function,
        (*inputs, activation),
        before=root,
        info=info,
        inherits=root,
        value=value.to(low) if isinstance(value, torch.Tensor) else None,
        wrapped=True,
    )
    for reshape in reshapes:  # they now reshape the call's low-precision output
        node_info(reshape).out_dtype = low
        node_info(reshape).in_dtypes = tuple(
            low if n in (root, *reshapes) else node_info(n).out_dtype for n in reshape.all_input_nodes
        )
        if isinstance(reshape.meta.get("val"), torch.Tensor):
            reshape.meta["val"] = reshape.meta["val"].to(low)
    # Each cast's readers read what it read (the call, or the last reshape), then the root's
    # readers read the call.
    values = {cast: cast.args[0] for cast in casts} | {root: fused}
    replace_chain(gm, [*found.nodes, *casts, *unread], values)
    return fused


# What each `mul` may be the root of, outermost first: (pattern, activation, gated).
_CANDIDATES: tuple[tuple[Pattern, str, bool], ...] = (
    *((pattern, name, True) for name, pattern in GATED_PATTERNS.items()),
    (TANH_GELU_PATTERN, "gelu_tanh", False),
)


def fuse_activations(gm: torch.fx.GraphModule, context: Conversion) -> PassResult:
    """Replace gated activations and written-out tanh GELUs with one fp32 call each, in
    place on `gm` (``modified``: whether it fused one).

    Example::

        >>> import math
        >>> from torch import nn
        >>> from amp_fx import convert
        >>> class GatedMLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        ...     def forward(self, x):
        ...         return self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        >>> gm = convert(GatedMLP(), "O2", dtype=torch.bfloat16)  # calls this pass
        >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and "activation" in n.name]
        ['fp32_gated_activation']
    """
    policy = context.policy
    if not policy.fused_activations:
        return PassResult(gm, False)
    fused: list[torch.fx.Node] = []
    erased: set[torch.fx.Node] = set()
    # Outermost expressions first (a gated tanh GELU before the tanh GELU inside it): the graph
    # from its end, over the nodes it had; the nodes a fusion erases come earlier, and are skipped.
    for root in reversed(list(gm.graph.nodes)):
        if root in erased or node_info(root).op != "mul":
            continue
        for pattern, activation, gated in _CANDIDATES:
            found = match(pattern, root, gm)
            low = _low_dtype(found) if found is not None else None
            outputs = _output_casts(root, low) if low is not None else None
            if found is None or low is None or outputs is None:
                continue
            erased |= found.nodes | found.input_casts
            fused.append(_replace(gm, found, activation, gated, low, *outputs))
            break
    if fused:
        gm.recompile()
    logger.debug("fuse_activations %s: %d activations fused", policy.opt_level, len(fused))
    return PassResult(gm, bool(fused))
