"""torch.autocast's op lists as data, per device type, and the set of op names amp_fx knows.

The lists are transcribed from PyTorch's ``aten/src/ATen/autocast_mode.h`` (the ``AT_FORALL_*``
macros the CUDA backend registers) and ``aten/src/ATen/autocast_mode.cpp`` (the ``KERNEL_CPU``
registrations), for torch 2.11 and 2.14.1, and checked against the dispatcher of the installed torch
(``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")``) by
``tests/core/test_op_lists.py``. Names are *canonical op names*: the aten op name without overload and
without the in-place trailing underscore ("conv2d" covers ``aten::conv2d`` and ``aten::conv2d.padding``).

Autocast's policies, and what amp_fx does with each (see `amp_fx.core.policy`):

- ``lower_precision_fp``: floating inputs are cast to the autocast dtype (fp16/bf16).
- ``fp32``: floating inputs are cast to float32.
- ``fp32_set_opt_dtype`` (CUDA only): run with ``dtype=torch.float32`` unless the call passes a dtype
  (softmax, log_softmax, cumsum, sum, prod, ...): the output is float32.
- ``fp32_append_dtype`` (CUDA only): ``norm`` is re-dispatched with ``dtype=float32`` appended.
- ``promote``: floating inputs are cast to the widest floating input dtype.
- ``banned`` (CUDA only): autocast raises (``binary_cross_entropy``, unsafe in fp16).
- ``composite``: ops on no list whose implementation calls listed ops through the dispatcher, so
  torch.autocast changes their result although no list names them (``torch.einsum`` on CPU calls
  ``bmm``, which the CPU list lowers). amp_fx's O1 runs them inside an autocast island so that it
  matches torch.autocast exactly. These were found empirically (see the tests), not in the lists.

Example::

    >>> autocast_op_lists("cpu").category("linear")
    'lower_precision_fp'
    >>> "relu" in KNOWN_OPS
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from amp_fx.core.fusions import FUSED_OPS

logger = logging.getLogger(__name__)

DEVICE_TYPES = ("cuda", "cpu")

# The canonical op name the passes give to an untraced module/function (an opaque node).
OPAQUE_OP = "opaque"


@dataclass(frozen=True)
class AutocastOpLists:
    """torch.autocast's op lists for one device type (canonical op names)."""

    device_type: str
    lower_precision_fp: frozenset[str]
    fp32: frozenset[str]
    fp32_set_opt_dtype: frozenset[str]
    fp32_append_dtype: frozenset[str]
    promote: frozenset[str]
    banned: frozenset[str]
    composite: frozenset[str]

    # Order in which `category` looks: an op is on at most one list (checked by the tests).
    CATEGORIES = (
        "lower_precision_fp",
        "fp32",
        "fp32_set_opt_dtype",
        "fp32_append_dtype",
        "promote",
        "banned",
        "composite",
    )

    def category(self, op: str) -> str | None:
        """The name of the list `op` is on, or None (autocast leaves it alone)."""
        for name in self.CATEGORIES:
            if op in getattr(self, name):
                return name
        return None

    def all_ops(self) -> frozenset[str]:
        """Every op named on any list of this device type."""
        return frozenset().union(*(getattr(self, name) for name in self.CATEGORIES))


# ---------------------------------------------------------------------------------------------
# CUDA: AT_FORALL_LOWER_PRECISION_FP / AT_FORALL_FP32 / AT_FORALL_FP32_SET_OPT_DTYPE /
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE / AT_FORALL_PROMOTE in autocast_mode.h, plus the
# cudnn_convolution* kernels registered in autocast_mode.cpp and _cudnn_rnn (cudnn/AutocastRNN.cpp).
# ---------------------------------------------------------------------------------------------
_CUDA_LOWER_PRECISION_FP = frozenset(
    {
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "convolution",
        "cudnn_convolution",
        "cudnn_convolution_transpose",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
        "_cudnn_rnn",
    }
)

_CUDA_FP32 = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "rms_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "upsample_nearest1d",
        "_upsample_nearest_exact1d",
        "upsample_nearest2d",
        "_upsample_nearest_exact2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
        # torch 2.14 registers linalg.matrix_sqrth (an op new in 2.14) as fp32; absent in 2.11.
        "linalg_matrix_sqrth",
    }
)

_CUDA_FP32_SET_OPT_DTYPE = frozenset(
    {
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "sum",
    }
)

_CUDA_FP32_APPEND_DTYPE = frozenset({"norm"})

_CUDA_PROMOTE = frozenset(
    {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "vdot",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    }
)

_CUDA_BANNED = frozenset({"binary_cross_entropy"})

