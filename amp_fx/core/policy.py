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
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_fx.core.dtypes import dtype_name, short_repr
from amp_fx.core.fusions import FUSIONS, Fusion, lookup_fusion
from amp_fx.core.op_lists import PASSTHROUGH_OPS, canonical_op_name
from amp_fx.core.opt_levels import OPT_LEVEL_TABLE, OptLevel, check_opt_level, lookup_opt_level
from amp_fx.core.policy_checks import (
    check_device_type,
    check_flag,
    check_fp8,
    check_fp8_device,
    check_fp8_skip_modules,
    check_keep_batchnorm_fp32,
    check_low_dtype,
    check_low_precision_residual,
    check_module_type,
    check_op,
    check_output_dtype,
    check_regex,
    check_rule,
)
from amp_fx.core.policy_serialization import policy_fields_from_dict, policy_fields_to_dict
from amp_fx.core.preset_rules import BATCH_NORM_OPS, LOW_PRECISION_RESIDUAL_OPS, preset_op_rules
from amp_fx.core.rules import Decision, OpRule, Rule

# Rule and Decision are the policy's vocabulary, imported from here with it (amp_fx.Rule).
__all__ = ["Decision", "Policy", "Rule", "preset"]

logger = logging.getLogger(__name__)


def _fusion_flag(flag: str) -> Any:
    """The `Policy` field of the fused kernel `flag` (its row of `amp_fx.core.fusions`): False unless
    set; None asks for its default (`Policy._fusion_default`)."""
    return field(default=False, metadata={"fusion": lookup_fusion(flag)})


