"""The op rules a preset starts from, per opt level, and the op data behind them.

What a level does comes from its row of `amp_fx.core.opt_levels`: a level that follows
autocast's op lists gets the device's lists (`autocast_list_rules`); a level that stores weights
low gets one op set on every device (`low_weight_rules`), with FP32 islands and FP32 norms where
its row keeps them. `Policy` and `preset` (`amp_fx.core.policy`) read `preset_op_rules`.

    >>> from amp_fx.core.opt_levels import lookup_opt_level
    >>> rules = preset_op_rules(lookup_opt_level("O2"), "cpu", keep_batchnorm_fp32=True)
    >>> rules["softmax"].rule, rules["linear"].rule, rules["batch_norm"].rule
    (<Rule.FP32: 'fp32'>, <Rule.LOWER: 'lower'>, <Rule.PASSTHROUGH: 'passthrough'>)
"""

from __future__ import annotations

from amp_fx.core.fusions import lookup_fusion
from amp_fx.core.op_lists import (
    OPAQUE_OP,
    ROUTER_OP,
    UNLISTED_MATMUL_OPS,
    AutocastOpLists,
    autocast_op_lists,
)
from amp_fx.core.opt_levels import OptLevel
from amp_fx.core.rules import OpRule, Rule

__all__ = [
    "BATCH_NORM_OPS",
    "FP32_ISLANDS",
    "LOW_PRECISION_RESIDUAL_OPS",
    "ROUTER_REASON",
    "autocast_list_rules",
    "low_weight_rules",
    "preset_op_rules",
]

# The FP32 islands (`OptLevel.keeps_fp32_islands`, O2): ops whose low-precision result is unsafe,
# at little cost (all are cheap next to the matmuls and convolutions that stay low). Apex's O2 had
# none but BatchNorm; these follow the ops autocast itself runs in fp32, minus the expensive or
# norm-like ones that work fine low.
FP32_ISLANDS: dict[str, str] = {
    "softmax": "softmax is unstable in low precision (exp overflows fp16; the normalizing sum loses bits)",
    "log_softmax": "log_softmax feeds losses; its log-sum-exp loses bits in low precision",
    "softmin": "softmin is a softmax: exp overflows fp16",
    "logsumexp": "logsumexp's exp overflows fp16 and its sum loses bits",
    "cross_entropy_loss": "losses reduce over the batch: keep them fp32 (Apex computes losses in fp32)",
    "nll_loss": "losses reduce over the batch: keep them fp32",
    "nll_loss2d": "losses reduce over the batch: keep them fp32",
    "mse_loss": "squared errors overflow fp16 and their mean loses bits",
    "l1_loss": "losses reduce over the batch: keep them fp32",
    "smooth_l1_loss": "losses reduce over the batch: keep them fp32",
    "huber_loss": "losses reduce over the batch: keep them fp32",
    "kl_div": "kl_div takes log-probabilities whose small differences vanish in low precision",
    "binary_cross_entropy": "log(p) near 0 and 1 is inaccurate in low precision",
    "binary_cross_entropy_with_logits": "log-sigmoid of large logits loses bits in low precision",
    "poisson_nll_loss": "exp of the log-rate overflows fp16",
    "ctc_loss": "log-space dynamic programming needs fp32",
    "cosine_embedding_loss": "losses reduce over the batch: keep them fp32",
    "margin_ranking_loss": "losses reduce over the batch: keep them fp32",
    "hinge_embedding_loss": "losses reduce over the batch: keep them fp32",
    "soft_margin_loss": "log(1 + exp(-x)) overflows fp16",
    "multi_margin_loss": "losses reduce over the batch: keep them fp32",
    "multilabel_margin_loss": "losses reduce over the batch: keep them fp32",
    "triplet_margin_loss": "distances square and sum: overflow in fp16",
    "exp": "exp overflows fp16 above 11.09",
    "expm1": "expm1 overflows fp16 above 11.09",
    "log": "log of small values (underflowed in fp16) gives -inf",
    "log1p": "log1p of small values loses its point in low precision",
    "log2": "log of small values (underflowed in fp16) gives -inf",
    "log10": "log of small values (underflowed in fp16) gives -inf",
    "pow": "powers overflow fp16 quickly (x**2 overflows above 256)",
    "reciprocal": "1/x overflows fp16 for |x| < 1.5e-5",
    "rsqrt": "rsqrt of a small variance overflows fp16",
    "cumsum": "running sums overflow fp16 and lose bits as they grow",
    "cumprod": "running products overflow/underflow fp16",
    "prod": "products overflow/underflow fp16",
    "sum": "sums overflow fp16 and lose bits as they grow",
    "norm": "squares of the entries overflow fp16",
    "linalg_vector_norm": "squares of the entries overflow fp16",
    "linalg_matrix_norm": "squares of the entries overflow fp16",
    "linalg_norm": "squares of the entries overflow fp16",
    "frobenius_norm": "squares of the entries overflow fp16",
    "dist": "squared differences overflow fp16",
    "cdist": "squared differences overflow fp16",
    "pdist": "squared differences overflow fp16",
    "cosine_similarity": "the norms in its denominator overflow fp16",
    "renorm": "the norms it computes overflow fp16",
}

