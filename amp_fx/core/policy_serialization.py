"""A `Policy` as a JSON-serializable dict and back: dtypes, rules and module types as strings.

`Policy.to_dict` and `Policy.from_dict` are the entry points; this module holds the mapping
between the dict and the policy's fields, which it takes and gives as keywords (it reads no
`Policy`, so the policy module alone imports the other).

    >>> import torch
    >>> type_path(torch.nn.Linear), import_type("torch.nn.Linear") is torch.nn.Linear
    ('torch.nn.modules.linear.Linear', True)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from amp_fx.core.dtypes import dtype_name
from amp_fx.core.policy_checks import check_low_dtype, check_output_dtype, check_rule
from amp_fx.core.rules import OpRule, Rule

__all__ = ["import_type", "policy_fields_from_dict", "policy_fields_to_dict", "type_path"]


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


def policy_fields_to_dict(fields: Mapping[str, Any], fusion_flags: tuple[str, ...]) -> dict[str, Any]:
    """`Policy.to_dict`'s dict of a policy's checked fields (field name -> value): every field, in
    a form `json.dumps` takes."""
    outputs = fields["cast_model_outputs"]
    return {
        "opt_level": fields["opt_level"],
        "dtype": dtype_name(fields["dtype"]),
        "device_type": fields["device_type"],
        "keep_batchnorm_fp32": fields["keep_batchnorm_fp32"],
        "cast_model_outputs": None if outputs is None else dtype_name(outputs),
        **{flag: fields[flag] for flag in fusion_flags},
        "keep_logits": fields["keep_logits"],
        "low_precision_residual": fields["low_precision_residual"],
        "cast_inputs_at_entry": fields["cast_inputs_at_entry"],
        "fp8": fields["fp8"],
        "fp8_head": fields["fp8_head"],
        "fp8_skip_modules": list(fields["fp8_skip_modules"]),
        "global": fields["global_rule"].value,
        "op_rules": {
            op: {"rule": e.rule.value, "reason": e.reason} for op, e in sorted(fields["op_rules"].items())
        },
        "op_overrides": {op: rule.value for op, rule in fields["op_overrides"].items()},
        "module_type_overrides": {
            type_path(cls): rule.value for cls, rule in fields["module_type_overrides"].items()
        },
        "module_name_regex_overrides": [[p, rule.value] for p, rule in fields["module_name_regex_overrides"]],
        "module_name_overrides": {name: rule.value for name, rule in fields["module_name_overrides"].items()},
    }


def policy_fields_from_dict(data: dict[str, Any], fusion_flags: tuple[str, ...]) -> dict[str, Any]:
    """The `Policy` constructor's keywords for a dict `policy_fields_to_dict` wrote (checked by `Policy`)."""
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
        fp8=data.get("fp8"),
        fp8_head=data.get("fp8_head", False),
        fp8_skip_modules=list(data.get("fp8_skip_modules", [])),
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
