"""The opt-level policy as data: which precision each op runs in and how parameters are stored.

A `Policy` answers one question for the passes, ``policy.decide(op, module_name, module_type)``:
the `Rule` for that op (with a reason for the report) and the storage dtype of the calling
module's own parameters. Presets per opt level (Apex's O0–O3) and device type come from `preset`;
users override them like ``torch.ao.quantization.QConfigMapping``, with the precedence

    global < op or module type < module-name regex < exact module name

(at the op/module-type level a module-type override beats an op override, being the narrower).
The preset's entries are op-level defaults: any override, including ``set_op``, beats them;
``set_global`` is the rule for ops that neither the preset nor an override names.

Example::

    >>> import torch
    >>> policy = preset("O2", dtype=torch.bfloat16, device_type="cpu").set_module_name("head", Rule.FP32)
    >>> policy.decide("linear", module_name="head").rule
    <Rule.FP32: 'fp32'>
    >>> print(policy.decide("softmax").reason)
    O2 FP32 island: softmax is unstable in low precision (exp overflows fp16; the normalizing sum loses bits)
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES, check_opt_level, dtype_name, short_repr
from amp_fx.core.op_lists import (
    DEVICE_TYPES,
    OPAQUE_OP,
    PASSTHROUGH_OPS,
    AutocastOpLists,
    autocast_op_lists,
    canonical_op_name,
    is_known_op,
    known_ops,
)

logger = logging.getLogger(__name__)


class Rule(str, enum.Enum):
    """How an op's floating inputs are cast before it runs."""

    # Cast floating inputs to the policy's low dtype (fp16/bf16).
    LOWER = "lower"
    # Cast floating inputs to float32.
    FP32 = "fp32"
    # Cast floating inputs to the widest floating input dtype, like autocast's promote.
    PROMOTE = "promote"
    # Dtype-agnostic: run on whatever flows in, no casts.
    PASSTHROUGH = "passthrough"
    # Untraced module/function; under O1 and O2 it runs inside a torch.autocast island of the
    # policy's dtype (see `Policy.autocast_opaque`).
    OPAQUE = "opaque"


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one op call.

    ``param_dtype`` is the storage dtype for the calling module's own parameters and floating
    buffers; None leaves them as they are (O0, O1 and calls that are not modules' own).
    """

    rule: Rule
    reason: str
    param_dtype: torch.dtype | None


@dataclass(frozen=True)
class OpRule:
    """A preset's op-level entry: the rule and where it comes from."""

    rule: Rule
    reason: str


# O2's FP32 islands: ops whose low-precision result is unsafe, at little cost (all are cheap next
# to the matmuls and convolutions that stay low). Apex's O2 had none but BatchNorm; these follow the
# ops autocast itself runs in fp32, minus the expensive or norm-like ones that work fine low.
O2_FP32_ISLANDS: dict[str, str] = {
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
_BATCH_NORM_OPS = frozenset({"batch_norm"})
# O2 keeps the activations autocast keeps in FP32: norms run in FP32 on FP32 params (their
# input is cast up; CUDA's layer_norm refuses fp32 params on fp16 input, so never mixed), and
# embeddings keep FP32 tables, so a transformer's residual stream stays FP32 as under autocast.
# Storing these low (Apex's O2) rounds the residual stream at every add: on small GPT-2, Llama and
# Whisper models that doubled O2's error against FP32 relative to autocast's (tests/
# test_export_front_end.py). Only the weights of the ops autocast lowers are stored low.
_O2_FP32_PARAM_OPS: dict[str, str] = {
    "layer_norm": "norms run in FP32 with FP32 params (as under autocast)",
    "group_norm": "norms run in FP32 with FP32 params (as under autocast)",
    "rms_norm": "norms run in FP32 with FP32 params (as under autocast)",
    "embedding": "FP32 tables keep the residual stream FP32 (as under autocast)",
    "embedding_bag": "FP32 tables keep the residual stream FP32 (as under autocast)",
}

# Ops that are matrix products in disguise: O2/O3 lower them on every device, although the CPU
# autocast lists only lower them through the ops they call.
_MATMUL_COMPOSITES = frozenset({"einsum", "tensordot", "linalg_multi_dot", "chain_matmul"})


# --------------------------------------------------------------------------------------------
# Validation helpers: each raises a clear error naming the problem and the fix.
# --------------------------------------------------------------------------------------------
# "float16" -> torch.float16, "bfloat16" -> torch.bfloat16 (also spelt with "torch.").
_LOW_PRECISION_BY_NAME = {dtype_name(dtype): dtype for dtype in LOW_PRECISION_DTYPES}


def _check_low_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _LOW_PRECISION_BY_NAME:
        return _LOW_PRECISION_BY_NAME[dtype.removeprefix("torch.")]
    if dtype not in LOW_PRECISION_DTYPES:
        raise ValueError(
            f"dtype must be torch.float16 or torch.bfloat16, got {short_repr(dtype)}; for float32 training "
            "use opt_level 'O0'"
        )
    return dtype


def _check_output_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        candidate = getattr(torch, name, None)
        if isinstance(candidate, torch.dtype):
            dtype = candidate
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"cast_model_outputs must be a floating torch.dtype (e.g. torch.float32) or None, got "
            f"{short_repr(dtype)}"
        )
    return dtype


def _check_device_type(device_type: Any) -> str:
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    if device_type in DEVICE_TYPES:
        return device_type
    hint = ""
    if isinstance(device_type, str) and ":" in device_type:
        hint = f" (a device type has no index: use {short_repr(device_type.split(':')[0])})"
    raise ValueError(
        f"unknown device_type {short_repr(device_type)}: use one of "
        f"{', '.join(map(repr, DEVICE_TYPES))}{hint}"
    )


def _check_keep_batchnorm_fp32(value: Any) -> bool:
    # Apex accepted the strings "True"/"False" (from argparse); accept them, reject anything else.
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):
        return value == "True"
    raise ValueError(
        f"keep_batchnorm_fp32 must be True or False (or Apex's strings 'True'/'False'), got {value!r}"
    )


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _check_rule(rule: Any) -> Rule:
    if isinstance(rule, Rule):
        return rule
    try:
        return Rule(rule)
    except ValueError:
        choices = ", ".join(f"Rule.{r.name}" for r in Rule)
        raise ValueError(f"unknown rule {rule!r}: use one of {choices} (or their values)") from None


