"""Pass 2 of convert: give every call one canonical op name, whatever its spelling.

``torch.softmax(x, -1)``, ``F.softmax(x, -1)``, ``x.softmax(-1)`` and ``nn.Softmax(-1)`` are one op,
``"softmax"``; ``x + y``, ``x += y``, ``torch.add``, ``x.add`` and ``x.add_`` are ``"add"``. The
canonical name is the aten op the call lowers to, without overload and without the in-place
underscore, so the policy can be written against torch.autocast's op lists. The graph is not
rewritten (it keeps reading as the user wrote it): the name goes to ``node_info(node).op`` and the
original spelling to ``node_info(node).notes``.

Example::

    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc, self.act = nn.Linear(4, 4), nn.Softmax(-1)
    ...     def forward(self, x):
    ...         x = self.fc(x)
    ...         x += 1
    ...         return F.softmax(x, -1) @ self.act(x).mT
    >>> from amp_fx.passes.trace import trace
    >>> gm = normalize_ops(trace(Net()))
    >>> for n in gm.graph.nodes:                          # before: op None everywhere
    ...     if n.op.startswith("call"):
    ...         print(n.name, node_info(n).op, node_info(n).notes)
    fc linear ['nn.Linear']
    add add ['operator.add (+)']
    softmax softmax ['F.softmax']
    act softmax ['nn.Softmax']
    getattr_1 getattr ['builtins.getattr']
    matmul matmul ['operator.matmul (@)']

Nodes made opaque by `trace` keep rule OPAQUE and get op ``"opaque"`` (`amp_fx.core.op_lists.OPAQUE_OP`),
with the module class or function in the notes. Python-level composites keep their functional
name (``einsum`` stays ``"einsum"``, ``F.normalize`` is ``"normalize"``, an ``F.interpolate`` whose
rank is unknown is ``"interpolate"``); `amp_fx.core.op_lists` lists them as composites.
"""

from __future__ import annotations

import builtins
import logging
import math
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from amp_fx.core.node_info import node_info
from amp_fx.core.op_lists import OPAQUE_OP, canonical_op_name, is_known_op
from amp_fx.core.policy import Rule
from amp_fx.ops.fused_batch_norm import FusedBatchNormAct

logger = logging.getLogger(__name__)

__all__ = ["normalize_ops", "canonical_op", "module_op", "original_spelling", "MODULE_OPS", "OPERATOR_OPS"]

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
    FusedBatchNormAct: "batch_norm",  # amp_fx's BatchNorm + [add] + ReLU (a converted graph)
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

# Python operators -> (canonical op, symbol shown in the report).
OPERATOR_OPS: dict[Callable[..., Any], tuple[str, str]] = {
    operator.add: ("add", "+"),
    operator.iadd: ("add", "+="),
    operator.sub: ("sub", "-"),
    operator.isub: ("sub", "-="),
    operator.mul: ("mul", "*"),
    operator.imul: ("mul", "*="),
    operator.truediv: ("div", "/"),
    operator.itruediv: ("div", "/="),
    operator.floordiv: ("floor_divide", "//"),
    operator.ifloordiv: ("floor_divide", "//="),
    operator.mod: ("remainder", "%"),
    operator.imod: ("remainder", "%="),
    operator.pow: ("pow", "**"),
    operator.ipow: ("pow", "**="),
    operator.matmul: ("matmul", "@"),
    operator.imatmul: ("matmul", "@="),
    operator.neg: ("neg", "unary -"),
    operator.pos: ("positive", "unary +"),
    operator.abs: ("abs", "abs()"),
    operator.invert: ("bitwise_not", "~"),
    operator.and_: ("bitwise_and", "&"),
    operator.iand: ("bitwise_and", "&="),
    operator.or_: ("bitwise_or", "|"),
    operator.ior: ("bitwise_or", "|="),
    operator.xor: ("bitwise_xor", "^"),
    operator.ixor: ("bitwise_xor", "^="),
    operator.lshift: ("bitwise_left_shift", "<<"),
    operator.rshift: ("bitwise_right_shift", ">>"),
    operator.eq: ("eq", "=="),
    operator.ne: ("ne", "!="),
    operator.lt: ("lt", "<"),
    operator.le: ("le", "<="),
    operator.gt: ("gt", ">"),
    operator.ge: ("ge", ">="),
    operator.getitem: ("getitem", "[]"),
    operator.setitem: ("setitem", "[]="),
    builtins.getattr: ("getattr", "getattr"),
}

# Spellings torch accepts for the same aten op (aliases), and functional names whose op has
# another name in `amp_fx.core.op_lists`. Applied after stripping the in-place underscore and before
# `op_lists.canonical_op_name` (which holds the aliases the policy accepts from users too).
_ALIASES = {
    "true_divide": "div",
    "clip": "clamp",
    "arccos": "acos",
    "arcsin": "asin",
    "arctan": "atan",
    "arctan2": "atan2",
    "arccosh": "acosh",
    "arcsinh": "asinh",
    "arctanh": "atanh",
    "greater": "gt",
    "greater_equal": "ge",
    "less": "lt",
    "less_equal": "le",
    "not_equal": "ne",
    "swapaxes": "transpose",
    "swapdims": "transpose",
    "moveaxis": "movedim",
    "fix": "trunc",
    "ger": "outer",
    "expit": "sigmoid",
    "special_expit": "sigmoid",
    "log_sigmoid": "logsigmoid",  # F.logsigmoid is torch._C._nn.log_sigmoid
    "max_pool1d_with_indices": "max_pool1d",
    "max_pool2d_with_indices": "max_pool2d",
    "max_pool3d_with_indices": "max_pool3d",
    "adaptive_max_pool1d_with_indices": "adaptive_max_pool1d",
    "adaptive_max_pool2d_with_indices": "adaptive_max_pool2d",
    "adaptive_max_pool3d_with_indices": "adaptive_max_pool3d",
    "fold": "col2im",
    "unfold_input": "im2col",
}
# Tensor methods that convert dtype or device: one op, "to".
_CONVERSION_METHODS = {
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "bool",
    "byte", "char", "cfloat", "cdouble", "cuda", "cpu",
}  # fmt: skip
# F.fold/F.unfold are the functional spellings of the im2col/col2im modules; Tensor.unfold is
# a different op (sliding windows), so only the functional unfold is renamed.
_FUNCTIONAL_RENAMES = {F.unfold: "im2col", F.fold: "col2im"}
_INTERPOLATE_FUNCTIONS = {F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear}
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

_spelling_index: dict[int, str] | None = None


def _public_spellings() -> dict[int, str]:
    """id(callable) -> its public spelling ("F.softmax", "torch.add", "math.sqrt"), built once."""
    global _spelling_index
    if _spelling_index is None:
        index: dict[int, str] = {}
        for prefix, namespace in (("math", math), ("torch", torch), ("F", F)):  # later wins: F over torch
            for name, value in vars(namespace).items():
                if callable(value) and not name.startswith("__"):
                    index[id(value)] = f"{prefix}.{name}"
        _spelling_index = index
    return _spelling_index


def _strip_inplace(name: str) -> str:
    if name.endswith("_") and not name.endswith("__") and len(name) > 1:
        return name[:-1]
    return name


def _name_of_callable(fn: Any) -> str:
    """Canonical name of a function target: aten OpOverload/Packet by schema, else its __name__."""
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = fn._schema.name if isinstance(fn, torch._ops.OpOverload) else fn._qualified_op_name
        return name.split("::")[-1]
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name


def _canonical_name(name: str) -> str:
    name = _strip_inplace(name)
    return canonical_op_name(_ALIASES.get(name, name))


def _argument(node: torch.fx.Node, position: int, keyword: str, default: Any = None) -> Any:
    if keyword in node.kwargs:
        return node.kwargs[keyword]
    return node.args[position] if len(node.args) > position else default


