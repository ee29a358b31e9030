"""Converting a LightningModule in place: its submodules are converted, the module object stays.

Lightning keeps the LightningModule the user passed (``trainer.lightning_module``, its hooks, its
``self.log``), so `AmpPrecision` converts what it holds rather than the module itself: each direct
child with floating parameters is replaced by ``amp_fx.convert(child, ...)`` (a GraphModule, or a
copy of the child's class from the torch.export front end), under the same attribute name, so
``self.net(x)`` in ``training_step`` runs the converted code and ``state_dict`` keys stay the same.
Children without parameters (a loss module, an activation, metrics) run as written.

`ConvertedChildren` remembers what it replaced: the FP32 parameters before conversion, which the
optimizer's masters are made from (exact, not the rounded copies), and the original children, put
back if the optimizer is then refused. `fp32_state_dict` makes each converted child's state dict
FP32 (its masters where an optimizer keeps them), so Lightning's checkpoints hold the training
state and load into the FP32 LightningModule.

    >>> import torch
    >>> holder = torch.nn.Module()
    >>> holder.net = torch.nn.Linear(4, 2)
    >>> children = ConvertedChildren.convert(holder, {"opt_level": "O2", "dtype": torch.bfloat16})
    >>> children.install(); holder.net.weight.dtype, holder.state_dict()["net.weight"].dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor, nn

import amp_fx
from amp_fx.core.dtypes import LOW_PRECISION_DTYPES
from amp_fx.optim.model_load_hooks import masters_of

logger = logging.getLogger(__name__)


def _has_floating_parameters(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters())


def fp32_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A state-dict post-hook: each fp16/bf16 entry becomes its parameter's FP32 master where an
    amp_fx optimizer keeps one, else its value in FP32 (a module-level function: the model pickles)."""
    params = dict(module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False))
    masters = masters_of(module)
    for key, value in state_dict.items():
        if not isinstance(value, Tensor) or value.dtype not in LOW_PRECISION_DTYPES:
            continue
        param = params.get(key)
        found = masters.get(id(param), []) if param is not None else []
        if len(found) > 1:
            logger.warning(
                "%d optimizers keep FP32 masters for %s; the state dict holds one of them", len(found), key
            )
        state_dict[key] = found[0].detach() if found else value.detach().float()


@dataclasses.dataclass
class ConvertedChildren:
    """The children of one module that `convert` replaced, and their FP32 originals."""

    owner: nn.Module
    # (attribute name, original child, converted child)
    children: list[tuple[str, nn.Module, nn.Module]]

    @classmethod
    def convert(cls, owner: nn.Module, convert_kwargs: dict[str, Any]) -> ConvertedChildren:
        """Convert ``owner``'s children with ``amp_fx.convert(child, **convert_kwargs)``; nothing is
        installed yet, so a child that fails to convert leaves ``owner`` as it was."""
        candidates = [
            (name, child)
            for name, child in owner.named_children()
            if _has_floating_parameters(child) and not getattr(child, "_amp_fx_lightning_converted", False)
        ]
        _check_no_shared_parameters(candidates)
        converted = [(name, child, amp_fx.convert(child, **convert_kwargs)) for name, child in candidates]
        return cls(owner, converted)

    def install(self) -> None:
        """Put the converted children in place of the originals."""
        for name, _, converted in self.children:
            converted._amp_fx_lightning_converted = True
            converted.register_state_dict_post_hook(fp32_state_dict)
            setattr(self.owner, name, converted)

    def restore(self) -> None:
        """Put the original children back (an optimizer was refused after conversion)."""
        for name, original, _ in self.children:
            setattr(self.owner, name, original)

    def originals_by_param(self) -> dict[int, Tensor]:
        """id(converted parameter) -> the FP32 parameter it was converted from (same name)."""
        result = {}
        for _, original, converted in self.children:
            before = dict(original.named_parameters(remove_duplicate=False))
            for name, param in converted.named_parameters(remove_duplicate=False):
                source = before.get(name)
                if source is not None and source.dtype == torch.float32:
                    result[id(param)] = source.detach()
        return result

    def original_params(self) -> list[Tensor]:
        """The parameters the converted children no longer hold."""
        return [p for _, original, _ in self.children for p in original.parameters()]


def _check_no_shared_parameters(children: list[tuple[str, nn.Module]]) -> None:
    """Refuse children that share a parameter (tied weights): converted one by one, the tie would break."""
    owners: dict[int, str] = {}
    for name, child in children:
        for param in child.parameters():
            other = owners.setdefault(id(param), name)
            if other != name:
                raise ValueError(
                    f"submodules {other!r} and {name!r} share a parameter (tied weights); AmpPrecision "
                    "converts each submodule on its own, which would untie them: hold both in one submodule "
                    "(e.g. self.model = nn.ModuleDict(...)) so that one conversion keeps the tie"
                )