def _check_op(op: Any) -> str:
    name = canonical_op_name(op)
    if is_known_op(name):
        return name
    close = difflib.get_close_matches(name, sorted(known_ops()), n=3, cutoff=0.6)
    suggestion = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ValueError(
        f"policy names an unknown op {op!r}.{suggestion} Op names are aten names without overload or "
        "in-place underscore ('linear', 'conv2d', 'softmax'); to use a new op, register it first with "
        f"amp_fx.core.op_lists.register_op({name!r})"
    )


def _check_module_type(module_type: Any) -> type:
    if not isinstance(module_type, type):
        raise TypeError(
            f"set_module_type needs a class such as torch.nn.Linear, got {type(module_type).__name__} "
            f"{module_type!r}"
        )
    return module_type


def _check_regex(pattern: Any) -> str:
    if not isinstance(pattern, str):
        raise TypeError(f"module name regex must be a str, got {type(pattern).__name__} {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as error:
        raise ValueError(
            f"module name regex {pattern!r} does not compile ({error}); fix the pattern, or use "
            "set_module_name for an exact name (re.escape quotes dots)"
        ) from None
    return pattern


def _type_path(cls: type) -> str:
    if "<locals>" in cls.__qualname__:
        raise ValueError(
            f"cannot serialize module type {cls.__qualname__!r}: it is defined inside a function; "
            "define it at module level so from_dict can import it"
        )
    return f"{cls.__module__}.{cls.__qualname__}"


def _import_type(path: str) -> type:
    # "torch.nn.modules.linear.Linear": import the longest importable module prefix, getattr the rest.
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        if isinstance(obj, type):
            return obj
        break
    raise ValueError(
        f"cannot import module type {path!r}: give 'package.module.ClassName' of an importable class"
    )


# --------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------
def _o1_op_rules(lists: AutocastOpLists) -> dict[str, OpRule]:
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
        Rule.OPAQUE, f"O1: untraced code runs inside torch.autocast({lists.device_type!r})"
    )
    return rules


