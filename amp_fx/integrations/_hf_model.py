"""The model `AmpTrainer` trains: ``amp_fx.convert`` of the one the Trainer was given, and what the
trainer keeps of the original until its optimizer exists.

`convert_for_trainer` converts with the policy for the device the Trainer put the model on (a
copy: the model passed in is left as it was) and returns, beside the converted model, a
`ConvertedParams`: the FP32 values of the parameters conversion stored low (they become the
masters, exact, as ``amp.initialize`` makes them) and the map from the original's parameters to
the converted model's (an optimizer built over the original trains the converted one).

The base model of each Hugging Face model inside (``model.model`` of a ``LlamaForCausalLM``,
``model.transformer`` of a ``GPT2LMHeadModel``) is made a converted module of its own, sharing the
parameters: code that calls it directly rather than through the model's forward (TRL's
``SFTTrainer`` computes its loss from the base model's hidden states with a fused LM head) then
runs converted too. A call of the whole model still runs one graph of the whole model.

A PEFT model is converted inside its wrapper: the Hugging Face model it wraps (with the adapter
layers in it) is converted, and a copy of the wrapper holds it, so PEFT's dispatch runs as it is
and a forward another library patches onto the wrapped model (TRL's fused LM head) is not captured
into a graph of the whole (it calls a custom autograd function, whose backward a graph would lose).

    >>> import torch, transformers
    >>> from amp_fx.integrations._hf_arguments import AmpSetup
    >>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    >>> setup = AmpSetup("O2", torch.bfloat16, None, master_weights=True, scaled=False)
    >>> model, params = convert_for_trainer(transformers.LlamaForCausalLM(config), setup, "cpu")
    >>> type(model.model).__mro__[1].__name__, model.model.layers[0].mlp.up_proj.weight.dtype
    ('CapturedModel', torch.bfloat16)
    >>> len(params.originals)  # the 8 weights stored in bf16 keep their FP32 values, for the masters
    8
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.captured_model import CapturedModel
from amp_fx.integrations._hf_arguments import AmpSetup

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ConvertedParams:
    """What the trainer needs of the original model once, when it builds the optimizer."""

    # id(converted parameter) -> the original's FP32 tensor, for parameters conversion stored low.
    originals: dict[int, Tensor]
    # id(original parameter) -> (that parameter, the converted model's parameter of the same name).
    by_original: dict[int, tuple[Tensor, Tensor]]

    def map_param(self, param: Tensor) -> Tensor:
        """The converted model's parameter for an original's parameter; any other is returned as is."""
        entry = self.by_original.get(id(param))
        return entry[1] if entry is not None and entry[0] is param else param


def check_model(model: object) -> None:
    """Refuse, naming the fix, a model `convert_for_trainer` cannot train (not a model yet, e.g. a
    name TRL loads, is left to the trainer)."""
    if not isinstance(model, nn.Module):
        return
    inner = _peft_wrapped_model(model) or model
    if getattr(inner, "is_quantized", False) or getattr(inner, "hf_quantizer", None) is not None:
        raise ValueError(
            f"{type(inner).__name__} is quantized ({getattr(inner, 'quantization_method', 'quantized')}); "
            "amp_fx converts floating-point weights: load the model unquantized (in float32 or bfloat16) "
            "for AmpTrainer, or train the quantized one with the Trainer's own fp16/bf16"
        )
    placed = set((getattr(inner, "hf_device_map", None) or {}).values())
    if len(placed) > 1:
        raise ValueError(
            f"{type(inner).__name__} is spread over {sorted(map(str, placed))} (device_map); AmpTrainer "
            "trains a model on one device per process: load it without device_map and launch with "
            "torchrun for several GPUs"
        )


def convert_for_trainer(
    model: nn.Module, setup: AmpSetup, device_type: str
) -> tuple[nn.Module, ConvertedParams]:
    """``amp_fx.convert`` for training on ``device_type``, base models converted on their own too;
    a PEFT model's wrapped model, in a copy of the wrapper (module docstring)."""
    policy = setup.policy_for(device_type)
    wrapped = _peft_wrapped_model(model)
    if wrapped is None:
        converted = amp_fx.convert(model, policy=policy)
        _convert_base_models(converted, policy)
    else:
        inner = amp_fx.convert(wrapped, policy=policy)
        _convert_base_models(inner, policy)
        converted = _copy_around(model, wrapped, inner)
    original = dict(model.named_parameters(remove_duplicate=False))
    by_original: dict[int, tuple[Tensor, Tensor]] = {}
    originals: dict[int, Tensor] = {}
    for name, param in converted.named_parameters(remove_duplicate=False):
        source = original.get(name)
        if source is None:
            continue
        by_original[id(source)] = (source, param)
        if source.dtype == torch.float32 and param.dtype != torch.float32:
            originals[id(param)] = source
    return converted, ConvertedParams(originals, by_original)


