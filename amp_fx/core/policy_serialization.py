"""A `Policy` as a JSON-serializable dict and back: dtypes, rules and module types as strings.

`Policy.to_dict` and `Policy.from_dict` are the entry points; this module holds the mapping
between the dict and the policy's fields.

    >>> import torch
    >>> type_path(torch.nn.Linear), import_type("torch.nn.Linear") is torch.nn.Linear
    ('torch.nn.modules.linear.Linear', True)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from amp_fx.core.dtypes import dtype_name
from amp_fx.core.policy_checks import check_low_dtype, check_output_dtype, check_rule
from amp_fx.core.rules import OpRule, Rule

if TYPE_CHECKING:
    from amp_fx.core.policy import Policy

__all__ = ["import_type", "policy_fields_from_dict", "policy_to_dict", "type_path"]


def type_path(cls: type) -> str:
    """The importable path of a module type, for a dict: ``"torch.nn.modules.linear.Linear"``."""
    if "<locals>" in cls.__qualname__:
        raise ValueError(
            f"cannot serialize module type {cls.__qualname__!r}: it is defined inside a function; "
            "define it at module level so from_dict can import it"
        )
    return f"{cls.__module__}.{cls.__qualname__}"


def import_type(path: str) -> type:
    """The class a `type_path` names, imported."""
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


def policy_to_dict(policy: Policy) -> dict[str, Any]:
    """`Policy.to_dict`'s dict: every field, in a form `json.dumps` takes."""
    return {
        "opt_level": policy.opt_level,
        "dtype": dtype_name(policy.dtype),
        "device_type": policy.device_type,
        "keep_batchnorm_fp32": policy.keep_batchnorm_fp32,
        "cast_model_outputs": None
        if policy.cast_model_outputs is None
        else dtype_name(policy.cast_model_outputs),
        **{flag: getattr(policy, flag) for flag in policy.fusion_flags()},
        "keep_logits": policy.keep_logits,
        "low_precision_residual": policy.low_precision_residual,
        "cast_inputs_at_entry": policy.cast_inputs_at_entry,
        "global": policy.global_rule.value,
        "op_rules": {
            op: {"rule": e.rule.value, "reason": e.reason} for op, e in sorted(policy.op_rules.items())
        },
        "op_overrides": {op: rule.value for op, rule in policy.op_overrides.items()},
        "module_type_overrides": {
            type_path(cls): rule.value for cls, rule in policy.module_type_overrides.items()
        },
        "module_name_regex_overrides": [[p, rule.value] for p, rule in policy.module_name_regex_overrides],
        "module_name_overrides": {name: rule.value for name, rule in policy.module_name_overrides.items()},
    }


def policy_fields_from_dict(data: dict[str, Any], fusion_flags: tuple[str, ...]) -> dict[str, Any]:
    """The `Policy` constructor's keywords for a dict `policy_to_dict` wrote (checked by `Policy`)."""
    if not isinstance(data, dict):
        raise TypeError(
            f"Policy.from_dict needs the dict written by Policy.to_dict, got {type(data).__name__}"
        )
    missing = {"opt_level", "dtype", "device_type"} - data.keys()
    if missing:
        raise ValueError(f"policy dict lacks {sorted(missing)}; write it with Policy.to_dict()")
    return dict(
        opt_level=data["opt_level"],
        dtype=check_low_dtype(data["dtype"]),
        device_type=data["device_type"],
        keep_batchnorm_fp32=data.get("keep_batchnorm_fp32", False),
        cast_model_outputs=check_output_dtype(data.get("cast_model_outputs")),
        **{flag: data.get(flag, False) for flag in fusion_flags},
        keep_logits=data.get("keep_logits", False),
        low_precision_residual=data.get("low_precision_residual", False),
        # Absent from dicts written before the field existed: the opt level's default.
        cast_inputs_at_entry=data.get("cast_inputs_at_entry"),
        op_rules={
            op: OpRule(check_rule(entry["rule"]), entry.get("reason", ""))
            for op, entry in data.get("op_rules", {}).items()
        },
        global_rule=data.get("global", Rule.PASSTHROUGH.value),
        op_overrides=dict(data.get("op_overrides", {})),
        module_type_overrides={
            import_type(path): rule for path, rule in data.get("module_type_overrides", {}).items()
        },
        module_name_regex_overrides=[tuple(entry) for entry in data.get("module_name_regex_overrides", [])],
        module_name_overrides=dict(data.get("module_name_overrides", {})),
    )