# batch_norm under keep_batchnorm_fp32 keeps fp32 params while it runs on low-precision input
# (cuDNN and the CPU kernel take fp16/bf16 input with fp32 weight and return the input dtype), so
# it needs no casts at all. ResNet-50 has 53 BatchNorms: casts around each would cost real time.
BATCH_NORM_OPS = frozenset({"batch_norm"})
# `OptLevel.keeps_norms_fp32` (O2) keeps the activations autocast keeps in FP32: norms run in
# FP32 on FP32 params (their
# input is cast up; CUDA's layer_norm refuses fp32 params on fp16 input, so never mixed), and
# embeddings keep FP32 tables, so a transformer's residual stream stays FP32 as under autocast.
# Storing these low (Apex's O2) rounds the residual stream at every add: on small GPT-2, Llama and
# Whisper models that doubled O2's error against FP32 relative to autocast's (tests/
# test_export_front_end.py). Only the weights of the ops autocast lowers are stored low.
_FP32_PARAM_OPS: dict[str, str] = {
    "layer_norm": "norms run in FP32 with FP32 params (as under autocast)",
    "group_norm": "norms run in FP32 with FP32 params (as under autocast)",
    "rms_norm": "norms run in FP32 with FP32 params (as under autocast)",
    "embedding": "FP32 tables keep the residual stream FP32 (as under autocast)",
    "embedding_bag": "FP32 tables keep the residual stream FP32 (as under autocast)",
}

# `Policy.low_precision_residual` (opt-in, O2): these tables are stored and read in the low dtype
# instead, so a transformer's residual stream starts low and every residual add sums two low
# values, as in a model cast with ``.to(dtype)`` (docs/DESIGN.md, "Fused norms"). Norms keep their
# FP32 math and FP32 weights, the optimizer its FP32 masters.
LOW_PRECISION_RESIDUAL_OPS: dict[str, str] = {
    op: "low_precision_residual: the table is stored low, so the residual stream runs in the low "
    "dtype (as in a model cast with .to(dtype)); norms still compute in FP32"
    for op in ("embedding", "embedding_bag")
}

# Matrix products on no autocast list (`_grouped_mm`: the experts of a mixture-of-experts layer),
# which autocast therefore runs in FP32. Levels that store weights low lower them, as every MoE
# training stack (Megatron-Core, torchtitan, DeepSpeed-MoE) runs its grouped expert GEMMs in bf16 with
# FP32 accumulation: the experts are most of an MoE model's FLOPs, and kept FP32 they left O2 close
# to FP32's speed. O2's bound for these products is therefore autocast with the experts run low the
# same way (`amp_fx.testing`'s relative oracle does so by default; docs/DESIGN.md, "O2 numerics").
# Override the op to FP32 to keep autocast's numerics for the experts.
_UNLISTED_MATMULS: dict[str, str] = {
    op: "grouped matrix products (mixture-of-experts experts) run low with FP32 accumulation, as MoE "
    "training stacks run them; autocast lists none, so set_op('_grouped_mm', 'fp32') keeps its numerics"
    for op in UNLISTED_MATMUL_OPS
}

