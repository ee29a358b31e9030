"""Following the changes made to a converted GraphModule (the torch.fx front end) after conversion.

The GraphModule holds a `GraphFollower` (at `amp_fx.capture.traced_graph_module.FOLLOWER_ATTR`): the
graphs as traced, rewritten by the passes again when the model changed, or a clear error where the
change needs code the graph traced through and does not keep. It sees changes as the torch.export
front end does, by the change count and `Watch` of `amp_fx.capture.changes`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn

from amp_fx.capture.changes import Watch, same_model, same_objects_and_hooks, take, unchanged
from amp_fx.core.node_info import OTHER_MODE_GRAPH_KEY

logger = logging.getLogger(__name__)

__all__ = ["FollowError", "GraphFollower"]

_HOOK_KEYS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class GraphFollower:
    """What keeps a converted GraphModule (the torch.fx front end) in step with changes made to it
    after conversion. ``sources`` are its graphs as traced, before any pass (one per mode the
    forward reads); ``rewrite(gm, added)`` runs the passes on copies of them again with the modules
    the model holds now, storing the tensors named in ``added`` as conversion stores them.

    The graph calls leaf modules (``call_module``: their own forward runs, with their hooks and
    attributes) and reads tensors; the code of the modules it traced through is not kept. So a
    change to a leaf, or a tensor replaced, is followed by rewriting; a change that would need the
    traced-through code (a module or tensor the graph uses deleted, a module or tensor added where
    traced code would read it, a leaf replaced by a module with children, a hook on a traced-through
    module) raises `FollowError` at each call, before anything runs."""

    def __init__(
        self,
        gm: nn.Module,
        sources: list[torch.fx.Graph],
        rewrite: Callable[[nn.Module, frozenset[str]], None],
    ) -> None:
        self.sources = sources
        self.rewrite = rewrite
        self.calls, self.reads, self.opaque = set(), set(), set()
        for graph in sources:
            for node in graph.nodes:
                if node.op == "call_module":
                    self.calls.add(node.target)
                    if _is_opaque(node):
                        self.opaque.add(node.target)
                elif node.op == "get_attr":
                    self.reads.add(node.target)
        # torch.fx makes the modules it traced through anew, in training mode: give them the
        # model's, so that a module later set to another mode than the model's is seen.
        for name, module in gm.named_modules():
            if not self.in_leaf(name):
                module.__dict__["training"] = gm.training
        self.owner = id(gm)
        self.watch = take(gm)

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphFollower:
        # A deepcopy of the GraphModule (``memo`` maps each object's id to its copy): the copy's
        # follower watches the copied modules, as they were when copied.
        def mapped(value: Any) -> Any:
            return memo.get(id(value), value)

        def mapped_id(key: int) -> int:
            return id(memo[key]) if key in memo else key

        def remap(described: Any) -> Any:
            if isinstance(described, tuple):
                if len(described) == 2 and described[0] == "object" and isinstance(described[1], int):
                    return ("object", mapped_id(described[1]))
                return tuple(remap(item) for item in described)
            return described

        new = copy.copy(self)
        watch = self.watch
        new.owner = mapped_id(self.owner)
        new.watch = dataclasses.replace(
            watch,
            counters=copy.deepcopy(watch.counters, memo),  # the copied modules count in this one
            modules=tuple(
                (name, mapped_id(key), kind, agree, remap(attributes))
                for name, key, kind, agree, attributes in watch.modules
            ),
            objects=tuple(
                (mapped(obj), {k: mapped(v) for k, v in snapshot.items()}) for obj, snapshot in watch.objects
            ),
            held=[mapped(value) for value in watch.held],
            ordered=tuple(mapped(module) for module in watch.ordered),
        )
        return new

    def in_leaf(self, name: str) -> bool:
        """Whether the module ``name`` is one the graph calls, or inside one."""
        return _inside(name, self.calls)

    def __call__(self, gm: nn.Module) -> bool:
        """Follow changes made to ``gm`` since the last call; True if its graphs were rewritten."""
        # Plain Python, which torch.compile traces and guards on, as `unchanged`'s.
        if unchanged(self.watch):
            return False
        return self._follow(gm)

    @torch.compiler.disable
    def _follow(self, gm: nn.Module) -> bool:
        now = take(gm)
        if self.owner != id(gm):  # a copy (deepcopy) holds the graphs of its own modules
            self.owner, self.watch = id(gm), now
            return False
        if same_model(self.watch, now) or self._only_hooks_on_called_modules(gm, now):
            # A hook on a module the graphs call fires as it is: nothing to rewrite (a rewrite
            # would make the modules a pass put in anew, without the hook).
            self.watch = now
            return False
        problems = self.problems(gm, now)
        if problems:
            policy = getattr(gm, "meta", {}).get("amp_fx_policy")
            level = f"{policy.opt_level!r}, dtype={policy.dtype}" if policy is not None else "..."
            raise FollowError(
                f"{type(gm).__name__} (converted with front_end='fx') was changed after conversion in a "
                f"way its graph cannot follow: {'; '.join(problems[:6])}. Its graph was traced from the "
                "model's forward, whose code it does not keep, so it cannot run this change. Make the "
                "change on the original model and convert that again: amp_fx.convert(model, "
                f"{level}, front_end='fx'), or convert with front_end='export', which captures a "
                "changed model again."
            )
        known = self.watch.tensor_ids()
        added = frozenset(
            name
            for name, tensor in [
                *gm.named_parameters(remove_duplicate=False),
                *gm.named_buffers(remove_duplicate=False),
            ]
            if id(tensor) not in known
        )
        logger.info(
            "%s changed since conversion (%s): rewriting its traced graph",
            type(gm).__name__,
            ", ".join(now.differences(self.watch)[:8]),
        )
        self.rewrite(gm, added)
        self.watch = take(gm)
        return True

    def _only_hooks_on_called_modules(self, gm: nn.Module, now: Watch) -> bool:
        old = {entry[0]: entry for entry in self.watch.modules}
        if len(old) != len(now.modules) or not same_objects_and_hooks(self.watch, now):
            return False
        called = _called_modules(gm) | {""}  # hooks on the model itself fire when it is called
        for entry in now.modules:
            before = old.get(entry[0])
            if before is None or before[1] != entry[1] or before[3] != entry[3]:
                return False
            # A wrapper that subclasses the model in place (FSDP2's fully_shard) keeps its forward.
            if before[2] is not entry[2] and not (entry[0] == "" and issubclass(entry[2], before[2])):
                return False
            attributes, previous = dict(entry[4]), dict(before[4])
            changed = {
                key for key in attributes.keys() | previous.keys() if attributes.get(key) != previous.get(key)
            }
            if changed and (not changed <= set(_HOOK_KEYS) or not _inside(entry[0], called)):
                return False
        return True

    def accept(self, gm: nn.Module) -> None:
        """Take ``gm`` as it is now as the state its graphs follow, for a change amp_fx made
        knowing the graphs stay right (`amp_fx.training.fsdp.fully_shard_converted` shards the parameters
        the graphs read and hooks the modules they call)."""
        self.owner, self.watch = id(gm), take(gm)

    def problems(self, gm: nn.Module, now: Watch) -> list[str]:
        """What changed that the graph cannot follow (the class docstring), one phrase each."""
        calls, reads, opaque = self.calls, self.reads, self.opaque
        problems = []
        for target in sorted(calls):
            if _resolve(gm, target) is None:
                problems.append(f"`{target}`, a module the graph calls, was deleted")
        for target in sorted(reads):
            if _resolve(gm, target) is None:
                problems.append(f"`{target}`, which the graph reads, was deleted or set to None")
        old = {entry[0]: entry for entry in self.watch.modules}
        new = {entry[0]: entry for entry in now.modules}
        for target in sorted(calls - opaque):
            before, after = old.get(target), new.get(target)
            if before is None or after is None or before[1] == after[1] or before[2] is after[2]:
                continue
            if any(True for _ in gm.get_submodule(target).children()):
                problems.append(
                    f"`{target}` was replaced by a {after[2].__module__}.{after[2].__qualname__}, a "
                    "module with submodules the "
                    "graph would have to trace through"
                )
        mode_graphs = len(self.sources) > 1
        for name, entry in new.items():
            if self.in_leaf(name):
                continue
            shown = name or "the model"
            before = old.get(name)
            if before is None:
                problems.append(f"`{name}` was added where the graph's traced code would call it")
                continue
            if before[1] != entry[1]:
                continue  # a module the graph does not call, replaced (held for its state)
            if mode_graphs and before[3] != entry[3]:
                problems.append(f"{shown}'s train/eval mode differs from the model's (a graph per mode)")
            attributes, previous = dict(entry[4]), dict(before[4])
            for key in _HOOK_KEYS:
                if attributes.get(key) != previous.get(key) and getattr(gm.get_submodule(name), key, None):
                    problems.append(f"a hook was registered on `{shown}`, which the graph traced through")
            for key in ("_parameters", "_buffers"):
                added = _keys(attributes.get(key)) - _keys(previous.get(key))
                problems += [
                    f"`{name + '.' if name else ''}{attribute}` was added where traced code would read it"
                    for attribute in sorted(added)
                    if getattr(gm.get_submodule(name), attribute, None) is not None
                ]
        return problems


def _inside(name: str, leaves: set[str]) -> bool:
    return any(name == leaf or name.startswith(leaf + ".") for leaf in leaves)


def _called_modules(gm: nn.Module) -> set[str]:
    """The modules the rewritten graphs (each mode's) call by ``call_module``."""
    graphs = [gm.graph]
    other = gm.meta.get(OTHER_MODE_GRAPH_KEY)
    if other is not None:
        graphs.append(other[1])
    return {node.target for graph in graphs for node in graph.nodes if node.op == "call_module"}


class FollowError(RuntimeError):
    """A change made to a converted GraphModule that its traced graph cannot follow."""


def _keys(described: Any) -> set[str]:
    # A dict as `_describe` gives it: (type, ((key, value), ...)).
    if not isinstance(described, tuple) or len(described) != 2 or not isinstance(described[1], tuple):
        return set()
    return {key for key, _ in described[1]}


def _resolve(gm: nn.Module, target: str) -> Any:
    owner: Any = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def _is_opaque(node: torch.fx.Node) -> bool:
    from amp_fx.core.node_info import node_info
    from amp_fx.core.policy import Rule

    return node_info(node).rule is Rule.OPAQUE
