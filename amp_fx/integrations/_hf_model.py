"""The model `AmpTrainer` trains: the one the Trainer was given, converted in place, and the FP32
values the trainer keeps of its weights until its optimizer exists.

`convert_for_trainer` converts with the policy for the device the Trainer trains on, in place
(``amp_fx.convert(..., in_place=True)``): the object the user passed is the model that trains, so
``trainer.model is model`` and, after ``train()``, ``model.save_pretrained(out)`` writes the
trained FP32 masters (the converted class saves its masters), as with the plain Trainer. Its
Parameter objects stay, so an optimizer built over them before the Trainer trains them. It
returns the FP32 values of the parameters conversion stored low (they become the masters, exact,
as ``amp.initialize`` makes them): the tensors they were stored in, kept, not copied.

Every part of the model that holds parameters is converted too (`amp_fx.capture.captured_model`): code
that calls a base model directly rather than through the model's forward (TRL's ``SFTTrainer``
computes its loss from the base model's hidden states with a fused LM head) runs converted. A call
of the whole model still runs one graph of the whole model.

A PEFT model is converted inside its wrapper: the Hugging Face model it wraps (with the adapter
layers in it) is converted in place, so PEFT's dispatch runs as it is and a forward another
library patches onto the wrapped model (TRL's fused LM head) is not captured into a graph of the
whole (it calls a custom autograd function, whose backward a graph would lose).

    >>> import torch, transformers
    >>> from amp_fx.integrations._hf_arguments import AmpSetup
    >>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    >>> setup = AmpSetup("O2", torch.bfloat16, None, master_weights=True, scaled=False)
    >>> model = transformers.LlamaForCausalLM(config)
    >>> originals = convert_for_trainer(model, setup, "cpu")
    >>> type(model.model).__mro__[1].__name__, model.model.layers[0].mlp.up_proj.weight.dtype
    ('CapturedModel', torch.bfloat16)
    >>> len(originals)  # the 8 weights stored in bf16 keep their FP32 values, for the masters
    8
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.integrations._hf_arguments import AmpSetup

logger = logging.getLogger(__name__)


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


def convert_for_trainer(model: nn.Module, setup: AmpSetup, device_type: str) -> dict[int, Tensor]:
    """Convert ``model`` in place for training on ``device_type`` (a PEFT model: the model it wraps;
    module docstring); returns id(parameter) -> its FP32 value before conversion, for each parameter
    conversion stored low."""
    policy = setup.policy_for(device_type)
    target = _peft_wrapped_model(model) or model
    # Conversion gives each lowered parameter new storage: the tensor it had is its exact FP32 value.
    before = {id(p): (p, p.data) for p in target.parameters() if p.dtype == torch.float32}
    amp_fx.convert(target, policy=policy, in_place=True)
    return {key: data for key, (param, data) in before.items() if param.dtype != torch.float32}


def _peft_wrapped_model(model: nn.Module) -> nn.Module | None:
    """The model a PEFT wrapper holds (None for anything else)."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return model.get_base_model() if isinstance(model, PeftModel) else None


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