def _peft_wrapped_model(model: nn.Module) -> nn.Module | None:
    """The model a PEFT wrapper holds (None for anything else)."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return model.get_base_model() if isinstance(model, PeftModel) else None


def _copy_around(wrapper: nn.Module, wrapped: nn.Module, converted: nn.Module) -> nn.Module:
    """A deep copy of ``wrapper`` holding ``converted`` (and its modules and tensors, by name) wherever
    ``wrapper`` holds ``wrapped``: the wrapper's own state copied, the big model not copied again."""
    memo: dict[int, object] = {}
    for named in ("named_modules", "named_parameters", "named_buffers"):
        targets = dict(getattr(converted, named)(remove_duplicate=False))
        for name, item in getattr(wrapped, named)(remove_duplicate=False):
            if name in targets:
                memo[id(item)] = targets[name]
    return copy.deepcopy(wrapper, memo)


def _convert_base_models(converted: nn.Module, policy: amp_fx.Policy) -> None:
    """Make the base model of each transformers model in ``converted`` a converted module of its own."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - the integration imports transformers first
        return
    # A base model called directly returns what it computes (hidden states), as convert's
    # torch.export children do: O2's float32 outputs are the whole model's.
    child_policy = dataclasses.replace(policy, cast_model_outputs=None)
    for module in list(converted.modules()):
        if not isinstance(module, PreTrainedModel) or isinstance(module, torch.fx.GraphModule):
            continue
        prefix = getattr(module, "base_model_prefix", "")
        base = getattr(module, prefix, None) if prefix else None
        if not isinstance(base, nn.Module) or base is module or isinstance(base, CapturedModel):
            continue
        captured = amp_fx.convert(base, policy=child_policy, front_end="export")
        _share_tensors(captured, base)
        setattr(module, prefix, captured)
        logger.debug("%s.%s: base model converted on its own", type(module).__name__, prefix)


def _share_tensors(copy: nn.Module, source: nn.Module) -> None:
    """Give ``copy`` (a converted copy of ``source``) the source's parameters and buffers, so weights
    tied to the rest of the model stay tied and optimizers see one tensor."""
    sources = dict(source.named_modules(remove_duplicate=False))
    for path, module in copy.named_modules(remove_duplicate=False):
        original = sources[path]
        module._parameters.update({k: original._parameters[k] for k in module._parameters})
        module._buffers.update({k: original._buffers[k] for k in module._buffers})


def storage_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """The dtype of each parameter and floating buffer of ``model``, by name: the storage conversion chose."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: tensor.dtype for name, tensor in tensors if tensor.is_floating_point()}


def restore_dtypes(model: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """Store each tensor of ``model`` named in ``dtypes`` in that dtype again, where a load changed it
    (same tensor objects: optimizers and graphs keep them)."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    with torch.no_grad():
        for name, tensor in tensors:
            dtype = dtypes.get(name)
            if dtype is not None and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
