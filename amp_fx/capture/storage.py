"""Where the torch.export front end stores a converted model's parameters (O2/O3): most when the
model is converted, the rest at the first capture that reads them.

A parameter of a module whose children hold none (``nn.Linear``, GPT-2's ``Conv1D``, an RMSNorm,
a mixture-of-experts layer's expert tensors beside its activation) is what that module's op
computes with, so the policy's decision for the op (`decide_module`) says how to store it, as the
fx front end decides for a module its graph calls: `store_parameters` stores it when the model is
converted, and optimizers, DDP and FSDP2 set up right after see the tensors they train. A
parameter held by a module whose children hold parameters (CLIP's ``logit_scale``, ViT's
``cls_token``, Mamba's ``A_log``) is read by the code around those children, which only a graph
shows; so is one of a module with no forward of its own (the plain ``nn.Module`` shells of
``ep.module()``, whose LayerNorm type is gone), and with it that module's buffers. Where the
level keeps parameters no lowered op reads FP32 (O2) it stays FP32 at convert, and the first
graph that reads it decides (`storing_unstored`): the convert passes plan it as on
the fx front end (`planned_parameter_dtypes`), so a logit scale that only ``exp`` reads stays FP32
and is never rounded, and a bias concatenated into a projection's is stored low. A fused optimizer
already holding a parameter stored low then is given its FP32 master (the exact value it had).
A parameter stored low at convert is planned again by the first graph that reads it, in the same
plan: one the graph keeps FP32 (a mixture-of-experts router's weight, read by the FP32 router
product, which no module type names) is stored FP32 then, with its exact value from an FP32
master where a keeper holds one, and is its own master from then on. All of it is undone if the
call fails.

    >>> from amp_fx.core.policy import preset
    >>> class Scaled(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc, self.scale = nn.Linear(2, 2), nn.Parameter(torch.ones(()))
    >>> model = Scaled()
    >>> [p is model.scale for p in store_parameters(model, preset("O2", torch.bfloat16, "cpu"))]
    [True, False, False]
    >>> model.fc.weight.dtype, model.scale.dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator

import torch
import torch.fx
from torch import nn

from amp_fx.capture.state import CaptureState, record
from amp_fx.core.policy import Policy, Rule
from amp_fx.optim.model_load_hooks import masters_for_stored_fp32, masters_for_stored_low
from amp_fx.passes.shared.decisions import decide_module

__all__ = ["store_added", "store_parameters", "storing_unstored"]


def _castable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64


def store_parameters(
    model: nn.Module, policy: Policy, only: Collection[int] | None = None
) -> list[torch.Tensor]:
    """Store each module's parameters (and its floating buffers) in the dtype the policy decides
    for the op the module is; a tensor several modules hold is float32 if any of them wants it.
    Returns the parameters the first graph reading them decides (module docstring), at a level
    that keeps parameters no lowered op reads FP32: those left unstored, held only by modules with
    children or by modules with no forward of their own (with those modules' buffers), and those
    stored low, which that graph may keep FP32. ``only``: the ids of the tensors to store (those a change
    after conversion added, `amp_fx.capture.captured_model`); the others are left as they are."""
    wanted: dict[int, torch.dtype] = {}
    tensors: dict[int, torch.Tensor] = {}
    unstored: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        own = [*module.parameters(recurse=False)]
        if not own:
            continue
        decision = decide_module(module, name, policy)
        if decision.rule is Rule.OPAQUE or decision.param_dtype is None:
            continue
        stored = [*module.buffers(recurse=False)]
        low = decision.param_dtype != torch.float32
        if low and policy.level.keeps_norms_fp32 and not _computes(module):
            # Its buffers too (a BatchNorm's running statistics): its type decides nothing.
            unstored.update((id(tensor), tensor) for tensor in [*own, *stored])
            stored = []
        elif low and policy.level.keeps_norms_fp32 and _composes(module):
            unstored.update((id(param), param) for param in own)
        else:
            stored += own
        for tensor in stored:
            if _castable(tensor):
                key = id(tensor)
                tensors[key] = tensor
                current = wanted.get(key)
                dtype = decision.param_dtype
                wanted[key] = torch.float32 if torch.float32 in (current, dtype) else dtype
    left = [param for key, param in unstored.items() if key not in wanted and _castable(param)]
    for key, dtype in wanted.items():
        if only is None or key in only:
            tensors[key].data = tensors[key].data.to(dtype)
            if (
                dtype != torch.float32
                and policy.level.keeps_norms_fp32
                and isinstance(tensors[key], nn.Parameter)
            ):
                left.append(tensors[key])  # stored low: its first graph may keep it FP32 after all
    return left if only is None else [param for param in left if id(param) in only]


def _composes(module: nn.Module) -> bool:
    """Whether a child of ``module`` holds parameters: its own are read by the code around them."""
    return any(True for child in module.children() for _ in child.parameters())


def _computes(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own. One without (a plain ``nn.Module`` holder: the
    shells of an exported program's module, ``ep.module()``, that held a LayerNorm's or a Linear's
    parameters) computes no op its type names: the code reading its parameters is its parent's."""
    return type(module).forward is not nn.Module.forward


def store_added(module: nn.Module, state: CaptureState, known: Collection[int]) -> None:
    """Store the parameters and buffers of ``module`` whose ids are not in ``known`` (a change after
    conversion added them: a new head, PEFT's LoRA layers) as `store_parameters` stores a model's
    at conversion; those it leaves join ``state.unstored``. Parameter objects are kept (an optimizer
    may hold them already); a fused optimizer holding one now stored low keeps its FP32 value as
    master."""
    added = {
        id(tensor): tensor
        for tensor in (*module.parameters(), *module.buffers())
        if id(tensor) not in known and tensor.is_floating_point()
    }
    if not added:
        return
    before = [(tensor, tensor.data) for tensor in added.values()]
    unstored = store_parameters(module, state.policy, only=added.keys())
    held = {id(param) for param in state.unstored}
    state.unstored += [param for param in unstored if id(param) not in held]
    lowered = [(tensor, data) for tensor, data in before if tensor.dtype != data.dtype]
    masters_for_stored_low([(tensor, data) for tensor, data in lowered if isinstance(tensor, nn.Parameter)])


@contextlib.contextmanager
def storing_unstored(
    module: nn.Module, state: CaptureState, graph: torch.fx.GraphModule, decide: bool
) -> Iterator[frozenset[str]]:
    """Around the convert passes' rewrite of ``graph``, a capture of ``module``: the parameters
    left unstored that the graph reads (their names, given to the conversion's context as its
    ``unstored_parameters``) are planned and stored by the passes (``decide`` False: none,
    for a capture on fake tensors or of a model FSDP2 shards). Afterwards they count as stored, and
    fused optimizers holding one now stored low keep its FP32 value as master; one stored low at
    convert that the passes store FP32 takes its master's exact value and is its own master
    (`masters_for_stored_fp32`). A rewrite that
    raises restores them; a call that fails later undoes all of it (the capture journal)."""
    reads = {node.target for node in graph.graph.nodes if node.op == "get_attr"}
    unstored = {id(param) for param in state.unstored} if decide else set()
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    deciding = {name: tensor for name, tensor in named if id(tensor) in unstored and name in reads}
    before = {id(param): (param, param.data, param.grad) for param in deciding.values()}
    try:
        yield frozenset(deciding)
    except BaseException:
        _restore(before.values())
        raise
    lowered = [
        (param, data) for param, data, _ in before.values() if param.dtype.itemsize < data.dtype.itemsize
    ]
    raised = [param for param, data, _ in before.values() if param.dtype.itemsize > data.dtype.itemsize]
    undo_lowered, undo_raised = masters_for_stored_low(lowered), masters_for_stored_fp32(raised)
    previous = list(state.unstored)
    state.unstored[:] = [param for param in previous if id(param) not in before]

    def undo() -> None:
        undo_raised()
        undo_lowered()
        _restore(before.values())
        state.unstored[:] = previous

    record(undo)


def _restore(saved: Iterable[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]]) -> None:
    for param, data, grad in saved:
        param.data = data
        param.grad = grad
