"""The FSDP2 groups of a model of the torch.export front end: one per transformer block, and one per
part stored in another dtype than the rest of its group.

`amp_fx.training.fsdp.fully_shard_converted` shards a Hugging Face model as FSDP2 users do: each block
(the classes the model lists in ``_no_split_modules``, or else the repeated items of a
``nn.ModuleList``) is a group gathered for its own forward and freed after it, and the root group
holds the rest (embeddings, final norm, head). One group is gathered, and its gradients reduced,
in one dtype, so a part convert stored in another dtype than its group's most parameters (at O2 a
LayerNorm/RMSNorm kept FP32 inside a block gathered in bf16) is split off the block. The parts split
off in one dtype, all blocks' together, then form ONE group (`shard_units`: ``fully_shard`` on the
list of them): gathered in FP32 once, at the first norm's call, and kept until the backward has
reduce-scattered their gradients, in FP32. One group instead of two per block: its hooks and
collectives run once per step, not per norm, and the norms are tiny.

>>> import amp_fx
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.fc, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)
...     def forward(self, x):
...         return self.norm(self.fc(x))
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.blocks = nn.ModuleList([Block(), Block()])
...         self.head = nn.Linear(4, 2)
...     def forward(self, x):
...         for block in self.blocks:
...             x = block(x)
...         return self.head(x)
>>> model = amp_fx.convert(Net(), "O2", dtype=torch.bfloat16, front_end="export")
>>> for name, dtype in shard_groups(model).items():
...     print(repr(name), dtype)
'blocks.0.norm' None
'blocks.1.norm' None
'blocks.0' torch.bfloat16
'blocks.1' torch.bfloat16
'' torch.bfloat16
>>> shard_units(model)
[('blocks.0.norm', 'blocks.1.norm'), ('blocks.0',), ('blocks.1',), ('',)]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from amp_fx.core.dtypes import LOW_PRECISION_DTYPES

__all__ = ["block_names", "shard_groups", "shard_units"]


def _modules_in_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The items of ``nn.ModuleList``s that repeat one class holding parameters."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(item) for item in module}) == 1 and any(True for _ in module[0].parameters()):
            found += [(f"{name}.{index}", item) for index, item in enumerate(module)]
    return found


def block_names(model: nn.Module, block_types: Iterable[type] | None = None) -> list[str]:
    """Qualified names of the blocks of ``model``, outermost where they nest: instances of
    ``block_types``, by default of the classes named in ``model._no_split_modules`` (Hugging Face),
    or else the items of ``nn.ModuleList``s that repeat one class."""
    if block_types is not None:
        types = tuple(block_types)
        candidates = [(n, m) for n, m in model.named_modules() if n and isinstance(m, types)]
    else:
        listed = set(getattr(model, "_no_split_modules", None) or ())
        candidates = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in listed]
        candidates = candidates or _modules_in_lists(model)
    names = [name for name, _ in candidates]
    return [n for n in names if not any(n.startswith(f"{other}.") for other in names)]


def _group_of(name: str, groups: Iterable[str]) -> str:
    return max((g for g in groups if not g or name.startswith(f"{g}.")), key=len)


def _split_off(group: str, owned: dict[str, torch.dtype], dtype: torch.dtype) -> str:
    """The outermost part of ``group`` that holds a parameter of ``dtype`` and, of the group's
    parameters, only ones of that dtype."""
    name = next(n for n, d in owned.items() if d == dtype)
    parts = name.split(".")[:-1]
    start = len(group.split(".")) if group else 0
    for end in range(start + 1, len(parts) + 1):
        part = ".".join(parts[:end])
        if all(d == dtype for n, d in owned.items() if n.startswith(f"{part}.")):
            return part
    raise ValueError(
        f"cannot shard this model: {name} is stored in {dtype} next to parameters of other dtypes in "
        f"{'.'.join(parts) or 'the model'}, and one FSDP2 group gathers in one dtype; convert at O1 "
        "(every parameter FP32)"
    )


def shard_groups(
    model: nn.Module, block_types: Iterable[type] | None = None
) -> dict[str, torch.dtype | None]:
    """Qualified name -> gather dtype (None: FP32) of each FSDP2 group, innermost first, the root
    (``""``) last; read-only (module docstring).

    Raises:
        ValueError: no blocks found, a parameter shared by two groups, or a module holding
            parameters of two dtypes.
    """
    blocks = block_names(model, block_types)
    if not blocks:
        raise ValueError(
            f"found no transformer blocks in {type(model).__name__} (no _no_split_modules, no "
            "nn.ModuleList of one repeated class) to gather one at a time: pass block_types=(YourBlock,)"
        )
    dtypes = {name: p.dtype for name, p in model.named_parameters(remove_duplicate=False)}
    groups = ["", *blocks]
    while True:
        for group in groups:
            owned = {n: d for n, d in dtypes.items() if _group_of(n, groups) == group}
            sizes = Counter[torch.dtype]()
            for n, p in model.named_parameters(remove_duplicate=False):
                if n in owned:
                    sizes[p.dtype] += p.numel()
            if len(sizes) > 1:
                main = sizes.most_common(1)[0][0]
                groups.append(_split_off(group, owned, next(d for d in sizes if d != main)))
                break
        else:
            break
    _refuse_shared_across_groups(model, groups)
    by_depth = sorted(groups, key=lambda g: -(g.count(".") + 1 if g else 0))
    result = {}
    for group in by_depth:
        owned = [d for n, d in dtypes.items() if _group_of(n, groups) == group]
        dtype = owned[0] if owned else None
        result[group] = dtype if dtype in LOW_PRECISION_DTYPES else None
    return result


def _refuse_shared_across_groups(model: nn.Module, groups: list[str]) -> None:
    owners: dict[int, dict[str, str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), {})[_group_of(name, groups)] = name
    for names in owners.values():
        if len(names) > 1:
            raise ValueError(
                f"cannot shard this model: one parameter is {' and '.join(names.values())}, in two FSDP2 "
                "groups; FSDP2 shards a parameter in one group: untie them, or pass block_types so that "
                "both are in one block"
            )


def shard_units(
    model: nn.Module,
    block_types: Iterable[type] | None = None,
    groups: dict[str, torch.dtype | None] | None = None,
) -> list[tuple[str, ...]]:
    """The qualified names each ``fully_shard`` call of ``model`` takes, innermost first, the root
    (``""``) last: the parts `shard_groups` splits off that enclose no other group, one call for
    all of one gather dtype (O2's FP32 norms, every block's, in one FSDP2 group), then the other
    groups one by one. ``groups``: `shard_groups`' answer, when the caller has it. Read-only
    (module docstring).
    """
    groups = shard_groups(model, block_types) if groups is None else groups
    blocks = set(block_names(model, block_types))
    merged: dict[torch.dtype | None, list[str]] = {}
    alone: list[tuple[str, ...]] = []
    for name, dtype in groups.items():  # innermost first: a group's parts come before it
        encloses = any(other.startswith(f"{name}.") for other in groups) or not name
        if name in blocks or encloses:
            alone.append((name,))
        else:
            merged.setdefault(dtype, []).append(name)
    return [*(tuple(names) for names in merged.values()), *alone]