def _low_op_rules(opt_level: str, keep_batchnorm_fp32: bool) -> dict[str, OpRule]:
    # O2 and O3 use one op set on every device: the union of both devices' lower and promote lists,
    # since the model's weights are already low and these lists only decide where to cast.
    cuda, cpu = autocast_op_lists("cuda"), autocast_op_lists("cpu")
    rules: dict[str, OpRule] = {}
    for op in cuda.promote | cpu.promote:
        rules[op] = OpRule(Rule.PROMOTE, f"{opt_level}: {op} is on autocast's promote list")
    for op in cuda.lower_precision_fp | cpu.lower_precision_fp:
        rules[op] = OpRule(Rule.LOWER, f"{opt_level}: {op} is on autocast's lower_precision_fp list")
    for op in _MATMUL_COMPOSITES:
        rules[op] = OpRule(Rule.LOWER, f"{opt_level}: {op} is a matrix product (lowered as autocast does)")
    if opt_level == "O2":
        for op, why in O2_FP32_ISLANDS.items():
            rules[op] = OpRule(Rule.FP32, f"O2 FP32 island: {why}")
        for op, why in _O2_FP32_PARAM_OPS.items():
            rules[op] = OpRule(Rule.FP32, f"O2: {why}")
        rules[OPAQUE_OP] = OpRule(Rule.OPAQUE, "O2: untraced code runs inside an autocast island")
    else:
        rules[OPAQUE_OP] = OpRule(Rule.OPAQUE, "O3: untraced code runs on whatever flows in (no autocast)")
    for op in _BATCH_NORM_OPS:
        if keep_batchnorm_fp32:
            reason = f"{opt_level} keep_batchnorm_fp32: {op} runs on low input with fp32 params, no casts"
        else:
            reason = f"{opt_level}: {op} runs in the low dtype with low params"
        rules[op] = OpRule(Rule.PASSTHROUGH, reason)
    return rules


def _fusion_flag(*, cuda_only: bool, needs: str | None = None) -> Any:
    """A `Policy` field for one fused kernel: False unless set; None asks for the opt level's default.

    The default is on at O2 only, and for `cuda_only` kernels only on CUDA (elsewhere they would
    run their pure-torch references, slower than torch); `needs` names a flag it only acts after.
    """
    return field(default=False, metadata={"fusion": True, "cuda_only": cuda_only, "needs": needs})