# Ops on no CUDA list whose implementation calls listed ops (found by reading their ATen/Python
# implementations): cross_entropy_loss = log_softmax (fp32_set_opt_dtype) + nll_loss (fp32);
# lstm/gru/rnn reach _cudnn_rnn; interpolate reaches the upsample_* ops; normalize and
# pairwise_distance reach norm; multi_head_attention_forward reaches linear/bmm/softmax/sdpa;
# softmin reaches softmax; linalg_norm reaches linalg_vector_norm/linalg_matrix_norm.
_CUDA_COMPOSITE = frozenset(
    {
        "cross_entropy_loss",
        "lstm",
        "gru",
        "rnn_tanh",
        "rnn_relu",
        "interpolate",
        "normalize",
        "pairwise_distance",
        "multi_head_attention_forward",
        "softmin",
        "linalg_norm",
    }
)

# ---------------------------------------------------------------------------------------------
# CPU: the TORCH_LIBRARY_IMPL(aten, AutocastCPU, m) block of autocast_mode.cpp.
# ---------------------------------------------------------------------------------------------
_CPU_LOWER_PRECISION_FP = frozenset(
    {
        "conv1d",
        "conv2d",
        "conv3d",
        "bmm",
        "mm",
        "linalg_vecdot",
        "baddbmm",
        "addmm",
        "_addmm_activation",
        "addbmm",
        "linear",
        "_convolution",
        "matmul",
        "conv_tbc",
        "mkldnn_rnn_layer",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "prelu",
        "scaled_dot_product_attention",
        "_native_multi_head_attention",
    }
)

_CPU_FP32 = frozenset(
    {
        "avg_pool3d",
        "binary_cross_entropy",
        "grid_sampler",
        "polar",
        "prod",
        "quantile",
        "nanquantile",
        "stft",
        "cdist",
        "grid_sampler_2d",
        "_grid_sampler_2d_cpu_fallback",
        "grid_sampler_3d",
        "trace",
        "view_as_complex",
        # cholesky and qr are registered by torch 2.11; torch 2.14 removed these deprecated ops.
        "cholesky",
        "cholesky_inverse",
        "cholesky_solve",
        "inverse",
        "lu_solve",
        "orgqr",
        "ormqr",
        "pinverse",
        "max_pool3d",
        "max_unpool2d",
        "max_unpool3d",
        "adaptive_avg_pool3d",
        "reflection_pad1d",
        "reflection_pad2d",
        "replication_pad1d",
        "replication_pad2d",
        "replication_pad3d",
        "mse_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "poisson_nll_loss",
        "smooth_l1_loss",
        "cross_entropy_loss",
        "l1_loss",
        "huber_loss",
        "margin_ranking_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "ctc_loss",
        "kl_div",
        "multilabel_margin_loss",
        "binary_cross_entropy_with_logits",
        "fft_fft",
        "fft_ifft",
        "fft_fft2",
        "fft_ifft2",
        "fft_fftn",
        "fft_ifftn",
        "fft_rfft",
        "fft_irfft",
        "fft_rfft2",
        "fft_irfft2",
        "fft_rfftn",
        "fft_irfftn",
        "fft_hfft",
        "fft_ihfft",
        "linalg_cond",
        "linalg_matrix_rank",
        "linalg_solve",
        "linalg_cholesky",
        "linalg_svdvals",
        "linalg_eigvals",
        "linalg_eigvalsh",
        "linalg_inv",
        "linalg_householder_product",
        "linalg_tensorinv",
        "linalg_tensorsolve",
        "fake_quantize_per_tensor_affine",
        "geqrf",
        "_lu_with_info",
        "qr",
        "svd",
        "triangular_solve",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "adaptive_max_pool3d",
        "multilabel_margin_loss_forward",
        "linalg_qr",
        "linalg_cholesky_ex",
        "linalg_svd",
        "linalg_eig",
        "linalg_eigh",
        "linalg_lstsq",
        "linalg_inv_ex",
        # torch 2.14 registers linalg.matrix_sqrth (an op new in 2.14) as fp32; absent in 2.11.
        "linalg_matrix_sqrth",
    }
)

_CPU_PROMOTE = frozenset({"stack", "cat", "index_copy"})

# Ops on no CPU list that torch.autocast("cpu") nevertheless changes, measured with torch 2.14.1:
# einsum, tensordot, linalg_multi_dot and chain_matmul reach bmm/mm; rnn_tanh/rnn_relu/lstm/gru
# reach linear/matmul or mkldnn_rnn_layer; multi_head_attention_forward reaches linear and sdpa;
# bilinear reaches a lowered matmul inside and returns fp32 with low-precision rounding.
_CPU_COMPOSITE = frozenset(
    {
        "bilinear",
        "einsum",
        "tensordot",
        "linalg_multi_dot",
        "chain_matmul",
        "lstm",
        "gru",
        "rnn_tanh",
        "rnn_relu",
        "multi_head_attention_forward",
    }
)

