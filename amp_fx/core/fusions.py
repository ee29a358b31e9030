"""The fused kernels as one table: per fusion its policy switch, its pass and the ops it adds.

Code asks the table about a fusion (``lookup_fusion("fused_linear_loss").needs``), never lists
fusions itself: `amp_fx.core.policy`'s switches and their defaults, the fusion part of
`amp_fx.pipeline.PASSES` (in the table's order), the passthrough ops and op aliases of
`amp_fx.core.op_lists`, the preset rules, the static dtype rules of `propagate_dtypes` and
`amp_fx.report`'s policy summary are views of this one.

    >>> lookup_fusion("fused_linear_loss").needs, lookup_fusion("fused_linear_loss").cuda_only
    ('fused_losses', True)
    >>> [op.name for op in lookup_fusion("fused_activations").ops]
    ['fp32_activation', 'fp32_gated_activation']
    >>> FUSED_OPS["fp32_cross_entropy"].same_as
    'cross_entropy_loss'

To add a fusion: its kernel family (``kernels/<family>/``), its op module (``amp_fx/ops/<module>.py``),
its pass (``passes/<pass>.py``), a row in `FUSIONS` and the `Policy` field its flag names;
docs/DESIGN.md ("Adding a fusion") lists the tests and the benchmark that go with them.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "FUSED_OPS",
    "FUSIONS",
    "FUSION_TABLE",
    "FusedOp",
    "Fusion",
    "OutputDtype",
    "lookup_fusion",
]


class OutputDtype(enum.Enum):
    """How a fused op's output dtype follows from its call (`propagate_dtypes`' static rules)."""

    # The dtype its ``out_dtype=`` keyword names.
    OUT_DTYPE = "out_dtype"
    # A pair: the sum of its first two arguments (input + residual) in their promoted dtype, and
    # the dtype its ``out_dtype=`` keyword names.
    SUM_AND_OUT_DTYPE = "sum_and_out_dtype"
    # As a pointwise op's: the dtype its ``dtype=`` keyword names, else its tensor arguments'
    # promoted dtype (the static rules' default, for any op they know nothing else about).
    PROMOTED = "promoted"


@dataclass(frozen=True)
class FusedOp:
    """An op name a fusion adds to the policy's vocabulary: the name of a function its pass puts in
    graphs (what `normalize_ops` names the call when a converted graph is converted again)."""

    name: str
    # Another spelling of this op (`amp_fx.core.op_lists.OP_ALIASES`), decided and typed as it.
    # None: an op of its own, dtype-agnostic (it reads what flows in and computes in float32), so
    # PASSTHROUGH (`op_lists.PASSTHROUGH_OPS`), its output typed as `output` says.
    same_as: str | None = None
    output: OutputDtype | None = None

    def __post_init__(self) -> None:
        if (self.same_as is None) == (self.output is None):
            raise ValueError(
                f"fused op {self.name!r}: give same_as (the op it is a spelling of) or output (how an "
                "op of its own types its output), not both or neither"
            )


@dataclass(frozen=True)
class Fusion:
    """One fused kernel: the switch that turns it on, the pass that puts it in graphs, its ops."""

    # The `Policy` field that turns it on (a `preset` keyword): True/False, None for its default.
    flag: str
    # The pass that puts its calls in graphs: the function of module ``amp_fx.passes.<pass_name>``.
    pass_name: str
    # What it fuses, for the `Policy` documentation.
    description: str
    # ``amp_fx/ops/<ops_module>.py``: the functions or modules its pass puts in graphs.
    ops_module: str
    # ``kernels/<kernel_family>/``: its Triton kernels and their torch reference; None where the
    # op module computes in torch alone.
    kernel_family: str | None
    # The op names it adds (none where its calls keep the name of the op they replace).
    ops: tuple[FusedOp, ...] = ()
    # Its kernels are for GPUs: on by default on CUDA only (elsewhere they would run their
    # pure-torch references, slower than torch). Else on by default on every device.
    cuda_only: bool = False
    # The flag it only acts after (its pass matches what that flag's pass wrote), or None.
    needs: str | None = None

    @property
    def op_names(self) -> tuple[str, ...]:
        """The names of `ops`, in order."""
        return tuple(op.name for op in self.ops)


# In the order their passes run (after the casts are decided); a flag's `needs` comes before it.
# Each is on by default where the opt level fuses kernels (`OptLevel.fuses_kernels`: O2).
FUSIONS: tuple[Fusion, ...] = (
    Fusion(
        flag="fused_norms",
        pass_name="fuse_norms",
        description=(
            "RMSNorm / LayerNorm chains, with the residual add before them, run as one call "
            "(`amp_fx.ops.norms`: fp32 math, low-precision reads and writes)."
        ),
        ops_module="norms",
        kernel_family="norms",
        ops=(
            FusedOp("rms_norm_fp32", output=OutputDtype.OUT_DTYPE),
            FusedOp("layer_norm_fp32", output=OutputDtype.OUT_DTYPE),
            FusedOp("add_rms_norm_fp32", output=OutputDtype.SUM_AND_OUT_DTYPE),
            FusedOp("add_layer_norm_fp32", output=OutputDtype.SUM_AND_OUT_DTYPE),
        ),
    ),
    Fusion(
        flag="fused_activations",
        pass_name="fuse_activations",
        description=(
            "``silu(gate) * up``, ``gelu(gate) * up`` and a tanh GELU written out in torch ops "
            "(``gelu_new``), from low-precision inputs to their output and the casts around them, run "
            "as one call (`amp_fx.ops.activations`: fp32 math, one rounding, the activation recomputed "
            "in the backward); on a CPU an eager call computes the torch expression."
        ),
        ops_module="activations",
        kernel_family="activations",
        ops=(
            FusedOp("fp32_activation", output=OutputDtype.PROMOTED),
            FusedOp("fp32_gated_activation", output=OutputDtype.PROMOTED),
        ),
    ),
    Fusion(
        flag="fused_rotary",
        pass_name="fuse_rotary",
        description=(
            "rotary position embeddings (``q * cos + rotate_half(q) * sin``, interleaved or partial) "
            "run as one call reading q in its dtype, fp32 math (`amp_fx.ops.rotary.rotary_embedding`; "
            "on a CPU an eager call computes the chain)."
        ),
        ops_module="rotary",
        kernel_family="rotary",
        ops=(FusedOp("rotary_embedding", output=OutputDtype.PROMOTED),),
    ),
    Fusion(
        flag="fused_losses",
        pass_name="fuse_losses",
        description=(
            "an FP32 cross_entropy whose input is a cast of low-precision logits reads them directly "
            "(`amp_fx.ops.cross_entropy.fp32_cross_entropy`): the same fp32 math without a float32 "
            "copy of the logits. O1 leaves it off to stay bit-identical to autocast."
        ),
        ops_module="cross_entropy",
        kernel_family="cross_entropy",
        ops=(FusedOp("fp32_cross_entropy", same_as="cross_entropy_loss"),),
    ),
    Fusion(
        flag="fused_linear_loss",
        pass_name="fuse_linear_loss",
        description=(
            "an FP32 cross-entropy (``fused_losses``) whose logits come, through row-keeping views "
            "only, from a linear layer nothing else reads runs with that layer as one call "
            "(`amp_fx.ops.cross_entropy.linear_cross_entropy`: under torch.compile the gradient is "
            "computed in the loss's forward kernel and the backward is matmuls only; eagerly the two "
            "calls run as before, which measured faster there)."
        ),
        ops_module="cross_entropy",
        kernel_family="cross_entropy",
        # None: its call, linear_cross_entropy, has the name of torch's F.linear_cross_entropy,
        # an op the policy does not know.
        ops=(),
        cuda_only=True,
        needs="fused_losses",
    ),
    Fusion(
        flag="fused_chunked_linear_loss",
        pass_name="fuse_chunked_linear_loss",
        description=(
            "in a graph captured in training mode, a language model's head and its cross-entropy "
            "(Hugging Face's ``ForCausalLMLoss`` included) run chunk by chunk "
            "(`amp_fx.ops.chunked_cross_entropy.chunked_linear_cross_entropy`), never holding the "
            "[rows, V] logits; logits the model returns become None, unless ``keep_logits=True``, "
            "which leaves such heads unfused."
        ),
        ops_module="chunked_cross_entropy",
        kernel_family=None,
        ops=(FusedOp("chunked_linear_cross_entropy", same_as="cross_entropy_loss"),),
    ),
    Fusion(
        flag="fused_batch_norm",
        pass_name="fuse_batch_norm",
        description=(
            "BatchNorm2d followed by ReLU (or by a residual add and ReLU) runs as one call "
            "(`amp_fx.ops.batch_norm.FusedBatchNormAct`) when its input is large."
        ),
        ops_module="batch_norm",
        kernel_family="batch_norm",
        # None: its module declares the op it computes, batch_norm (`amp_fx_op`).
        ops=(),
        cuda_only=True,
    ),
    Fusion(
        flag="fused_max_pool",
        pass_name="replace_max_pool",
        description=(
            "large 2-D max-pools run through `amp_fx.ops.max_pool.max_pool2d` (1-byte argmax "
            "offsets, a one-pass gather backward)."
        ),
        ops_module="max_pool",
        kernel_family="max_pool",
        # None: its function has the name of the op it replaces, max_pool2d.
        ops=(),
        cuda_only=True,
    ),
)

# flag -> its row, in the order the passes run.
FUSION_TABLE = MappingProxyType({fusion.flag: fusion for fusion in FUSIONS})
# name -> the fused op of that name, over every row.
FUSED_OPS = MappingProxyType({op.name: op for fusion in FUSIONS for op in fusion.ops})


def lookup_fusion(flag: str) -> Fusion:
    """The table's row for the switch `flag`; raises naming the switches for an unknown one.

    >>> lookup_fusion("fused_max_pool").pass_name
    'replace_max_pool'
    """
    if flag in FUSION_TABLE:
        return FUSION_TABLE[flag]
    close = difflib.get_close_matches(str(flag), FUSION_TABLE, n=1)
    suggestion = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"no fusion has the flag {flag!r}{suggestion} The flags are {', '.join(FUSION_TABLE)}")