def _upsample_name(mode: str, size: Any, scale_factor: Any) -> str:
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
    if isinstance(module, nn.Upsample):  # UpsamplingNearest2d / UpsamplingBilinear2d included
        size, scale = module.size, module.scale_factor
        if isinstance(module, (nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d)):
            size = scale = (0, 0)  # always 2-d
        return _upsample_name(module.mode, size, scale)
    for cls in type(module).__mro__:
        if cls in MODULE_OPS:
            return MODULE_OPS[cls]
    for cls in type(module).__mro__:
        for suffix, op in _NORM_SUFFIXES:
            if cls.__name__.endswith(suffix):
                return op
    # A leaf with no table entry: its class name in snake_case ("MyLayer" -> "my_layer").
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(module).__name__).lower()


def _function_op(node: torch.fx.Node) -> str:
    target = node.target
    if target is builtins.getattr:
        # x.shape is recorded as getattr(x, "shape"): named by the attribute where that is an op.
        attribute = _argument(node, 1, "name")
        if isinstance(attribute, str) and is_known_op(attribute):
            return attribute
    if target in OPERATOR_OPS:
        return OPERATOR_OPS[target][0]
    if target in _FUNCTIONAL_RENAMES:
        return _FUNCTIONAL_RENAMES[target]
    if target in _INTERPOLATE_FUNCTIONS:
        if target is F.upsample_bilinear:
            return "upsample_bilinear2d"
        if target is F.upsample_nearest:
            return _upsample_name("nearest", _argument(node, 1, "size"), _argument(node, 2, "scale_factor"))
        return _upsample_name(
            _argument(node, 3, "mode", "nearest"),
            _argument(node, 1, "size"),
            _argument(node, 2, "scale_factor"),
        )
    return _canonical_name(_name_of_callable(target))


def _method_op(name: str) -> str:
    if name in _CONVERSION_METHODS:
        return "to"
    return _canonical_name(name)


def canonical_op(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """The canonical op name of a call node, or None for placeholders, get_attr and output.

    Example::

        >>> gm = torch.fx.symbolic_trace(lambda x: x.softmax(-1).add_(1))
        >>> [canonical_op(n, gm) for n in gm.graph.nodes]
        [None, 'softmax', 'add', None]
    """
    if node.op == "call_module":
        return module_op(gm.get_submodule(node.target))
    if node.op == "call_function":
        return _function_op(node)
    if node.op == "call_method":
        return _method_op(node.target)
    return None


def original_spelling(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str | None:
    """How the user wrote the call: "F.softmax", "Tensor.softmax", "nn.Softmax", "operator.iadd (+=)"."""
    if node.op == "call_module":
        cls = type(gm.get_submodule(node.target))
        if cls.__module__.startswith("torch.nn.") and getattr(nn, cls.__name__, None) is cls:
            return f"nn.{cls.__name__}"
        return f"{cls.__module__}.{cls.__qualname__}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op != "call_function":
        return None
    target = node.target
    if target in OPERATOR_OPS:
        symbol = OPERATOR_OPS[target][1]
        module = "builtins" if target is builtins.getattr else "operator"
        name = f"{module}.{target.__name__}"
        return name if symbol == target.__name__ else f"{name} ({symbol})"
    public = _public_spellings().get(id(target))
    if public is not None:
        return public
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{target}"
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"


def normalize_ops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Record the canonical op name and original spelling of every call node (graph unchanged).

    Opaque nodes (rule OPAQUE, set by `trace`) get the op name policies use for untraced code,
    ``"opaque"`` (`amp_fx.core.op_lists.OPAQUE_OP`); their class or function goes to the notes.

    Example::

        >>> from amp_fx.passes.trace import trace
        >>> gm = normalize_ops(trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU())))
        >>> [node_info(n).op for n in gm.graph.nodes]
        [None, 'linear', 'relu', None]
    """
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        info = node_info(node)
        spelling = original_spelling(node, gm)
        if spelling is not None and spelling not in info.notes:
            info.notes.insert(0, spelling)
        # Untraced code is one op for the policy, "opaque"; what it is stays in the notes.
        info.op = OPAQUE_OP if info.rule is Rule.OPAQUE else canonical_op(node, gm)
    return gm