# A mixture-of-experts router's logits (`ROUTER_OP`: a matrix product whose output reaches a top-k
# through score ops only) at levels with FP32 islands: computed in FP32 with an FP32 weight, as
# Megatron-Core (``moe_router_dtype``) and torchtitan compute them. The top-k picks experts by
# comparing logits, and bf16 logits (8 bits) tie or swap near-ties, sending tokens to other experts;
# the router is hidden x n_experts, so this costs next to nothing.
ROUTER_REASON = (
    "MoE router logits: this matrix product feeds the top-k that picks experts, and bf16 logits "
    "tie or swap near-ties (other experts chosen), so it runs in FP32 with an FP32 weight, as "
    "Megatron-Core and torchtitan run routers (set_op('moe_router', 'lower') runs it as autocast does)"
)

# Ops that are matrix products in disguise: levels that store weights low lower them on every
# device, although the CPU
# autocast lists only lower them through the ops they call.
_MATMUL_COMPOSITES = frozenset({"einsum", "tensordot", "linalg_multi_dot", "chain_matmul"})

# Recurrent layers (aten lstm/gru/rnn_* with their Tensor[] states and weights): autocast runs them
# low (through _cudnn_rnn, mkldnn_rnn_layer or linear), and their kernels refuse mixed dtypes, so
# input, weights and states (zeros the module creates included) are all cast to the low dtype.
_RECURRENT_COMPOSITES = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})

# Ops whose kernels refuse floating arguments of two dtypes and that no rule of these levels casts
# otherwise (found by the probe of tests/core/test_mixed_dtype_kernels.py over every op the tables
# know): where weights are stored low and inputs are not, they promote as autocast's promote list
# does. Some are on CPU autocast's fp32 list (grid samplers, losses with a weight), which these
# levels leave to FP32 islands, none at O3; O2's islands and FP32 norms still override them.
_SAME_DTYPE_KERNELS = frozenset(
    {
        "lerp", "scatter", "scatter_add", "index_add", "index_copy", "index_put", "masked_scatter",
        "grid_sampler", "grid_sampler_2d", "grid_sampler_3d", "native_layer_norm", "nll_loss",
        "binary_cross_entropy", "embedding_bag",
    }
)  # fmt: skip

# Composites whose kernels refuse mixed dtypes and that compute matrix products inside
# (``F.multi_head_attention_forward``): an autocast island where the level runs untraced code in
# one (O2: the module form already runs so), lowered where it does not (O3).
_ISLAND_COMPOSITES = frozenset({"multi_head_attention_forward"})


def autocast_list_rules(level: OptLevel, lists: AutocastOpLists) -> dict[str, OpRule]:
    """The rules of torch.autocast's op lists for one device type, as O1 follows them.

    >>> from amp_fx.core.opt_levels import lookup_opt_level
    >>> rules = autocast_list_rules(lookup_opt_level("O1"), autocast_op_lists("cpu"))
    >>> rules["conv2d"].reason
    'autocast cpu lower_precision_fp list'
    """
    where = f"autocast {lists.device_type}"
    rules: dict[str, OpRule] = {}
    for op in lists.lower_precision_fp:
        rules[op] = OpRule(Rule.LOWER, f"{where} lower_precision_fp list")
    for op in lists.fp32:
        rules[op] = OpRule(Rule.FP32, f"{where} fp32 list")
    for op in lists.fp32_set_opt_dtype:
        rules[op] = OpRule(Rule.FP32, f"{where} fp32_set_opt_dtype list (fp32 unless the call passes dtype=)")
    for op in lists.fp32_append_dtype:
        rules[op] = OpRule(Rule.FP32, f"{where} fp32_append_dtype list (re-dispatched with dtype=float32)")
    for op in lists.promote:
        rules[op] = OpRule(Rule.PROMOTE, f"{where} promote list")
    for op in lists.banned:
        rules[op] = OpRule(
            Rule.FP32, f"{where} bans {op} (unsafe in low precision); amp_fx runs it in fp32 instead"
        )
    for op in lists.composite:
        rules[op] = OpRule(
            Rule.OPAQUE,
            f"{where}: {op} is on no list but calls listed ops; runs in an autocast island to match autocast",
        )
    rules[OPAQUE_OP] = OpRule(
        Rule.OPAQUE, f"{level.name}: untraced code runs inside torch.autocast({lists.device_type!r})"
    )
    return rules


