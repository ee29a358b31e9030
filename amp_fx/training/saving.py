"""Saving a converted model: `master_state_dict`, its state dict with the FP32 master weights in it.

(The module is not named after the function: ``import amp_fx.master_state_dict`` would then bind
the module, not the function, to ``amp_fx.master_state_dict``.)

At O2/O3 a converted model stores its matmul weights in fp16/bf16 and ``model.state_dict()``
returns those rounded copies. The FP32 masters, the exact training state, live in the optimizer:
``state[p]["master_param"]`` of `amp_fx.optim.FusedAdam` / `FusedSGD`, or the masters that
``amp.initialize`` put behind a torch.optim optimizer. `master_state_dict` puts them back in the
state dict, so that saving the model (``torch.save``, ``save_pretrained(..., state_dict=...)``)
saves what training holds, and the result loads into the original FP32 model.

The masters are found through the sources `amp_fx.optim.model_load_hooks` already keeps so that loads
into the model update them; only the nn.Module API is used, so the function takes a torch.fx
GraphModule, the torch.export front end's `CapturedModel`, or any module an amp_fx optimizer trains.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn

from amp_fx.optim.model_load_hooks import masters_of

logger = logging.getLogger(__name__)


def master_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with each parameter's FP32 master where an amp_fx optimizer keeps one.

    The keys are exactly ``model.state_dict()``'s, in its order. A parameter whose master is held
    by an amp_fx fused optimizer (`amp_fx.optim.FusedAdam`, `FusedSGD`) or by an ``amp.initialize``
    optimizer gets that master; every other entry (buffers, FP32 parameters, parameters no such
    optimizer holds) is the value ``model.state_dict()`` gives. Without any such optimizer the
    result equals ``model.state_dict()``, value for value.

    Nothing is copied: a master entry is ``master.detach()``, which shares memory with the
    optimizer's master, as ``state_dict()``'s entries share memory with the parameters. Save it
    (or ``clone()`` the entries you keep) before the next optimizer step changes it. A tied
    parameter (GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``) appears under every key
    ``state_dict()`` gives it, all of them one tensor object, so savers that drop tied duplicates
    (``save_pretrained``, which deletes them from the dict it is given) see the tie. Hugging Face
    models save their masters with ``model.save_pretrained(path, state_dict=master_state_dict(model))``.

    If several optimizers keep a master for one parameter, one of them is used (which one is not
    specified) and a warning is logged.

    Raises:
        TypeError: ``model`` is not an nn.Module.

    Example:
        >>> import torch, amp_fx
        >>> model = amp_fx.convert(torch.nn.Linear(4, 2), "O2", dtype=torch.bfloat16)
        >>> optimizer = amp_fx.optim.FusedAdam(model.parameters(), lr=1e-3)
        >>> model.state_dict()["weight"].dtype, master_state_dict(model)["weight"].dtype
        (torch.bfloat16, torch.float32)
        >>> torch.equal(master_state_dict(model)["weight"], next(amp_fx.optim.master_params(optimizer)))
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"master_state_dict needs the model (a torch.nn.Module), got {type(model).__name__}; pass the "
            "model amp_fx.convert or amp.initialize returned (the one the optimizer trains), not its "
            "optimizer or a state dict"
        )
    state = model.state_dict()  # keeps torch's _metadata, so the result loads as state_dict()'s does
    masters = masters_of(model)
    shared: dict[int, Tensor] = {}  # one tensor per parameter, under each of its (tied) keys
    for key, param in model.named_parameters(remove_duplicate=False):
        if key not in state:
            continue  # a key state_dict hooks renamed or dropped: nothing to replace
        found = masters.get(id(param), [])
        if id(param) not in shared:
            shared[id(param)] = found[0].detach() if found else state[key]
            if len(found) > 1:
                logger.warning(
                    "%s: %d optimizers keep FP32 masters for %s; master_state_dict uses one of them",
                    type(model).__name__,
                    len(found),
                    key,
                )
        # Without a master, a tied key takes its first key's tensor only where state_dict gave both
        # the same view of the parameter (a state_dict hook may have put another value there).
        if found or _same_view(shared[id(param)], state[key]):
            state[key] = shared[id(param)]
    return state


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )
