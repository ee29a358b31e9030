"""Which op a module's forward lowers to: the canonical op names `amp_fx.core.policy` decides by.

``nn.Linear`` is ``"linear"``, ``nn.LayerNorm`` ``"layer_norm"``; a norm layer of another library
is named by its class (``LlamaRMSNorm`` -> ``"rms_norm"``); a module of amp_fx's own declares its
op in a class attribute ``amp_fx_op``.

    >>> module_op(nn.Linear(2, 2)), module_op(nn.Upsample(scale_factor=(2, 2)))
    ('linear', 'upsample_nearest2d')
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

__all__ = ["MODULE_OPS", "module_op", "upsample_op"]

# Leaf modules -> the op their forward lowers to. Looked up along the MRO, so subclasses
# (NonDynamicallyQuantizableLinear, Lazy* modules once materialised, SyncBatchNorm via
# _BatchNorm) map like their base.
MODULE_OPS: dict[type[nn.Module], str] = {
    nn.Linear: "linear",
    nn.Bilinear: "bilinear",
    nn.Identity: "identity",
    nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d",
    nn.Conv3d: "conv3d",
    nn.ConvTranspose1d: "conv_transpose1d",
    nn.ConvTranspose2d: "conv_transpose2d",
    nn.ConvTranspose3d: "conv_transpose3d",
    nn.modules.batchnorm._BatchNorm: "batch_norm",
    nn.modules.instancenorm._InstanceNorm: "instance_norm",
    nn.LayerNorm: "layer_norm",
    nn.GroupNorm: "group_norm",
    nn.LocalResponseNorm: "local_response_norm",
    nn.Embedding: "embedding",
    nn.EmbeddingBag: "embedding_bag",
    # activations
    nn.ReLU: "relu",
    nn.ReLU6: "relu6",
    nn.LeakyReLU: "leaky_relu",
    nn.PReLU: "prelu",
    nn.RReLU: "rrelu",
    nn.ELU: "elu",
    nn.SELU: "selu",
    nn.CELU: "celu",
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.Mish: "mish",
    nn.Hardswish: "hardswish",
    nn.Hardsigmoid: "hardsigmoid",
    nn.Hardtanh: "hardtanh",
    nn.Sigmoid: "sigmoid",
    nn.Tanh: "tanh",
    nn.Softplus: "softplus",
    nn.Softsign: "softsign",
    nn.Softshrink: "softshrink",
    nn.Hardshrink: "hardshrink",
    nn.Tanhshrink: "tanhshrink",
    nn.LogSigmoid: "logsigmoid",
    nn.Threshold: "threshold",
    nn.GLU: "glu",
    nn.Softmax: "softmax",
    nn.Softmax2d: "softmax",
    nn.LogSoftmax: "log_softmax",
    nn.Softmin: "softmin",
    # pooling
    nn.MaxPool1d: "max_pool1d",
    nn.MaxPool2d: "max_pool2d",
    nn.MaxPool3d: "max_pool3d",
    nn.AvgPool1d: "avg_pool1d",
    nn.AvgPool2d: "avg_pool2d",
    nn.AvgPool3d: "avg_pool3d",
    nn.AdaptiveAvgPool1d: "adaptive_avg_pool1d",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d",
    nn.AdaptiveAvgPool3d: "adaptive_avg_pool3d",
    nn.AdaptiveMaxPool1d: "adaptive_max_pool1d",
    nn.AdaptiveMaxPool2d: "adaptive_max_pool2d",
    nn.AdaptiveMaxPool3d: "adaptive_max_pool3d",
    nn.LPPool1d: "lp_pool1d",
    nn.LPPool2d: "lp_pool2d",
    nn.FractionalMaxPool2d: "fractional_max_pool2d",
    nn.FractionalMaxPool3d: "fractional_max_pool3d",
    nn.MaxUnpool1d: "max_unpool1d",
    nn.MaxUnpool2d: "max_unpool2d",
    nn.MaxUnpool3d: "max_unpool3d",
    nn.Dropout: "dropout",
    nn.Dropout1d: "dropout1d",
    nn.Dropout2d: "dropout2d",
    nn.Dropout3d: "dropout3d",
    nn.AlphaDropout: "alpha_dropout",
    nn.FeatureAlphaDropout: "feature_alpha_dropout",
    # shape and layout
    nn.Flatten: "flatten",
    nn.Unflatten: "unflatten",
    nn.PixelShuffle: "pixel_shuffle",
    nn.PixelUnshuffle: "pixel_unshuffle",
    nn.ChannelShuffle: "channel_shuffle",
    nn.Fold: "col2im",
    nn.Unfold: "im2col",
    nn.modules.padding._ConstantPadNd: "pad",
    nn.modules.padding._ReflectionPadNd: "pad",
    nn.modules.padding._ReplicationPadNd: "pad",
    nn.modules.padding._CircularPadNd: "pad",
    nn.CosineSimilarity: "cosine_similarity",
    nn.PairwiseDistance: "pairwise_distance",
    # losses (F.cross_entropy lowers to aten cross_entropy_loss)
    nn.L1Loss: "l1_loss",
    nn.MSELoss: "mse_loss",
    nn.CrossEntropyLoss: "cross_entropy_loss",
    nn.NLLLoss: "nll_loss",
    nn.BCELoss: "binary_cross_entropy",
    nn.BCEWithLogitsLoss: "binary_cross_entropy_with_logits",
    nn.KLDivLoss: "kl_div",
    nn.HuberLoss: "huber_loss",
    nn.SmoothL1Loss: "smooth_l1_loss",
    nn.SoftMarginLoss: "soft_margin_loss",
    nn.MultiLabelMarginLoss: "multilabel_margin_loss",
    nn.MultiLabelSoftMarginLoss: "multilabel_soft_margin_loss",
    nn.MultiMarginLoss: "multi_margin_loss",
    nn.MarginRankingLoss: "margin_ranking_loss",
    nn.HingeEmbeddingLoss: "hinge_embedding_loss",
    nn.CosineEmbeddingLoss: "cosine_embedding_loss",
    nn.TripletMarginLoss: "triplet_margin_loss",
    nn.TripletMarginWithDistanceLoss: "triplet_margin_with_distance_loss",
    nn.PoissonNLLLoss: "poisson_nll_loss",
    nn.GaussianNLLLoss: "gaussian_nll_loss",
    nn.CTCLoss: "ctc_loss",
}
MODULE_OPS[nn.CrossMapLRN2d] = "local_response_norm"
# Modules newer than the oldest torch amp_fx supports.
for _name, _op in (("RMSNorm", "rms_norm"), ("LPPool3d", "lp_pool3d")):
    if hasattr(nn, _name):
        MODULE_OPS[getattr(nn, _name)] = _op

_UPSAMPLE_BY_MODE = {
    "linear": "upsample_linear1d",
    "bilinear": "upsample_bilinear2d",
    "bicubic": "upsample_bicubic2d",
    "trilinear": "upsample_trilinear3d",
}

# Norm layers of other libraries (transformers' LlamaRMSNorm and T5LayerNorm, timm's LayerNorm2d),
# by the end of their class name; the first match wins.
_NORM_SUFFIXES = (
    ("RMSNorm", "rms_norm"),
    ("RmsNorm", "rms_norm"),
    ("LayerNorm", "layer_norm"),
    ("LayerNorm2d", "layer_norm"),
    ("GroupNorm", "group_norm"),
    ("BatchNorm", "batch_norm"),
    ("BatchNorm2d", "batch_norm"),
)


def upsample_op(mode: str, size: Any, scale_factor: Any) -> str:
    """aten upsample op for an interpolate mode; nearest/area need the rank, known from a
    tuple size or scale_factor. Without it the name stays ``interpolate``."""
    if mode in _UPSAMPLE_BY_MODE:
        return _UPSAMPLE_BY_MODE[mode]
    spatial = next((len(v) for v in (size, scale_factor) if isinstance(v, (tuple, list))), None)
    if spatial is None:
        return "interpolate"
    if mode == "nearest":
        return f"upsample_nearest{spatial}d"
    if mode == "nearest-exact":
        return f"_upsample_nearest_exact{spatial}d"
    if mode == "area":
        return f"adaptive_avg_pool{spatial}d"
    return "interpolate"


def module_op(module: nn.Module) -> str:
    """The op a leaf module's forward lowers to: by `MODULE_OPS` along its MRO, a norm of another
    library by its class name (``LlamaRMSNorm`` -> ``"rms_norm"``), else its class name in
    snake_case.

        >>> module_op(nn.Linear(2, 2)), module_op(type("T5LayerNorm", (nn.Module,), {})())
        ('linear', 'layer_norm')
    """
    declared = getattr(type(module), "amp_fx_op", None)
    if declared is not None:
        return declared
    if isinstance(module, nn.Upsample):  # UpsamplingNearest2d / UpsamplingBilinear2d included
        size, scale = module.size, module.scale_factor
        if isinstance(module, (nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d)):
            size = scale = (0, 0)  # always 2-d
        return upsample_op(module.mode, size, scale)
    for cls in type(module).__mro__:
        if cls in MODULE_OPS:
            return MODULE_OPS[cls]
    for cls in type(module).__mro__:
        for suffix, op in _NORM_SUFFIXES:
            if cls.__name__.endswith(suffix):
                return op
    # A leaf with no table entry: its class name in snake_case ("MyLayer" -> "my_layer").
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(module).__name__).lower()