def low_weight_rules(level: OptLevel, keep_batchnorm_fp32: bool) -> dict[str, OpRule]:
    """The rules of a level that stores weights low: one op set on every device.

    The union of both devices' lower and promote lists, since the model's weights are already
    low and these lists only decide where to cast; then the FP32 islands and FP32 norms where the
    level keeps them, and BatchNorm as `keep_batchnorm_fp32` says.

    >>> from amp_fx.core.opt_levels import lookup_opt_level
    >>> "softmax" in low_weight_rules(lookup_opt_level("O3"), keep_batchnorm_fp32=False)
    False
    """
    name = level.name
    cuda, cpu = autocast_op_lists("cuda"), autocast_op_lists("cpu")
    rules: dict[str, OpRule] = {}
    for op in cuda.promote | cpu.promote:
        rules[op] = OpRule(Rule.PROMOTE, f"{name}: {op} is on autocast's promote list")
    for op in _SAME_DTYPE_KERNELS:
        rules[op] = OpRule(Rule.PROMOTE, f"{name}: {op}'s kernel takes one floating dtype: promoted")
    for op in cuda.lower_precision_fp | cpu.lower_precision_fp:
        rules[op] = OpRule(Rule.LOWER, f"{name}: {op} is on autocast's lower_precision_fp list")
    for op in _MATMUL_COMPOSITES:
        rules[op] = OpRule(Rule.LOWER, f"{name}: {op} is a matrix product (lowered as autocast does)")
    for op, why in _UNLISTED_MATMULS.items():
        rules[op] = OpRule(Rule.LOWER, f"{name}: {why}")
    for op in _ISLAND_COMPOSITES:
        rule = Rule.OPAQUE if level.autocast_opaque else Rule.LOWER
        why = f"{name}: {op} computes matrix products and its kernel takes one dtype"
        rules[op] = OpRule(rule, f"{why} ({'autocast island' if rule is Rule.OPAQUE else 'lowered'})")
    for op in _RECURRENT_COMPOSITES:
        rules[op] = OpRule(
            Rule.LOWER, f"{name}: {op} is a recurrent layer: input, weights and states run low (as autocast)"
        )
    if level.keeps_fp32_islands:
        for op, why in FP32_ISLANDS.items():
            rules[op] = OpRule(Rule.FP32, f"{name} FP32 island: {why}")
        rules[ROUTER_OP] = OpRule(Rule.FP32, f"{name} FP32 island: {ROUTER_REASON}")
    if level.keeps_norms_fp32:
        for op, why in _FP32_PARAM_OPS.items():
            rules[op] = OpRule(Rule.FP32, f"{name}: {why}")
        for op in lookup_fusion("fused_norms").op_names:  # what fuse_norms puts in place of the above
            rules[op] = OpRule(
                Rule.PASSTHROUGH, f"{name}: fused norm, reads its inputs as they are and computes in FP32"
            )
    if level.autocast_opaque:
        rules[OPAQUE_OP] = OpRule(Rule.OPAQUE, f"{name}: untraced code runs inside an autocast island")
    else:
        rules[OPAQUE_OP] = OpRule(
            Rule.OPAQUE, f"{name}: untraced code runs on whatever flows in (no autocast)"
        )
    for op in BATCH_NORM_OPS:
        if keep_batchnorm_fp32:
            reason = f"{name} keep_batchnorm_fp32: {op} runs on low input with fp32 params, no casts"
        else:
            reason = f"{name}: {op} runs in the low dtype with low params"
        rules[op] = OpRule(Rule.PASSTHROUGH, reason)
    return rules


def preset_op_rules(level: OptLevel, device_type: str | None, keep_batchnorm_fp32: bool) -> dict[str, OpRule]:
    """A preset's op rules for `level` on `device_type` (None: not known yet).

    A level that follows autocast's op lists gets none until the device type is known (they wait
    for `Policy.for_device`); a level that lowers nothing gets none.

    >>> from amp_fx.core.opt_levels import lookup_opt_level
    >>> preset_op_rules(lookup_opt_level("O1"), None, keep_batchnorm_fp32=False)
    {}
    """
    if level.uses_autocast_op_lists:
        return {} if device_type is None else autocast_list_rules(level, autocast_op_lists(device_type))
    if level.stores_weights_low:
        return low_weight_rules(level, keep_batchnorm_fp32)
    return {}