AUTOCAST_OP_LISTS: dict[str, AutocastOpLists] = {
    "cuda": AutocastOpLists(
        device_type="cuda",
        lower_precision_fp=_CUDA_LOWER_PRECISION_FP,
        fp32=_CUDA_FP32,
        fp32_set_opt_dtype=_CUDA_FP32_SET_OPT_DTYPE,
        fp32_append_dtype=_CUDA_FP32_APPEND_DTYPE,
        promote=_CUDA_PROMOTE,
        banned=_CUDA_BANNED,
        composite=_CUDA_COMPOSITE,
    ),
    "cpu": AutocastOpLists(
        device_type="cpu",
        lower_precision_fp=_CPU_LOWER_PRECISION_FP,
        fp32=_CPU_FP32,
        fp32_set_opt_dtype=frozenset(),
        fp32_append_dtype=frozenset(),
        promote=_CPU_PROMOTE,
        banned=frozenset(),
        composite=_CPU_COMPOSITE,
    ),
}

# ---------------------------------------------------------------------------------------------
# Dtype-agnostic ops: on no autocast list of either device, they compute in the dtype that flows in.
# Curated to cover what torch.nn, torch.nn.functional, torch and Tensor methods models use.
# ---------------------------------------------------------------------------------------------
PASSTHROUGH_OPS = frozenset(
    {
        # names normalize_ops gives to spellings with no aten op of their own
        "identity",
        "getattr",
        "positive",
        "_assert",
        "bitwise_xor",
        "bitwise_left_shift",
        "bitwise_right_shift",
        "max_unpool1d",
        "lp_pool3d",
        "gaussian_nll_loss",
        "multilabel_soft_margin_loss",
        "triplet_margin_with_distance_loss",
        # activations
        "relu",
        "relu6",
        "gelu",
        "silu",
        "mish",
        "sigmoid",
        "tanh",
        "hardswish",
        "hardsigmoid",
        "hardtanh",
        "hardshrink",
        "softshrink",
        "tanhshrink",
        "leaky_relu",
        "rrelu",
        "elu",
        "celu",
        "selu",
        "glu",
        "logsigmoid",
        "threshold",
        "softsign",
        # regularization
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        # pointwise arithmetic and math
        "add",
        "sub",
        "rsub",
        "mul",
        "div",
        "floor_divide",
        "remainder",
        "fmod",
        "neg",
        "abs",
        "sign",
        "sqrt",
        "square",
        "sin",
        "cos",
        "atan",
        "sinc",
        "erf",
        "erfc",
        "exp2",
        "logit",
        "floor",
        "ceil",
        "round",
        "trunc",
        "frac",
        "clamp",
        "clamp_min",
        "clamp_max",
        "clip",
        "lerp",
        "maximum",
        "minimum",
        "where",
        "masked_fill",
        "nan_to_num",
        "true_divide",
        "copysign",
        "hypot",
        # comparisons and logic
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_and",
        "logical_or",
        "logical_not",
        "isnan",
        "isinf",
        "isfinite",
        "bitwise_and",
        "bitwise_or",
        "bitwise_not",
        # reductions that accumulate in fp32 internally or are order statistics
        "mean",
        "max",
        "min",
        "amax",
        "amin",
        "argmax",
        "argmin",
        "std",
        "var",
        "var_mean",
        "std_mean",
        "median",
        "topk",
        "sort",
        "argsort",
        "any",
        "all",
        "count_nonzero",
        # shape, view and indexing
        "getitem",
        "setitem",
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "t",
        "contiguous",
        "chunk",
        "split",
        "split_with_sizes",
        "tensor_split",
        "unbind",
        "squeeze",
        "unsqueeze",
        "expand",
        "expand_as",
        "repeat",
        "repeat_interleave",
        "tile",
        "roll",
        "flip",
        "narrow",
        "select",
        "slice",
        "index_select",
        "gather",
        "scatter",
        "masked_select",
        "masked_scatter",
        "index_add",
        "take",
        "take_along_dim",
        "movedim",
        "swapaxes",
        "diagonal",
        "tril",
        "triu",
        "clone",
        "detach",
        "size",
        "dim",
        "numel",
        "shape",
        "pad",
        "constant_pad_nd",
        "pixel_shuffle",
        "pixel_unshuffle",
        "channel_shuffle",
        "unfold",
        "fold",
        "im2col",
        "col2im",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "rand_like",
        "randn_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "new_empty",
        "type_as",
        "to",
        "float",
        "half",
        "bfloat16",
        "type",
        # pooling (2d and 1d; the 3d variants are on the CPU fp32 list)
        "max_pool1d",
        "max_pool2d",
        "avg_pool1d",
        "avg_pool2d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "lp_pool1d",
        "lp_pool2d",
        # normalization (batch_norm and instance_norm work on low inputs with fp32 params)
        "batch_norm",
        "instance_norm",
        "local_response_norm",
        # embeddings and one-hot
        "embedding",
        "embedding_bag",
        "one_hot",
        # resampling that no list names
        "upsample",
        "affine_grid",
    }
) | frozenset(
    # amp_fx's fused ops of their own (`amp_fx.core.fusions`): they read any floating dtype and
    # compute in fp32 themselves
    name
    for name, op in FUSED_OPS.items()
    if op.same_as is None
)

