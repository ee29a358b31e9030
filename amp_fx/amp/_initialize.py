"""``amp.initialize``: Apex's entry point, with Apex's arguments, defaults, checks and return shapes.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    [model1, model2], optimizer = amp.initialize([model1, model2], optimizer, opt_level="O1")
    model = amp.initialize(model, opt_level="O3")          # inference: no optimizer

What happens, in order, nothing changing before every check passed:

1. The opt level's property table and the overrides (`amp_fx.amp._properties`), checked as Apex
   did; the result is logged at INFO (logger "amp_fx.amp") when ``verbosity >= 1``.
2. Each model is converted with `amp_fx.convert` (a new GraphModule; the model passed in is left
   as it was) and gets FP32 checkpoints and `amp.disable_casts` support (`amp_fx.amp._model`).
3. Each optimizer is pointed at the converted model's parameters and, where the opt level asks for
   master weights, at FP32 masters (`amp_fx.amp._master_weights`): any torch.optim optimizer works;
   amp_fx's fused optimizers keep their own masters.
4. One loss scaler per loss (``num_losses``), dynamic or static (`amp_fx.amp._scaler`).
5. At O1 (``patch_torch_functions``), torch's functions that autocast runs in FP32 run in FP32
   outside the model too, as Apex patched them, until another ``initialize``
   (`amp_fx.amp._fp32_functions`).

Unlike Apex, ``initialize`` may be called again for other models and optimizers: each call keeps
its own scalers, and the optimizers it returned keep using them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from amp_fx.amp import _fp32_functions as fp32_functions
from amp_fx.amp._master_weights import (
    AmpOptimizer,
    OptimizerKind,
    amp_optimizer_of,
    install_amp_optimizer,
    optimizer_kind,
)
from amp_fx.amp._model import convert_model, install_disable_casts, install_fp32_state_dict
from amp_fx.amp._properties import (
    LOW_PRECISION_DTYPES,
    OPT_LEVEL_BRIEF,
    AmpConfigError,
    Properties,
    check_loss_scale_bounds,
    check_opt_level,
    opt_level_defaults,
    resolve_properties,
)
from amp_fx.amp._state import AmpSession, set_current_session
from amp_fx.core.dtypes import low_precision_dtype

logger = logging.getLogger("amp_fx.amp")


def _check_models(models: Any) -> tuple[list[nn.Module], bool]:
    if isinstance(models, nn.Module):
        models_list, was_list = [models], False
    elif isinstance(models, (list, tuple)) and models:
        models_list, was_list = list(models), True
    else:
        raise TypeError(
            f"models must be a torch.nn.Module or a non-empty list of them, got {type(models).__name__}"
        )
    for index, model in enumerate(models_list):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise AmpConfigError(
                f"model {index} is wrapped in {type(model).__name__}; wrap the model(s) AFTER amp.initialize "
                f"returns them: model = {type(model).__name__}(amp.initialize(model.module, ...))"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"model {index} is a {type(model).__name__}, not a torch.nn.Module")
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.dtype in LOW_PRECISION_DTYPES:
                raise AmpConfigError(
                    f"model {index} has {name} in {tensor.dtype}; amp.initialize casts the model itself, so "
                    "pass the FP32 model (you do not need to call .half() on it, at any opt level)"
                )
    return models_list, was_list


def _check_optimizers(optimizers: Any) -> tuple[list[torch.optim.Optimizer], bool]:
    if optimizers is None:
        return [], False
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers_list, was_list = [optimizers], False
    elif isinstance(optimizers, (list, tuple)):
        optimizers_list, was_list = list(optimizers), True
    else:
        raise TypeError(
            f"optimizers must be a torch.optim.Optimizer or a list of them, got {type(optimizers).__name__}"
        )
    for index, optimizer in enumerate(optimizers_list):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer {index} is a {type(optimizer).__name__}, not a torch.optim.Optimizer")
        if amp_optimizer_of(optimizer) is not None:
            raise AmpConfigError(
                f"optimizer {index} ({type(optimizer).__name__}) was already returned by amp.initialize; "
                "build a new optimizer from the new model's parameters and pass that"
            )
    if len({id(o) for o in optimizers_list}) != len(optimizers_list):
        raise AmpConfigError("the same optimizer appears twice in optimizers; pass each one once")
    return optimizers_list, was_list


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AmpConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_dtype(dtype: Any, cast_model_type: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    try:
        dtype = low_precision_dtype(dtype)
    except ValueError as error:
        raise AmpConfigError(str(error)) from None
    if cast_model_type in LOW_PRECISION_DTYPES and cast_model_type != dtype:
        raise AmpConfigError(
            f"dtype={dtype} and cast_model_type={cast_model_type} disagree; pass one of them"
        )
    return dtype


def _check_output_dtype(cast_model_outputs: Any) -> torch.dtype | None:
    if cast_model_outputs is None:
        return None
    if not isinstance(cast_model_outputs, torch.dtype) or not cast_model_outputs.is_floating_point:
        raise AmpConfigError(
            f"cast_model_outputs must be a floating torch.dtype (e.g. torch.float32) or None, "
            f"got {cast_model_outputs!r}"
        )
    return cast_model_outputs


def _log_properties(title: str, properties: Properties) -> None:
    logger.info(title)
    for name, value in properties.items():
        logger.info("%-22s : %s", name, value)


def _return(
    models: list[Any], models_was_list: bool, optimizers: list[Any], optimizers_was_list: bool
) -> Any:
    model_result = models if models_was_list else models[0]
    if optimizers_was_list:
        return model_result, optimizers
    if not optimizers:
        return model_result
    return model_result, optimizers[0]


def initialize(
    models: nn.Module | list[nn.Module],
    optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    dtype: torch.dtype | str | None = None,
) -> Any:
    """Convert model(s) and prepare optimizer(s) for mixed-precision training, as Apex's ``amp.initialize``.

    Every argument has Apex's meaning and default; property overrides that are not None are
    checked against the opt level as Apex did (an `AmpConfigError`, a ValueError and
    RuntimeError, names the problem and the fix). amp_fx adds one keyword, ``dtype``: the
    low-precision type, torch.float16 (default) or torch.bfloat16 or a name of one ("fp16", "bf16",
    "half", ...: as `amp_fx.convert`), for every opt level (Apex only had fp16; at O2/O3
    ``cast_model_type=torch.bfloat16`` says the same).

    Returns the converted model(s) and the optimizer(s), shaped like the arguments: a model or
    a list, then an optimizer or a list (nothing when ``optimizers`` is None). With
    ``enabled=False`` everything is returned as it came and every amp call becomes a no-op.

    Example:
        >>> import torch
        >>> from amp_fx import amp
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        >>> model(torch.randn(2, 4)).dtype, optimizer.param_groups[0]["params"][0].dtype
        (torch.float32, torch.float32)
        >>> model.state_dict()["0.weight"].dtype
        torch.float32
    """
    # ---- every check first: nothing changes if one fails ------------------------------------
    if not isinstance(enabled, bool):
        raise AmpConfigError(f"enabled must be True or False, got {enabled!r}")
    verbosity = _check_int("verbosity", verbosity, 0)
    models_list, models_was_list = _check_models(models)
    optimizers_list, optimizers_was_list = _check_optimizers(optimizers)
    if not enabled:
        set_current_session(AmpSession(Properties(enabled=False), num_losses=0, verbosity=verbosity))
        fp32_functions.restore()
        return models if optimizers is None else (models, optimizers)

    num_losses = _check_int("num_losses", num_losses, 1)
    check_opt_level(opt_level)
    properties = resolve_properties(
        opt_level,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
    )
    low_dtype = _check_dtype(dtype, cast_model_type)
    if properties.cast_model_type in LOW_PRECISION_DTYPES:
        if low_dtype is not None:  # dtype= picks the low type of O2/O3's cast_model_type
            properties = dataclasses.replace(properties, cast_model_type=low_dtype)
        low_dtype = properties.cast_model_type
    low_dtype = low_dtype or torch.float16
    output_dtype = _check_output_dtype(cast_model_outputs)
    min_loss_scale, max_loss_scale = check_loss_scale_bounds(min_loss_scale, max_loss_scale)

    if verbosity >= 1:
        logger.info("Selected optimization level %s", OPT_LEVEL_BRIEF[opt_level])
        _log_properties("Defaults for this optimization level are:", opt_level_defaults(opt_level))
        logger.info("Processing user overrides (additional kwargs that are not None)...")
        _log_properties("After processing overrides, optimization options are:", properties)

    # ---- convert the models (a failure here leaves models and optimizers untouched) ----------
    session = AmpSession(properties, num_losses, verbosity, min_loss_scale, max_loss_scale)
    converted = [convert_model(model, properties, low_dtype, output_dtype) for model in models_list]
    for model, gm in zip(models_list, converted, strict=True):
        converted_params = dict(gm.named_parameters(remove_duplicate=False))
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in converted_params:
                session.add_param_mapping(param, converted_params[name])

    # ---- the optimizers ------------------------------------------------------------------------
    for index, optimizer in enumerate(optimizers_list):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params and not any(session.owns(p) for p in params):
            raise AmpConfigError(
                f"none of optimizer {index}'s parameters belongs to the model(s) passed to amp.initialize; "
                "build the optimizer from model.parameters() of the model you pass"
            )
    kinds = [optimizer_kind(optimizer, properties.master_weights) for optimizer in optimizers_list]
    for optimizer in optimizers_list:
        AmpOptimizer.check_installable(optimizer, session.map_param)
    for optimizer, kind in zip(optimizers_list, kinds, strict=True):
        amp_optimizer = install_amp_optimizer(
            optimizer,
            kind,
            session.map_param,
            session,
            master_weights=properties.master_weights if kind is OptimizerKind.FUSED else None,
        )
        session.optimizers.append(amp_optimizer)
        logger.debug("optimizer %s: %s", type(optimizer).__name__, kind.value)

    for gm in converted:
        install_fp32_state_dict(gm, session)
        install_disable_casts(gm)
    set_current_session(session)
    if properties.patch_torch_functions:
        fp32_functions.patch(session)  # Apex's O1: losses and softmaxes outside the model in FP32
    else:
        fp32_functions.restore()
    return _return(converted, models_was_list, optimizers_list, optimizers_was_list)
