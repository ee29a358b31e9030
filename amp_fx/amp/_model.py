"""What `amp.initialize` does to a model: convert it, give it FP32 checkpoints, honour disable_casts.

- The model is converted with `amp_fx.convert` at the opt level the properties describe
  (`convert_arguments`); the result is a GraphModule, so ``.train()``, ``.eval()``,
  ``.parameters()`` and ``.state_dict()`` work as before.
- Checkpoints are FP32 whatever the opt level: ``state_dict()`` returns, for each low-precision
  parameter, its FP32 master weight when an optimizer of the same ``amp.initialize`` keeps one
  (the exact training state), else the parameter upcast to FP32; low-precision buffers are
  upcast. Such a state dict loads into the original FP32 model. ``load_state_dict`` takes FP32
  (or low-precision) checkpoints, casts them into the model's dtypes, and sets the FP32 masters
  from the checkpoint's values, so the order in which model and optimizer are loaded does not
  matter.
- Inside ``with amp.disable_casts():`` the model computes in FP32 as the original model did: the
  casts amp_fx inserted are skipped, low-precision weights are upcast for the call (their grads
  flow back to them), and opaque modules run without their autocast island. This is the
  "what would FP32 give?" switch for debugging accuracy; it runs the graph node by node (an fx
  Interpreter), so it is slower than the converted model.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn

import amp_fx
from amp_fx.amp._properties import Properties
from amp_fx.amp._registry import apply_registered_functions
from amp_fx.capture.original_in_fp32 import running_original_in_fp32
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES, default_device_type
from amp_fx.core.node_info import META_KEY
from amp_fx.core.opt_levels import find_opt_level, lookup_opt_level
from amp_fx.core.policy import preset
from amp_fx.ops.autocast_island import AutocastIsland
from amp_fx.optim.model_load_hooks import follow_model_loads

logger = logging.getLogger("amp_fx.amp")

_casts_disabled = 0


@contextmanager
def disable_casts() -> Iterator[None]:
    """Run models returned by `amp.initialize` in FP32, without amp's casts, inside the block.

    Apex's ``disable_casts`` switched off O1's patched torch functions; here too, inside the block
    O1's FP32 functions run as torch's own (`amp_fx.amp._fp32_functions`), and each converted
    model computes as the original FP32 model would (see this module's docstring)::

        with amp.disable_casts():
            reference = model(inputs)   # FP32 compute, same weights
    """
    global _casts_disabled
    _casts_disabled += 1
    try:
        with running_original_in_fp32():  # models of the torch.export front end
            yield
    finally:
        _casts_disabled -= 1


def casts_disabled() -> bool:
    return _casts_disabled > 0


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------
def convert_level(properties: Properties) -> str:
    """The `amp_fx.convert` opt level that realizes these (possibly overridden) properties.

    Per-op casts make the level of autocast's op lists; low weights keep the chosen level if it
    stores weights low, else (O0 with ``cast_model_type=torch.float16``) make the pure
    low-precision one; anything else is the level that lowers nothing.
    """
    if properties.patch_torch_functions:
        return find_opt_level(uses_autocast_op_lists=True).name
    if properties.cast_model_type in LOW_PRECISION_DTYPES:
        chosen = lookup_opt_level(properties.opt_level)
        if chosen.stores_weights_low:
            return chosen.name
        return find_opt_level(stores_weights_low=True, keeps_fp32_islands=False).name
    return find_opt_level(lowers_precision=False).name


def convert_model(
    model: nn.Module, properties: Properties, dtype: torch.dtype, cast_model_outputs: torch.dtype | None
) -> torch.fx.GraphModule:
    """Convert `model` as the properties say, with the registered functions as policy overrides."""
    level = convert_level(properties)
    keep_batchnorm_fp32 = (
        properties.keep_batchnorm_fp32 if lookup_opt_level(level).stores_weights_low else None
    )
    policy = preset(
        level,
        dtype=dtype,
        device_type=default_device_type(model),
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        cast_model_outputs=cast_model_outputs,
    )
    apply_registered_functions(policy)
    return amp_fx.convert(model, level, policy=policy)


# --------------------------------------------------------------------------------------------
# FP32 checkpoints
# --------------------------------------------------------------------------------------------
def _low_precision(tensor: Any) -> bool:
    return isinstance(tensor, Tensor) and tensor.dtype in LOW_PRECISION_DTYPES


def install_fp32_state_dict(gm: nn.Module, session: Any) -> None:
    """Make ``gm.state_dict()`` FP32 and ``gm.load_state_dict`` update the FP32 masters.

    `session` is the `AmpSession` whose optimizers hold the masters (looked up at each call, so
    optimizers loaded or extended later are seen).
    """
    stores_low = session.properties.cast_model_type in LOW_PRECISION_DTYPES  # maybe at the first call
    if not stores_low and not any(_low_precision(t) for t in [*gm.parameters(), *gm.buffers()]):
        return

    def fp32_state_dict(
        module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        params = dict(module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False))
        masters = session.masters_by_param()
        for key, value in state_dict.items():
            if not _low_precision(value):
                continue
            param = params.get(key)
            master = masters.get(id(param)) if param is not None else None
            state_dict[key] = master.detach() if master is not None else value.detach().float()

    gm.register_state_dict_post_hook(fp32_state_dict)
    # Loads set the masters from the checkpoint's values; the session's are found at each load.
    follow_model_loads(gm, session.masters_by_param)


# --------------------------------------------------------------------------------------------
# disable_casts
# --------------------------------------------------------------------------------------------
def _upcast(value: Any) -> Any:
    return value.float() if _low_precision(value) else value


class _FP32Interpreter(torch.fx.Interpreter):
    """Runs a converted graph in FP32: inserted casts skipped, weights upcast, no autocast islands."""

    def run_node(self, node: torch.fx.Node) -> Any:
        info = node.meta.get(META_KEY)
        if info is not None and info.is_cast and node.op in ("call_function", "call_method"):
            args, _ = self.fetch_args_kwargs_from_env(node)
            return _upcast(args[0])
        return super().run_node(node)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return _upcast(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        if isinstance(module, AutocastIsland):
            module = module.wrapped
        if not isinstance(module, nn.Module):
            return module(*args, **kwargs)
        upcast = {
            name: tensor.float()
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]
            if _low_precision(tensor)
        }
        if not upcast:
            return module(*args, **kwargs)
        return torch.func.functional_call(module, upcast, args, kwargs)


def install_disable_casts(gm: torch.fx.GraphModule) -> None:
    """Route ``gm``'s forward through `_FP32Interpreter` while `disable_casts` is active.

    The GraphModule's class is its own (torch.fx makes one per instance), so patching its
    ``forward`` touches no other model; ``gm.recompile()`` would undo it.
    """
    if not isinstance(gm, torch.fx.GraphModule):
        return  # the torch.export front end's models follow `disable_casts` themselves
    cls = type(gm)
    converted_forward = cls.forward
    if getattr(converted_forward, "_amp_fx_disable_casts", False):
        return

    @functools.wraps(converted_forward)
    def forward(self: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        if casts_disabled():
            if kwargs:
                names = [n.target for n in self.graph.nodes if n.op == "placeholder"]
                args = (*args, *(kwargs[name] for name in names[len(args) :] if name in kwargs))
            return _FP32Interpreter(self).run(*args)
        return converted_forward(self, *args, **kwargs)

    forward._amp_fx_disable_casts = True
    cls.forward = forward