# Spellings users write that are not the aten op name; `canonical_op_name` maps them.
OP_ALIASES: dict[str, str] = {
    "cross_entropy": "cross_entropy_loss",
    "nll_loss_nd": "nll_loss",  # what F.nll_loss calls (torch.export records it): nll_loss of any rank
    "grid_sample": "grid_sampler",
    "multi_dot": "linalg_multi_dot",
    "vecdot": "linalg_vecdot",
    "vector_norm": "linalg_vector_norm",
    "matrix_norm": "linalg_matrix_norm",
    "sdpa": "scaled_dot_product_attention",
    "concat": "cat",
    "concatenate": "cat",
    "absolute": "abs",
    "multiply": "mul",
    "divide": "div",
    "subtract": "sub",
    "negative": "neg",
    # amp_fx's fused ops that are another spelling of an op (`amp_fx.core.fusions`)
    **{name: op.same_as for name, op in FUSED_OPS.items() if op.same_as is not None},
}

# Matrix products on no autocast list: autocast runs them on what flows in (FP32 in an FP32 model),
# as O1 does; `amp_fx.core.preset_rules` decides them at the levels that store weights low.
UNLISTED_MATMUL_OPS = frozenset({"_grouped_mm"})

# Not an op but a role: a matrix product computing a mixture-of-experts router's logits (its
# output reaches a ``topk`` through score ops only; `amp_fx.passes.shared.decisions`). The policy
# decides it under this name, so ``set_op("moe_router", ...)`` overrides it.
ROUTER_OP = "moe_router"

KNOWN_OPS: frozenset[str] = frozenset(
    PASSTHROUGH_OPS.union(
        *(lists.all_ops() for lists in AUTOCAST_OP_LISTS.values()),
        UNLISTED_MATMUL_OPS,
        {OPAQUE_OP, ROUTER_OP},
    )
)

# Ops registered at run time by `register_op` (custom ops, ops the curated set missed).
_REGISTERED_OPS: set[str] = set()


def canonical_op_name(name: str) -> str:
    """Map a user's spelling to the canonical op name: alias table, then drop one in-place ``_``.

    >>> canonical_op_name("cross_entropy"), canonical_op_name("relu_"), canonical_op_name("linear")
    ('cross_entropy_loss', 'relu', 'linear')
    """
    if not isinstance(name, str):
        raise TypeError(f"an op name must be a str such as 'linear', got {type(name).__name__}: {name!r}")
    if name in OP_ALIASES:
        return OP_ALIASES[name]
    if name.endswith("_") and not name.endswith("__") and not name.startswith("_"):
        stripped = name[:-1]
        if is_known_op(stripped):
            return stripped
    return name


def is_known_op(name: str) -> bool:
    """True for a name in `KNOWN_OPS` or added with `register_op`."""
    return name in KNOWN_OPS or name in _REGISTERED_OPS


def known_ops() -> frozenset[str]:
    """`KNOWN_OPS` plus the ops added with `register_op`."""
    return KNOWN_OPS | frozenset(_REGISTERED_OPS)


def register_op(name: str) -> None:
    """Make `name` a known op, so that policies may name it (e.g. a custom op from an extension).

    A registered op is on no autocast list: presets treat it as the policy's global rule until an
    override (``policy.set_op(name, Rule.FP32)``) says otherwise.

    >>> register_op("my_fused_gelu")
    >>> is_known_op("my_fused_gelu")
    True
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"op name must be an identifier such as 'my_fused_gelu', got {name!r}")
    _REGISTERED_OPS.add(name)
    logger.debug("registered op %r", name)


def autocast_op_lists(device_type: str) -> AutocastOpLists:
    """torch.autocast's op lists for `device_type` ("cuda" or "cpu").

    >>> "softmax" in autocast_op_lists("cuda").fp32_set_opt_dtype
    True
    """
    if device_type not in AUTOCAST_OP_LISTS:
        raise ValueError(
            f"unknown device_type {device_type!r}: amp_fx has op lists for {', '.join(DEVICE_TYPES)}; "
            "pass device_type='cuda' or device_type='cpu'"
        )
    return AUTOCAST_OP_LISTS[device_type]