@dataclass(eq=True)
class Policy:
    """An opt-level policy: presets per op plus QConfigMapping-style user overrides.

    Build one with `preset`; override with the chainable ``set_global``, ``set_op``,
    ``set_module_type``, ``set_module_name_regex`` and ``set_module_name``. Precedence, lowest first:
    global < preset op rule < op override < module-type override < module-name regex (first
    matching pattern wins) < exact module name.

    What each opt level does (its row of `amp_fx.core.opt_levels` says it field by field):

    - O0: everything PASSTHROUGH, no casts: the identity.
    - O1: torch.autocast's lists for `device_type` (lower -> LOWER, fp32/fp32_set_opt_dtype -> FP32,
      promote -> PROMOTE, the rest PASSTHROUGH); parameters untouched. Ops that autocast changes
      although no list names them (``einsum`` on CPU calls ``bmm``) and untraced code run in an
      autocast island (OPAQUE), so O1 on CPU matches ``torch.autocast("cpu")`` bit for bit.
    - O2: parameters stored low, floating inputs cast low where the first op that runs low reads
      them (``cast_inputs_at_entry=True``: at the model entry, as Apex), matmul/conv ops LOWER, promote
      ops PROMOTE, the FP32 islands of `preset_rules.FP32_ISLANDS` (softmax, losses, exp/log/pow, sums, norms)
      FP32, everything else PASSTHROUGH. batch_norm (``keep_batchnorm_fp32``, default True) keeps
      fp32 params and runs on low input (mixed input works in cuDNN and on CPU), so it needs no
      casts; norms (layer/group/RMS) and embeddings run in FP32 on FP32 params, as under autocast.
    - O3: parameters low (BatchNorm too unless ``keep_batchnorm_fp32=True``), no FP32 islands,
      inputs cast low at the model entry.

    ``cast_inputs_at_entry`` (default True at O3 only; no effect at O0/O1): floating model inputs are
    cast to the low dtype at the graph's entry, as Apex's O2 did. Off, an input is cast where the first
    op that runs in the low dtype (a matmul, a convolution, untraced code) reads it, or a value computed
    from it by ops that run in FP32 or pass their dtype through (statistics, norms, subtraction and
    division by them, comparisons, losses): a series standardised by its own mean and std keeps its
    signal. An input a matmul or convolution reads first is cast there, once, as at the entry.

    The fused-kernel switches (`fusion_flags`) are the rows of `amp_fx.core.fusions.FUSIONS`, whose
    ``description`` says what each fuses. Each is True or False, or None for its default: on where the
    opt level fuses kernels (O2; `OptLevel.fuses_kernels`), on CUDA only for a ``cuda_only`` row (its
    kernels are for GPUs), and only where the switch its row ``needs`` is on.

    ``low_precision_residual`` (default False; O2 only, opt-in): embedding tables are stored and
    read low (`preset_rules.LOW_PRECISION_RESIDUAL_OPS`), so a transformer's residual stream and its
    adds run in the low dtype as in a model cast with ``.to(dtype)``, and the fused add + norm calls
    read and write a low stream; norms keep FP32 math and FP32 weights, the optimizer FP32 masters.
    Faster (half the stream's bytes), further from FP32 than autocast (docs/DESIGN.md, "Fused norms").
    ``fp8`` (default None; O2 only, opt-in): the name of an FP8 recipe (``"tensorwise"``,
    ``"rowwise"``, ``"rowwise_hp_wgrad"``: `amp_fx.kernels.fp8.recipes`); each linear layer the
    policy runs low then runs its three products through `amp_fx.ops.fp8_linear.fp8_linear`
    (`amp_fx.passes.use_fp8_linears` says which: not the model's output layers unless
    ``fp8_head=True``, not a module ``fp8_skip_modules`` matches, not a size CUDA refuses).

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
    # The fused kernels, one per row of `amp_fx.core.fusions` (see `fusion_flags`); None while their
    # default waits for the device type.
    fused_losses: bool | None = _fusion_flag("fused_losses")
    fused_linear_loss: bool | None = _fusion_flag("fused_linear_loss")
    fused_batch_norm: bool | None = _fusion_flag("fused_batch_norm")
    fused_max_pool: bool | None = _fusion_flag("fused_max_pool")
    fused_chunked_linear_loss: bool | None = _fusion_flag("fused_chunked_linear_loss")
    fused_activations: bool | None = _fusion_flag("fused_activations")
    fused_rotary: bool | None = _fusion_flag("fused_rotary")
    fused_norms: bool | None = _fusion_flag("fused_norms")
    # Training graphs keep the logits they return instead of fusing their head with the loss.
    keep_logits: bool = False
    # Floating inputs cast low at the graph's entry (Apex); None: the opt level's default.
    cast_inputs_at_entry: bool | None = None
    # Opt-in (O2): the residual stream in the low dtype (embedding tables stored low).
    low_precision_residual: bool = False
    # Opt-in (O2): linear layers' products in FP8 with this recipe (`use_fp8_linears`); the model's
    # output layers too with fp8_head; never the modules fp8_skip_modules matches (re.fullmatch).
    fp8: str | None = None
    fp8_head: bool = False
    fp8_skip_modules: list[str] = field(default_factory=list)
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
        self.dtype = check_low_dtype(self.dtype)
        if self.device_type is not None:
            self.device_type = check_device_type(self.device_type)
        self.keep_batchnorm_fp32 = check_keep_batchnorm_fp32(self.keep_batchnorm_fp32)
        self.cast_model_outputs = check_output_dtype(self.cast_model_outputs)
        for fusion in FUSIONS:  # in the table's order: a flag's `needs` is decided before it
            setattr(self, fusion.flag, self._fusion_default(fusion, getattr(self, fusion.flag)))
        self.keep_logits = check_flag("keep_logits", self.keep_logits)
        self.cast_inputs_at_entry = (
            self.level.casts_inputs_at_entry
            if self.cast_inputs_at_entry is None
            else check_flag("cast_inputs_at_entry", self.cast_inputs_at_entry)
        )
        self.low_precision_residual = check_low_precision_residual(
            self.low_precision_residual, self.opt_level, self.level.keeps_norms_fp32
        )
        mixes_low_and_fp32 = self.level.stores_weights_low and self.level.keeps_fp32_islands
        self.fp8 = check_fp8(self.fp8, self.opt_level, mixes_low_and_fp32, self.dtype)
        check_fp8_device(self.fp8, self.device_type)
        self.fp8_head = check_flag("fp8_head", self.fp8_head)
        self.fp8_skip_modules = check_fp8_skip_modules(self.fp8_skip_modules)
        self.global_rule = check_rule(self.global_rule)
        self.op_rules = {
            check_op(op): OpRule(check_rule(entry.rule), str(entry.reason))
            for op, entry in self.op_rules.items()
        }
        self.op_overrides = {check_op(op): check_rule(rule) for op, rule in self.op_overrides.items()}
        self.module_type_overrides = {
            check_module_type(cls): check_rule(rule) for cls, rule in self.module_type_overrides.items()
        }
        self.module_name_regex_overrides = [
            (check_regex(pattern), check_rule(rule)) for pattern, rule in self.module_name_regex_overrides
        ]
        self.module_name_overrides = {
            str(name): check_rule(rule) for name, rule in self.module_name_overrides.items()
        }

    def _fusion_default(self, fusion: Fusion, value: Any) -> bool | None:
        if value is not None:
            return check_flag(fusion.flag, value)
        if fusion.cuda_only and self.device_type is None:
            return None  # decided by `for_device`
        return (
            self.level.fuses_kernels
            and (not fusion.cuda_only or self.device_type == "cuda")
            and (fusion.needs is None or bool(getattr(self, fusion.needs)))
        )

    @classmethod
    def fusion_flags(cls) -> tuple[str, ...]:
        """The names of the fused-kernel switches, the flags of `amp_fx.core.fusions`, in field order.

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
        device = check_device_type(device_type)
        if self.device_type == device:
            return self
        if self.device_type is not None:
            raise ValueError(
                f"this policy is for device_type {self.device_type!r}, not {device!r}: build one for "
                f"{device!r} with amp_fx.preset(..., device_type={device!r})"
            )
        op_rules = {**preset_op_rules(self.level, device, self.keep_batchnorm_fp32), **self.op_rules}
        return dataclasses.replace(self, device_type=device, op_rules=op_rules)

    # ---- derived properties read by the passes ------------------------------------------------
    @property
    def level(self) -> OptLevel:
        """What the opt level does: its row of the opt-level table (`amp_fx.core.opt_levels`).

        >>> preset("O2").level.keeps_fp32_islands
        True
        """
        return OPT_LEVEL_TABLE[self.opt_level]

    @property
    def is_identity(self) -> bool:
        """True for O0 without overrides: convert leaves the graph's numerics unchanged.

        Overrides apply at O0 too (``preset("O0").set_module_name("head", Rule.LOWER)`` casts only
        around ``head``), and then the policy is no longer the identity.
        """
        return (
            not self.level.lowers_precision
            and self.global_rule is Rule.PASSTHROUGH
            and not self._has_overrides()
        )

    @property
    def stores_weights_low(self) -> bool:
        """True for O2/O3: parameters and floating buffers are stored in the low dtype (the opt
        level's `stores_weights_low`)."""
        return self.level.stores_weights_low

    @property
    def cast_inputs_dtype(self) -> torch.dtype | None:
        """The dtype floating model inputs are cast to (at the entry where ``cast_inputs_at_entry``,
        else where the first op that runs low reads them): low for O2/O3, None for O0/O1."""
        return self.dtype if self.stores_weights_low else None

    @property
    def entry_cast_dtype(self) -> torch.dtype | None:
        """The dtype floating model inputs are cast to at the graph's entry, or None where they are
        not cast there (O0/O1, or O2 casting each where its first lowered consumer reads it).

        >>> preset("O2").entry_cast_dtype, preset("O2", cast_inputs_at_entry=True).entry_cast_dtype
        (None, torch.float16)
        """
        return self.cast_inputs_dtype if self.cast_inputs_at_entry else None

    @property
    def autocast_opaque(self) -> bool:
        """True for O1/O2: OPAQUE nodes run inside ``torch.autocast(device_type, dtype)``."""
        return self.level.autocast_opaque

    # ---- overrides (chainable, like QConfigMapping) -------------------------------------------
    def set_global(self, rule: Rule | str) -> Policy:
        """Rule for ops that neither the preset nor an override names (default PASSTHROUGH)."""
        self.global_rule = check_rule(rule)
        return self

    def set_op(self, op: str, rule: Rule | str) -> Policy:
        """Rule for every call of `op` (any spelling: ``F.softmax``, ``x.softmax``, ``nn.Softmax``).

        >>> preset("O2").set_op("softmax", Rule.LOWER).decide("softmax").rule
        <Rule.LOWER: 'lower'>
        """
        name, checked = check_op(op), check_rule(rule)
        self.op_overrides[name] = checked
        return self

    def set_module_type(self, module_type: type, rule: Rule | str) -> Policy:
        """Rule for calls of modules of `module_type` (exact type, as QConfigMapping's object_type)."""
        cls, checked = check_module_type(module_type), check_rule(rule)
        self.module_type_overrides[cls] = checked
        return self

    def set_module_name_regex(self, pattern: str, rule: Rule | str) -> Policy:
        """Rule for modules whose qualified name matches `pattern` (``re.match``; first set wins)."""
        checked_pattern, checked = check_regex(pattern), check_rule(rule)
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
        self.module_name_overrides[name] = check_rule(rule)
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
        if self.low_precision_residual and op in LOW_PRECISION_RESIDUAL_OPS:
            return Rule.LOWER, f"{self.opt_level} {LOW_PRECISION_RESIDUAL_OPS[op]}"
        if op in self.op_rules:
            entry = self.op_rules[op]
            return entry.rule, entry.reason
        if not self.level.lowers_precision and self.global_rule is Rule.PASSTHROUGH:
            return Rule.PASSTHROUGH, f"{self.opt_level}: no casts (identity)"
        if op in PASSTHROUGH_OPS and self.global_rule is Rule.PASSTHROUGH:
            return Rule.PASSTHROUGH, f"{self.opt_level}: {op} is dtype-agnostic (runs on what flows in)"
        if self.level.uses_autocast_op_lists and self.device_type is None:
            raise ValueError(
                f"{self.opt_level}'s rule for {op!r} comes from the autocast op list of a device type, "
                "and this policy names none: pass device_type='cpu' or 'cuda' to preset, or use "
                "policy.for_device(...)"
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
        if not self.stores_weights_low:
            return None
        if rule is Rule.FP32:
            return torch.float32
        if op in BATCH_NORM_OPS and self.keep_batchnorm_fp32:
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
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return policy_fields_to_dict(fields, self.fusion_flags())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        """Rebuild a policy written by `to_dict`; every field is validated as in `preset`."""
        return cls(**policy_fields_from_dict(data, cls.fusion_flags()))

    def __str__(self) -> str:
        outputs = "as computed" if self.cast_model_outputs is None else dtype_name(self.cast_model_outputs)
        lines = [
            f"Policy {self.opt_level} dtype={dtype_name(self.dtype)} device_type={self.device_type} "
            f"keep_batchnorm_fp32={self.keep_batchnorm_fp32} cast_model_outputs={outputs} "
            + " ".join(f"{flag}={getattr(self, flag)}" for flag in self.fusion_flags())
            + f" keep_logits={self.keep_logits} low_precision_residual={self.low_precision_residual}"
            + f" cast_inputs_at_entry={self.cast_inputs_at_entry}"
            + f" fp8={self.fp8} fp8_head={self.fp8_head} fp8_skip_modules={self.fp8_skip_modules}",
            f"  stores_weights_low={self.stores_weights_low} cast_inputs_dtype="
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


# The fused-kernel switches, in field order.
_FUSION_FLAGS = tuple(flag for flag in dataclasses.fields(Policy) if "fusion" in flag.metadata)


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
    keep_logits: bool = False,
    low_precision_residual: bool = False,
    cast_inputs_at_entry: bool | None = None,
    fp8: str | None = None,
    fp8_head: bool = False,
    fp8_skip_modules: list[str] | tuple[str, ...] = (),
    **fusion_flags: bool | None,
) -> Policy:
    """The policy for an Apex opt level; see `Policy` for the table.

    `device_type` ("cuda" or "cpu") picks O1's autocast op lists and the fused kernels' defaults;
    None (the default) leaves both to `amp_fx.convert`, which takes the model's device type.
    `keep_batchnorm_fp32` defaults to True for O2 and False otherwise (Apex also accepts the strings
    "True"/"False"); `cast_model_outputs` defaults to float32 for O2/O3 (losses computed in fp32, as
    in Apex) and None (outputs as computed) for O0/O1. The fused-kernel switches
    (`Policy.fusion_flags`, one per row of `amp_fx.core.fusions`) are True or False, or None for the
    default: on for O2, those of ``cuda_only`` rows on CUDA only (see `Policy`).
    `keep_logits` (default False) keeps the logits a training graph returns (see `Policy`);
    `low_precision_residual` (default False, O2 only) runs the residual stream low (see `Policy`).
    `cast_inputs_at_entry` (default None: True at O3, False at O2) casts floating inputs low at the
    graph's entry, as Apex, instead of at their first lowered consumer (see `Policy`).
    `fp8` (default None; O2 only) names an FP8 recipe for the linear layers, `fp8_head` puts the
    model's output layers in FP8 too, `fp8_skip_modules` keeps the modules it matches out (see `Policy`).

    >>> p = preset("O2", dtype=torch.bfloat16)
    >>> p.stores_weights_low, p.keep_batchnorm_fp32, p.cast_model_outputs, p.fused_losses
    (True, True, torch.float32, True)
    >>> p.fused_max_pool is None, p.for_device("cuda").fused_max_pool, p.for_device("cpu").fused_max_pool
    (True, True, False)
    """
    _check_fusion_flag_names(fusion_flags)
    properties = lookup_opt_level(opt_level)
    level = properties.name
    low = check_low_dtype(dtype)
    device = None if device_type is None else check_device_type(device_type)
    keep_bn = (
        properties.keeps_batchnorm_fp32
        if keep_batchnorm_fp32 is None
        else check_keep_batchnorm_fp32(keep_batchnorm_fp32)
    )
    outputs = check_output_dtype(cast_model_outputs)
    if outputs is None and properties.casts_outputs_fp32:
        outputs = torch.float32
    op_rules = preset_op_rules(properties, device, keep_bn)
    policy = Policy(
        opt_level=level,
        dtype=low,
        device_type=device,
        keep_batchnorm_fp32=keep_bn,
        cast_model_outputs=outputs,
        keep_logits=keep_logits,
        low_precision_residual=low_precision_residual,
        cast_inputs_at_entry=cast_inputs_at_entry,
        fp8=fp8,
        fp8_head=fp8_head,
        fp8_skip_modules=fp8_skip_modules,
        # None asks the policy for the opt level's (and device's) default.
        **{flag: fusion_flags.get(flag) for flag in Policy.fusion_flags()},
        op_rules=op_rules,
    )
    logger.debug("preset %s dtype=%s device_type=%s: %d op rules", level, low, device, len(op_rules))
    return policy
