"""One bench_train variant's training step: its model (converted, cast or as is), optimizer,
scaler and forward + loss, built on a fresh workload of the command line's size.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from liger import patch_transformers
from models import LabelsLoss, WithLoss, Workload, build_workload, hf_model_type, with_loss
from torch import nn
from train_variants import Variant

GPT_ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
RESNET_SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
# Eager steps CudaGraphStep runs before it captures; the benchmark's warm-up covers them and the capture.
GRAPH_WARMUP_STEPS = 2


def make_optimizer(variant: Variant, work: Workload, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """torch's fused AdamW/SGD for the torch variants, amp_fx's FusedAdam/FusedSGD for amp_fx's."""
    if variant.framework == "amp_fx":
        import amp_fx.optim

        # FP32 masters where the weights are stored low and updated by the optimizer (O2); O1's
        # weights are fp32 already and O3 has none by definition.
        masters = variant.opt_level == "O2"
        if work.optimizer == "adamw":
            return amp_fx.optim.FusedAdam(params, adam_w_mode=True, master_weights=masters, **GPT_ADAMW)
        return amp_fx.optim.FusedSGD(params, master_weights=masters, **RESNET_SGD)
    if work.optimizer == "adamw":
        return torch.optim.AdamW(params, fused=True, **GPT_ADAMW)
    return torch.optim.SGD(params, fused=True, **RESNET_SGD)


def make_scaler(variant: Variant, device: torch.device) -> object | None:
    if variant.framework == "amp_fx":
        import amp_fx

        return amp_fx.LossScaler(enabled=variant.uses_loss_scaling)
    if variant.uses_loss_scaling:
        return torch.amp.GradScaler(device.type)
    return None


def prepare_model(variant: Variant, work: Workload) -> nn.Module:
    """What the variant trains, ``(inputs, targets) -> loss``: the model with its loss as is,
    `.half()`-ed, or amp_fx-converted (with the loss, or without it for ``loss_outside``)."""
    if variant.framework == "amp_fx":
        import amp_fx

        device_type = work.inputs.device.type
        # The variant's False turns a fusion off; True leaves the preset's default.
        policy = amp_fx.preset(
            variant.opt_level,
            variant.dtype,
            device_type,
            fused_batch_norm=None if variant.fused_batch_norm else False,
            fused_max_pool=None if variant.fused_max_pool else False,
            fused_linear_loss=None if variant.fused_linear_loss else False,
            low_precision_residual=variant.low_precision_residual,
        )
        if work.loss_fn is None:
            # The model computes its loss (a transformers LM): converted as a user converts it.
            if variant.loss_outside:
                raise ValueError(
                    f"{variant.name} needs the loss outside; {work.name} computes its own (labels=)"
                )
            return LabelsLoss(amp_fx.convert(work.model, variant.opt_level, policy=policy))
        if variant.loss_outside:
            return WithLoss(amp_fx.convert(work.model, variant.opt_level, policy=policy), work.loss_fn)
        return amp_fx.convert(WithLoss(work.model, work.loss_fn), variant.opt_level, policy=policy)
    model = with_loss(work.model, work.loss_fn)
    if not variant.autocast and variant.dtype != torch.float32:
        return model.to(variant.dtype)
    return model


def make_forward_loss(
    variant: Variant, model: nn.Module
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """forward + loss as one function, the region torch.compile compiles."""

    def forward_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if variant.autocast:
            with torch.autocast(inputs.device.type, dtype=variant.dtype):
                return model(inputs, targets)
        return model(inputs, targets)

    return forward_loss


def build_step(
    variant: Variant, work: Workload, mode: str, compile_backend: str, compile_mode: str | None = None
) -> Callable[[], torch.Tensor]:
    """Return a function that runs one full training step on the workload's batch (``mode``
    "compile": forward and loss compiled with ``compile_backend``, in ``compile_mode``; None is
    torch's default)."""
    model = prepare_model(variant, work)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(variant, work, params)
    scaler = make_scaler(variant, work.inputs.device)
    forward_loss = make_forward_loss(variant, model)
    inputs = work.inputs
    if mode == "compile":
        if variant.framework == "amp_fx":
            # One eager call captures the torch.export front end's graph first: a capture during
            # a compiled call is a graph break inside the model, and its compiled code keeps it.
            forward_loss(inputs, work.targets)
        forward_loss = torch.compile(forward_loss, backend=compile_backend, mode=compile_mode)
    if variant.framework == "torch" and not variant.autocast and inputs.is_floating_point():
        inputs = inputs.to(variant.dtype)  # `.half()` models take fp16 images
    targets = work.targets

    if variant.cuda_graph:
        from amp_fx.training.cuda_graph_step import CudaGraphStep

        graph_step = CudaGraphStep(forward_loss, optimizer, scaler, warmup_steps=GRAPH_WARMUP_STEPS)
        return lambda: graph_step(inputs, targets)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_loss(inputs, targets)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss

    return step


def make_workload(
    model_name: str,
    args: argparse.Namespace,
    device: torch.device,
    kv_cache: bool = True,
    liger: bool = False,
) -> Workload:
    """A fresh, seeded workload of the command line's size (--small, --batch-size, --seq-len)."""
    if liger:
        patch_transformers(hf_model_type(model_name))
    workload = build_workload(
        model_name, device, small=args.small, batch_size=args.batch_size, seq_len=args.seq_len
    )
    # Only a transformers config has use_cache (bench_train's own GPT fills no cache).
    if (args.no_kv_cache or not kv_cache) and hasattr(getattr(workload.model, "config", None), "use_cache"):
        workload.model.config.use_cache = False  # the comparison row; people call the default
    return workload