@dataclass(eq=True)
class Policy:
    """An opt-level policy: presets per op plus QConfigMapping-style user overrides.

    Build one with `preset`; override with the chainable ``set_global``, ``set_op``,
    ``set_module_type``, ``set_module_name_regex`` and ``set_module_name``. Precedence, lowest first:
    global < preset op rule < op override < module-type override < module-name regex (first
    matching pattern wins) < exact module name.

    Opt levels (Apex's property table):

    - O0: everything PASSTHROUGH, no casts: the identity.
    - O1: torch.autocast's lists for `device_type` (lower -> LOWER, fp32/fp32_set_opt_dtype -> FP32,
      promote -> PROMOTE, the rest PASSTHROUGH); parameters untouched. Ops that autocast changes
      although no list names them (``einsum`` on CPU calls ``bmm``) and untraced code run in an
      autocast island (OPAQUE), so O1 on CPU matches ``torch.autocast("cpu")`` bit for bit.
    - O2: parameters stored low, inputs cast low at the model entry, matmul/conv ops LOWER, promote
      ops PROMOTE, the FP32 islands of `O2_FP32_ISLANDS` (softmax, losses, exp/log/pow, sums, norms)
      FP32, everything else PASSTHROUGH. batch_norm (``keep_batchnorm_fp32``, default True) keeps
      fp32 params and runs on low input (mixed input works in cuDNN and on CPU), so it needs no
      casts; norms (layer/group/RMS) and embeddings run in FP32 on FP32 params, as under autocast.
    - O3: parameters low (BatchNorm too unless ``keep_batchnorm_fp32=True``), no FP32 islands.

    ``fused_losses`` (default True at O2 only): an FP32 cross_entropy whose input is a cast of
    low-precision logits reads them directly (`amp_fx.ops.losses.fp32_cross_entropy`): the same fp32
    math without a float32 copy of the logits. O1 leaves it off to stay bit-identical to autocast.
    ``fused_linear_loss`` (default True at O2 on CUDA; needs ``fused_losses``): such a loss whose
    logits come, through row-keeping views only, from a linear layer nothing else reads runs with
    that layer as one call (`amp_fx.ops.losses.linear_cross_entropy`: under torch.compile the gradient
    is computed in the loss's forward kernel and the backward is matmuls only; eagerly the two
    calls run as before, which measured faster there).
    ``fused_batch_norm`` (default True at O2 on CUDA): BatchNorm2d followed by ReLU (or by a residual
    add and ReLU) runs as one call (`amp_fx.ops.fused_batch_norm.FusedBatchNormAct`) when its input is
    large. ``fused_max_pool`` (default True at O2 on CUDA): large 2-D max-pools run through
    `amp_fx.ops.pooling.max_pool2d` (1-byte argmax offsets, a one-pass gather backward). Both kernels
    are for GPUs: on other devices they would run their pure-torch references, slower than torch.

    >>> policy = preset("O1", device_type="cpu", dtype=torch.bfloat16)
    >>> policy.decide("conv2d")
    Decision(rule=<Rule.LOWER: 'lower'>, reason='autocast cpu lower_precision_fp list', param_dtype=None)
    """

    opt_level: str
    dtype: torch.dtype = torch.float16
    # None: the model's, filled in by `for_device` when `amp_fx.convert` sees the model.
    device_type: str | None = None
    keep_batchnorm_fp32: bool = False
    cast_model_outputs: torch.dtype | None = None
    # The fused kernels (see `fusion_flags`); None while their default waits for the device type.
    fused_losses: bool | None = _fusion_flag(cuda_only=False)
    fused_linear_loss: bool | None = _fusion_flag(cuda_only=True, needs="fused_losses")
    fused_batch_norm: bool | None = _fusion_flag(cuda_only=True)
    fused_max_pool: bool | None = _fusion_flag(cuda_only=True)
    op_rules: dict[str, OpRule] = field(default_factory=dict)
    global_rule: Rule = Rule.PASSTHROUGH
    op_overrides: dict[str, Rule] = field(default_factory=dict)
    module_type_overrides: dict[type, Rule] = field(default_factory=dict)
    # Ordered: the first pattern that matches wins, as in QConfigMapping.
    module_name_regex_overrides: list[tuple[str, Rule]] = field(default_factory=list)
    module_name_overrides: dict[str, Rule] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Validate everything before the object is used: a bad policy never reaches the passes.
        self.opt_level = check_opt_level(self.opt_level)
        self.dtype = _check_low_dtype(self.dtype)
        if self.device_type is not None:
            self.device_type = _check_device_type(self.device_type)
        self.keep_batchnorm_fp32 = _check_keep_batchnorm_fp32(self.keep_batchnorm_fp32)
        self.cast_model_outputs = _check_output_dtype(self.cast_model_outputs)
        for flag in _FUSION_FLAGS:
            setattr(self, flag.name, self._fusion_default(flag, getattr(self, flag.name)))
        self.global_rule = _check_rule(self.global_rule)
        self.op_rules = {
            _check_op(op): OpRule(_check_rule(entry.rule), str(entry.reason))
            for op, entry in self.op_rules.items()
        }
        self.op_overrides = {_check_op(op): _check_rule(rule) for op, rule in self.op_overrides.items()}
        self.module_type_overrides = {
            _check_module_type(cls): _check_rule(rule) for cls, rule in self.module_type_overrides.items()
        }
        self.module_name_regex_overrides = [
            (_check_regex(pattern), _check_rule(rule)) for pattern, rule in self.module_name_regex_overrides
        ]
        self.module_name_overrides = {
            str(name): _check_rule(rule) for name, rule in self.module_name_overrides.items()
        }

    def _fusion_default(self, flag: dataclasses.Field, value: Any) -> bool | None:
        if value is not None:
            return _check_flag(flag.name, value)
        if flag.metadata["cuda_only"] and self.device_type is None:
            return None  # decided by `for_device`
        needs = flag.metadata["needs"]
        return (
            self.opt_level == "O2"
            and (not flag.metadata["cuda_only"] or self.device_type == "cuda")
            and (needs is None or bool(getattr(self, needs)))
        )

    @classmethod
    def fusion_flags(cls) -> tuple[str, ...]:
        """The names of the fused-kernel switches (``fused_losses``, ``fused_max_pool``, ...).

        >>> "fused_batch_norm" in Policy.fusion_flags()
        True
        """
        return tuple(flag.name for flag in _FUSION_FLAGS)

    def for_device(self, device_type: str | torch.device) -> Policy:
        """This policy on `device_type`: itself if it names that device type already, else a copy
        with the device's preset op rules (under its own) and fused-kernel defaults filled in.

        `amp_fx.convert` calls it with the model's device type for a policy that names none.

        >>> policy = preset("O1", dtype=torch.bfloat16)
        >>> policy.device_type is None, policy.for_device("cpu").decide("conv2d").reason
        (True, 'autocast cpu lower_precision_fp list')
        """
        device = _check_device_type(device_type)
        if self.device_type == device:
            return self
        if self.device_type is not None:
            raise ValueError(
                f"this policy is for device_type {self.device_type!r}, not {device!r}: build one for "
                f"{device!r} with amp_fx.preset(..., device_type={device!r})"
            )
        op_rules = {**_preset_op_rules(self.opt_level, device, self.keep_batchnorm_fp32), **self.op_rules}
        return dataclasses.replace(self, device_type=device, op_rules=op_rules)

    # ---- derived properties read by the passes ------------------------------------------------
    @property
    def is_identity(self) -> bool:
        """True for O0 without overrides: convert leaves the graph's numerics unchanged.

        Overrides apply at O0 too (``preset("O0").set_module_name("head", Rule.LOWER)`` casts only
        around ``head``), and then the policy is no longer the identity.
        """
        return self.opt_level == "O0" and self.global_rule is Rule.PASSTHROUGH and not self._has_overrides()

    @property
    def cast_parameters(self) -> bool:
        """True for O2/O3: parameters and floating buffers are stored in the low dtype."""
        return self.opt_level in ("O2", "O3")

    @property
    def cast_inputs_dtype(self) -> torch.dtype | None:
        """The dtype floating model inputs are cast to at entry: low for O2/O3, None for O0/O1."""
        return self.dtype if self.cast_parameters else None

    @property
    def autocast_opaque(self) -> bool:
        """True for O1/O2: OPAQUE nodes run inside ``torch.autocast(device_type, dtype)``."""
        return self.opt_level in ("O1", "O2")

    # ---- overrides (chainable, like QConfigMapping) -------------------------------------------
    def set_global(self, rule: Rule | str) -> Policy:
        """Rule for ops that neither the preset nor an override names (default PASSTHROUGH)."""
        self.global_rule = _check_rule(rule)
        return self

    def set_op(self, op: str, rule: Rule | str) -> Policy:
        """Rule for every call of `op` (any spelling: ``F.softmax``, ``x.softmax``, ``nn.Softmax``).

        >>> preset("O2").set_op("softmax", Rule.LOWER).decide("softmax").rule
        <Rule.LOWER: 'lower'>
        """
        name, checked = _check_op(op), _check_rule(rule)
        self.op_overrides[name] = checked
        return self

    def set_module_type(self, module_type: type, rule: Rule | str) -> Policy:
        """Rule for calls of modules of `module_type` (exact type, as QConfigMapping's object_type)."""
        cls, checked = _check_module_type(module_type), _check_rule(rule)
        self.module_type_overrides[cls] = checked
        return self

    def set_module_name_regex(self, pattern: str, rule: Rule | str) -> Policy:
        """Rule for modules whose qualified name matches `pattern` (``re.match``; first set wins)."""
        checked_pattern, checked = _check_regex(pattern), _check_rule(rule)
        entries = self.module_name_regex_overrides
        for index, (existing, _) in enumerate(entries):
            if existing == checked_pattern:
                entries[index] = (checked_pattern, checked)
                return self
        entries.append((checked_pattern, checked))
        return self

    def set_module_name(self, name: str, rule: Rule | str) -> Policy:
        """Rule for the module with qualified name `name` (e.g. ``"layer1.0.conv1"``): highest precedence."""
        if not isinstance(name, str):
            raise TypeError(f"module name must be a str such as 'layer1.0.conv1', got {name!r}")
        self.module_name_overrides[name] = _check_rule(rule)
        return self

    # ---- decisions ----------------------------------------------------------------------------
    def decide(self, op: str, module_name: str | None = None, module_type: type | None = None) -> Decision:
        """The rule for one call of `op`, why, and the storage dtype of the caller's own params.

        `module_name`/`module_type` describe the module whose forward is this call (call_module
        nodes); leave them None for functions and methods. ``param_dtype`` is None at O0/O1; at
        O2/O3 it is the low dtype, except float32 for modules whose rule is FP32 and for batch_norm
        under keep_batchnorm_fp32. BatchNorm takes low-precision input with fp32 weight on CPU and
        CUDA and returns the input dtype, so it needs no casts around it (ResNet-50 has 53).

        >>> preset("O2", device_type="cpu").decide("batch_norm", "bn1").param_dtype
        torch.float32
        """
        name = canonical_op_name(op)
        rule, reason = self._rule_for(name, module_name, module_type)
        return Decision(rule, reason, self._param_dtype(name, rule))

    def _rule_for(self, op: str, module_name: str | None, module_type: type | None) -> tuple[Rule, str]:
        if module_name is not None and module_name in self.module_name_overrides:
            return self.module_name_overrides[module_name], f"override: module name {module_name!r}"
        if module_name is not None:
            for pattern, rule in self.module_name_regex_overrides:
                if re.match(pattern, module_name):
                    return rule, f"override: module name regex {pattern!r}"
        if module_type is not None and module_type in self.module_type_overrides:
            return self.module_type_overrides[
                module_type
            ], f"override: module type {module_type.__qualname__}"
        if op in self.op_overrides:
            return self.op_overrides[op], f"override: op {op!r}"
        if op in self.op_rules:
            entry = self.op_rules[op]
            return entry.rule, entry.reason
        if self.opt_level == "O0" and self.global_rule is Rule.PASSTHROUGH:
            return Rule.PASSTHROUGH, "O0: no casts (identity)"
        if op in PASSTHROUGH_OPS and self.global_rule is Rule.PASSTHROUGH:
            return Rule.PASSTHROUGH, f"{self.opt_level}: {op} is dtype-agnostic (runs on what flows in)"
        if self.opt_level == "O1" and self.device_type is None:
            raise ValueError(
                f"O1's rule for {op!r} comes from the autocast op list of a device type, and this policy "
                "names none: pass device_type='cpu' or 'cuda' to preset, or use policy.for_device(...)"
            )
        return self.global_rule, f"global rule: {op} is on no {self.opt_level} list"

    def _has_overrides(self) -> bool:
        return bool(
            self.op_overrides
            or self.module_type_overrides
            or self.module_name_regex_overrides
            or self.module_name_overrides
        )

    def _param_dtype(self, op: str, rule: Rule) -> torch.dtype | None:
        if not self.cast_parameters:
            return None
        if rule is Rule.FP32:
            return torch.float32
        if op in _BATCH_NORM_OPS and self.keep_batchnorm_fp32:
            return torch.float32
        return self.dtype

    # ---- data ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict (dtypes, rules and module types as strings); see `from_dict`.

        >>> import json
        >>> p = preset("O1", device_type="cpu")
        >>> Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p
        True
        """
        return {
            "opt_level": self.opt_level,
            "dtype": dtype_name(self.dtype),
            "device_type": self.device_type,
            "keep_batchnorm_fp32": self.keep_batchnorm_fp32,
            "cast_model_outputs": None
            if self.cast_model_outputs is None
            else dtype_name(self.cast_model_outputs),
            **{flag: getattr(self, flag) for flag in self.fusion_flags()},
            "global": self.global_rule.value,
            "op_rules": {
                op: {"rule": e.rule.value, "reason": e.reason} for op, e in sorted(self.op_rules.items())
            },
            "op_overrides": {op: rule.value for op, rule in self.op_overrides.items()},
            "module_type_overrides": {
                _type_path(cls): rule.value for cls, rule in self.module_type_overrides.items()
            },
            "module_name_regex_overrides": [[p, rule.value] for p, rule in self.module_name_regex_overrides],
            "module_name_overrides": {name: rule.value for name, rule in self.module_name_overrides.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        """Rebuild a policy written by `to_dict`; every field is validated as in `preset`."""
        if not isinstance(data, dict):
            raise TypeError(
                f"Policy.from_dict needs the dict written by Policy.to_dict, got {type(data).__name__}"
            )
        missing = {"opt_level", "dtype", "device_type"} - data.keys()
        if missing:
            raise ValueError(f"policy dict lacks {sorted(missing)}; write it with Policy.to_dict()")
        return cls(
            opt_level=data["opt_level"],
            dtype=_check_low_dtype(data["dtype"]),
            device_type=data["device_type"],
            keep_batchnorm_fp32=data.get("keep_batchnorm_fp32", False),
            cast_model_outputs=_check_output_dtype(data.get("cast_model_outputs")),
            **{flag: data.get(flag, False) for flag in cls.fusion_flags()},
            op_rules={
                op: OpRule(_check_rule(entry["rule"]), entry.get("reason", ""))
                for op, entry in data.get("op_rules", {}).items()
            },
            global_rule=data.get("global", Rule.PASSTHROUGH.value),
            op_overrides=dict(data.get("op_overrides", {})),
            module_type_overrides={
                _import_type(path): rule for path, rule in data.get("module_type_overrides", {}).items()
            },
            module_name_regex_overrides=[
                tuple(entry) for entry in data.get("module_name_regex_overrides", [])
            ],
            module_name_overrides=dict(data.get("module_name_overrides", {})),
        )

    def __str__(self) -> str:
        outputs = "as computed" if self.cast_model_outputs is None else dtype_name(self.cast_model_outputs)
        lines = [
            f"Policy {self.opt_level} dtype={dtype_name(self.dtype)} device_type={self.device_type} "
            f"keep_batchnorm_fp32={self.keep_batchnorm_fp32} cast_model_outputs={outputs} "
            + " ".join(f"{flag}={getattr(self, flag)}" for flag in self.fusion_flags()),
            f"  cast_parameters={self.cast_parameters} cast_inputs_dtype="
            f"{None if self.cast_inputs_dtype is None else dtype_name(self.cast_inputs_dtype)} "
            f"autocast_opaque={self.autocast_opaque}",
            f"  global: {self.global_rule.value}",
        ]
        by_rule: dict[Rule, list[str]] = {}
        for op, entry in self.op_rules.items():
            by_rule.setdefault(entry.rule, []).append(op)
        for rule in Rule:
            if rule in by_rule:
                lines.append(f"  {rule.value:<12} {', '.join(sorted(by_rule[rule]))}")
        overrides = [
            *(f"op {op!r}" for op in self.op_overrides),
            *(f"module type {cls.__qualname__}" for cls in self.module_type_overrides),
            *(f"module name regex {p!r}" for p, _ in self.module_name_regex_overrides),
            *(f"module name {n!r}" for n in self.module_name_overrides),
        ]
        rules = [
            *self.op_overrides.values(),
            *self.module_type_overrides.values(),
            *(rule for _, rule in self.module_name_regex_overrides),
            *self.module_name_overrides.values(),
        ]
        if overrides:
            lines.append("  overrides (lowest precedence first):")
            lines.extend(
                f"    {what:<40} -> {rule.value}" for what, rule in zip(overrides, rules, strict=True)
            )
        return "\n".join(lines)


# The fused-kernel switches, in field order (a flag's `needs` comes before it).
_FUSION_FLAGS = tuple(flag for flag in dataclasses.fields(Policy) if flag.metadata.get("fusion"))


def _preset_op_rules(opt_level: str, device_type: str | None, keep_batchnorm_fp32: bool) -> dict[str, OpRule]:
    # O1 follows its device's autocast lists, so without a device type they wait for `for_device`.
    if opt_level == "O0" or (opt_level == "O1" and device_type is None):
        return {}
    if opt_level == "O1":
        return _o1_op_rules(autocast_op_lists(device_type))
    return _low_op_rules(opt_level, keep_batchnorm_fp32)


def _check_fusion_flag_names(flags: dict[str, Any]) -> None:
    unknown = sorted(set(flags) - set(Policy.fusion_flags()))
    if unknown:
        close = difflib.get_close_matches(unknown[0], Policy.fusion_flags(), n=1)
        suggestion = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"preset got unknown keyword {short_repr(unknown[0])}{suggestion} The fused-kernel "
            f"switches are {', '.join(Policy.fusion_flags())}"
        )


def preset(
    opt_level: str,
    dtype: torch.dtype = torch.float16,
    device_type: str | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    **fusion_flags: bool | None,
) -> Policy:
    """The policy for an Apex opt level; see `Policy` for the table.

    `device_type` ("cuda" or "cpu") picks O1's autocast op lists and the fused kernels' defaults;
    None (the default) leaves both to `amp_fx.convert`, which takes the model's device type.
    `keep_batchnorm_fp32` defaults to True for O2 and False otherwise (Apex also accepts the strings
    "True"/"False"); `cast_model_outputs` defaults to float32 for O2/O3 (losses computed in fp32, as
    in Apex) and None (outputs as computed) for O0/O1. The fused-kernel switches
    (`Policy.fusion_flags`: ``fused_losses``, ``fused_linear_loss``, ``fused_batch_norm``,
    ``fused_max_pool``) are True or False, or None for the default: ``fused_losses`` on for O2,
    the others for O2 on CUDA only.

    >>> p = preset("O2", dtype=torch.bfloat16)
    >>> p.cast_parameters, p.keep_batchnorm_fp32, p.cast_model_outputs, p.fused_losses
    (True, True, torch.float32, True)
    >>> p.fused_max_pool is None, p.for_device("cuda").fused_max_pool, p.for_device("cpu").fused_max_pool
    (True, True, False)
    """
    _check_fusion_flag_names(fusion_flags)
    level = check_opt_level(opt_level)
    low = _check_low_dtype(dtype)
    device = None if device_type is None else _check_device_type(device_type)
    keep_bn = (
        (level == "O2") if keep_batchnorm_fp32 is None else _check_keep_batchnorm_fp32(keep_batchnorm_fp32)
    )
    outputs = _check_output_dtype(cast_model_outputs)
    if outputs is None and level in ("O2", "O3"):
        outputs = torch.float32
    op_rules = _preset_op_rules(level, device, keep_bn)
    policy = Policy(
        opt_level=level,
        dtype=low,
        device_type=device,
        keep_batchnorm_fp32=keep_bn,
        cast_model_outputs=outputs,
        # None asks the policy for the opt level's (and device's) default.
        **{flag: fusion_flags.get(flag) for flag in Policy.fusion_flags()},
        op_rules=op_rules,
    )
    logger.debug("preset %s dtype=%s device_type=%s: %d op rules", level, low, device, len(op_rules))
    return policy
