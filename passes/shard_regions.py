"""After the rewrite, for graphs of a model sharded with FSDP2: each sharded block runs through its
own ``__call__``, so FSDP2 gathers its parameters for its ops alone.

FSDP2 gathers a module's parameters in a forward pre-hook and frees them in a forward hook. A
graph of the torch.export front end inlines the blocks it calls, so those hooks would never run;
this pass cuts the ops of each call of a sharded module (``nn_module_stack``) out into a region,
with the reads of the parameters and buffers it uses, and calls it through the module
(`amp_fx.ops.module_call.ModuleCall`): pre-hook (all-gather), the region, post-hook (free, and
the pre-backward hooks on its outputs). Sharded modules nested in a block (a norm kept FP32 inside
a block gathered in bf16) become regions of the block's region.

Parameters and buffers are read through the live model (``<live>.transformer.h.0.attn.weight``)
at each call, not held by the graph: FSDP2 swaps a module's parameters between the sharded
``DTensor`` and the gathered tensor, and the graph must read whichever the module holds then.

Example (blocks ``0`` and ``2`` sharded)::

    before                                   after
    w0 = get_attr[0.weight]                  block_0 = block_0(x)          # ModuleCall(model[0])
    linear = linear(x, w0)                   relu = relu(block_0)
    relu = relu(linear)                      block_1 = block_1(relu)       # ModuleCall(model[2])
    w2 = get_attr[2.weight]
    linear_1 = linear(relu, w2)
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn

from amp_fx.ops.module_call import ModuleCall
from amp_fx.passes.shared.in_place_updates import updates_in_place
from amp_fx.passes.shared.module_regions import cut_module_regions

__all__ = ["shard_regions", "SharedParameterError"]

_PREFIX = "block_"
# The attribute (in a GraphModule's __dict__, not a submodule) through which reads reach the model.
_LIVE_ATTR = "_amp_fx_live"


class SharedParameterError(RuntimeError):
    """A region reads a parameter that another sharded module owns, which is not gathered then."""


def _owner(target: str, sharded: list[str]) -> str:
    """The innermost sharded module (``""``: the captured module) whose parameter ``target`` is."""
    return max((path for path in sharded if target.startswith(f"{path}.")), key=len, default="")


def _cut(
    gm: torch.fx.GraphModule,
    modules: dict[str, nn.Module],
    enclosing: tuple[str, ...],
    parameters: set[str],
) -> None:
    inner = {path for path in modules if not enclosing[-1] or path.startswith(f"{enclosing[-1]}.")}
    inner.discard(enclosing[-1])
    for name, path in cut_module_regions(gm, inner, _PREFIX, with_reads=True):
        region = getattr(gm, name)
        _cut(region, modules, (*enclosing, path), parameters)
        _copy_outputs_updated_in_place(gm, name, region)
        setattr(gm, name, ModuleCall(modules[path], region))
    for node in gm.graph.find_nodes(op="get_attr"):
        if node.target in parameters and _owner(node.target, list(modules)) not in enclosing:
            raise SharedParameterError(
                f"the ops of {enclosing[-1] or 'the model'} read parameter {node.target}, which "
                f"{_owner(node.target, list(modules))} owns, outside that module's call: FSDP2 "
                "gathers it only during that call; shard a module that encloses both"
            )


def _copy_outputs_updated_in_place(gm: torch.fx.GraphModule, name: str, region: torch.fx.GraphModule) -> None:
    """A region's output that the graph later updates in place is returned as a copy: FSDP2's
    pre-backward hook on a view would be dropped by the update (eager FSDP2 warns of it)."""
    (call,) = gm.graph.find_nodes(op="call_module", target=name)
    (output,) = region.graph.find_nodes(op="output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        if updates_in_place(call):
            with region.graph.inserting_before(output):
                output.args = (region.graph.call_function(torch.ops.aten.clone.default, (values,)),)
        return
    values = list(values)
    for user in call.users:
        if user.target is operator.getitem and updates_in_place(user):
            with region.graph.inserting_before(output):
                values[user.args[1]] = region.graph.call_function(
                    torch.ops.aten.clone.default, (values[user.args[1]],)
                )
    output.args = (tuple(values),)


def _read_live(gm: torch.fx.GraphModule, root: nn.Module, names: set[str]) -> None:
    for node in gm.graph.find_nodes(op="get_attr"):
        if node.target in names:
            node.target = f"{_LIVE_ATTR}.{node.target}"
    gm.__dict__[_LIVE_ATTR] = root
    for child in gm.children():
        region = child.region if isinstance(child, ModuleCall) else child
        if isinstance(region, torch.fx.GraphModule):
            _read_live(region, root, names)
    gm.delete_all_unused_submodules()
    gm.recompile()


def shard_regions(
    gm: torch.fx.GraphModule, root: nn.Module, modules: dict[str, nn.Module]
) -> torch.fx.GraphModule:
    """Call the ops of each module in ``modules`` (qualified name under ``root``, the module
    ``gm`` was captured from -> the module) through that module, and read every parameter and
    buffer of ``root`` from ``root`` at each call; see the module docstring. In place.

    Raises:
        SharedParameterError: a region reads a parameter of a sharded module it is not inside.

    >>> from amp_fx.capture.export import export_graph
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> gm = shard_regions(export_graph(model, (torch.randn(3, 4),), {}), model, {"2": model[2]})
    >>> [type(m).__name__ for m in gm.children()]
    ['ModuleCall']
    """
    tensors = {name for name, _ in root.named_parameters(remove_duplicate=False)}
    parameters = set(tensors)
    tensors |= {name for name, _ in root.named_buffers(remove_duplicate=False)}
    _cut(gm, modules, ("",), parameters)
    _read_live(gm, root, tensors)
    return gm
