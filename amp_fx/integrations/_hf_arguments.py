"""What `AmpTrainer` trains with, decided from its own arguments and the ``TrainingArguments``,
and everything it refuses, checked before the Trainer is built.

A ``policy=`` decides opt level and dtype; without one, ``fp16=True`` / ``bf16=True`` pick the
dtype, else ``dtype=`` (default torch.float16, as `amp_fx.convert`), at ``opt_level`` (default
"O2"). Only a contradiction between them is refused. The opt level's row of Apex's table decides
the rest: FP32 masters (O2) and a dynamic loss scale (fp16 at O1/O2).

    >>> from transformers import TrainingArguments
    >>> args = TrainingArguments("out", bf16=True, use_cpu=True, report_to=[])
    >>> setup = resolve(args, opt_level="O2", dtype=None, policy=None)
    >>> setup.dtype, setup.master_weights, setup.scaled
    (torch.bfloat16, True, False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import amp_fx
from amp_fx.core.dtypes import low_precision_dtype
from amp_fx.core.opt_levels import lookup_opt_level


@dataclasses.dataclass(frozen=True)
class AmpSetup:
    """How `AmpTrainer` converts and trains: the policy it converts with and what its level implies."""

    opt_level: str
    dtype: torch.dtype
    # The user's policy, or None: `policy_for` then builds the preset of opt_level and dtype.
    policy: amp_fx.Policy | None
    # The optimizer keeps FP32 masters of the low-precision parameters (Apex's O2).
    master_weights: bool
    # fp16 at a level with a dynamic loss scale (O1, O2): the loss is scaled and overflows skip.
    scaled: bool

    def policy_for(self, device_type: str) -> amp_fx.Policy:
        """The policy `amp_fx.convert` gets, for the device the model trains on."""
        policy = self.policy if self.policy is not None else amp_fx.preset(self.opt_level, self.dtype)
        return policy.for_device(device_type) if policy.device_type is None else policy


def _flag_dtype(args: Any) -> tuple[str | None, torch.dtype | None]:
    if args is None:
        return None, None
    if getattr(args, "fp16", False):
        return "fp16=True", torch.float16
    if getattr(args, "bf16", False):
        return "bf16=True", torch.bfloat16
    return None, None


def resolve(args: Any, opt_level: str | None, dtype: torch.dtype | str | None, policy: Any) -> AmpSetup:
    """Check AmpTrainer's ``opt_level``, ``dtype`` and ``policy`` against ``args`` (TrainingArguments
    or None) and return the setup; raise TypeError/ValueError naming the fix."""
    if policy is not None and not isinstance(policy, amp_fx.Policy):
        raise TypeError(
            f"policy must be an amp_fx.Policy (e.g. amp_fx.preset('O2', torch.bfloat16).set_op(...)), got "
            f"{type(policy).__name__}"
        )
    if dtype is not None:
        dtype = low_precision_dtype(dtype)
    flag, flag_dtype = _flag_dtype(args)
    if policy is not None:
        if opt_level is not None and opt_level != policy.opt_level:
            raise ValueError(
                f"opt_level={opt_level!r} contradicts the policy's {policy.opt_level!r}; the policy decides: "
                "leave opt_level out"
            )
        if dtype is not None and dtype != policy.dtype:
            raise ValueError(
                f"dtype={dtype} contradicts the policy's {policy.dtype}; the policy decides: leave dtype out"
            )
        if flag is not None and flag_dtype != policy.dtype:
            raise ValueError(
                f"TrainingArguments has {flag} but the policy's dtype is {policy.dtype}: build the "
                f"policy with dtype={flag_dtype} or set the other flag"
            )
        device_type = args.device.type if args is not None else None
        if policy.device_type is not None and device_type is not None and policy.device_type != device_type:
            raise ValueError(
                f"the policy is for {policy.device_type!r} but the Trainer trains on {device_type!r}: build "
                "it without device_type (amp_fx.preset(...) takes the Trainer's device)"
            )
        opt_level, dtype = policy.opt_level, policy.dtype
    else:
        if flag is not None and dtype is not None and dtype != flag_dtype:
            other = "bf16=True" if dtype == torch.bfloat16 else "fp16=True"
            raise ValueError(
                f"TrainingArguments has {flag} but AmpTrainer got dtype={dtype}: pass one of them (the flag "
                f"alone picks the dtype), or set {other} instead"
            )
        opt_level = "O2" if opt_level is None else opt_level
        dtype = flag_dtype or dtype or torch.float16
        amp_fx.preset(opt_level, dtype)  # an unknown opt level raises here, naming the valid ones
    level = lookup_opt_level(opt_level)
    _refuse_unsupported_arguments(args)
    return AmpSetup(
        opt_level=level.name,
        dtype=dtype,
        policy=policy,
        master_weights=level.keeps_fp32_masters,
        scaled=dtype == torch.float16 and level.dynamic_loss_scale,
    )


def _refuse_unsupported_arguments(args: Any) -> None:
    """TrainingArguments that would undo the conversion or bypass amp_fx's optimizer."""
    if args is None:
        return
    for flag in ("fp16_full_eval", "bf16_full_eval"):
        if getattr(args, flag, False):
            raise ValueError(
                f"{flag}=True casts the whole model to one dtype for evaluation, undoing the conversion (its "
                f"FP32 norms too); AmpTrainer already evaluates the converted model: leave {flag} out"
            )
    if getattr(args, "use_liger_kernel", False):
        raise ValueError(
            "use_liger_kernel=True replaces the model's code with Liger's kernels, which amp_fx's graphs "
            "would not hold; AmpTrainer converts the model's own code: leave use_liger_kernel out"
        )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "AmpTrainer does not run under DeepSpeed, which brings its own mixed precision and optimizer; "
            "drop deepspeed= (DistributedDataParallel through torchrun works)"
        )
    if getattr(args, "fsdp", None):
        raise ValueError(
            "AmpTrainer does not run under the Trainer's FSDP; amp_fx shards with FSDP2 in its own loop "
            "(amp_fx.training.fsdp.fully_shard_converted, examples/fsdp2_torchrun.py): drop fsdp="
        )
    if args.n_gpu > 1:  # the Trainer would replicate the model with nn.DataParallel
        raise ValueError(
            f"{args.n_gpu} GPUs are visible to one process, where the Trainer uses nn.DataParallel, "
            "which AmpTrainer does not run under: launch with torchrun --nproc_per_node=N "
            "(DistributedDataParallel) or make one GPU visible (CUDA_VISIBLE_DEVICES=0)"
        )
