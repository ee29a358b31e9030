"""Keeping torch.fx's registry of ``torch.fx.wrap``-ed functions to the code that can still run.

Every node amp_fx inserts as a call (casts, autograd Functions, fused ops) is marked as torch.fx
marks a wrapped call (``node.meta["is_wrapped"]``), so that tracing a converted graph again keeps
it a call. torch.fx's code generator does that by putting ``wrap("<name>")`` in each generated
module, which registers that module's globals, a new dict at every ``recompile()``, in
``torch.fx._symbolic_trace._wrapped_fns_to_patch`` for good; and every later symbolic trace
patches every registered function. A process that converts many models (a test suite: about a
thousand graphs) made each trace 10x slower and kept every graph's globals alive.

`forget_unreachable_wraps` drops the registrations of globals no code references any more (the
forward of a graph that was recompiled or freed): no function can run with them, so no trace can
reach them. Those of live graphs and of real modules (torchvision's) stay.

    >>> import gc
    >>> import amp_fx
    >>> before = set(_REGISTRY)
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softmax(-1))
    >>> converted = amp_fx.convert(model, "O1", dtype=torch.bfloat16, device_type="cpu")
    >>> added = set(_REGISTRY) - before  # its casts' globals
    >>> len(added) > 0
    True
    >>> del converted
    >>> _ = gc.collect()
    >>> forget_unreachable_wraps()
    >>> added & set(_REGISTRY)
    set()
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Mapping

import torch.fx._symbolic_trace

__all__ = ["forget_unreachable_wraps"]

# (id(globals), function name) -> the globals of the module that called torch.fx.wrap.
_REGISTRY = torch.fx._symbolic_trace._wrapped_fns_to_patch


def _reference_counts(mapping: Mapping[object, object]) -> dict[object, int]:
    return {key: sys.getrefcount(value) for key, value in mapping.items()}


# What `_reference_counts` reads for a value nothing but one entry of its mapping references (the
# count includes the loop's and the call's own references, which differ between Python versions).
_ONLY_THE_MAPPING = _reference_counts({0: {}})[0]


def forget_unreachable_wraps() -> None:
    """Drop the torch.fx.wrap registrations whose globals nothing but the registry references.

    One generated module that wraps several functions is registered once per function: its
    globals are unreachable when the registry's entries are all their references.
    """
    # A generator, not a loop: a loop variable would keep the last globals referenced here.
    entries = collections.Counter(id(frame_dict) for frame_dict in _REGISTRY.values())
    for key, count in _reference_counts(_REGISTRY).items():
        if count - (entries[id(_REGISTRY[key])] - 1) <= _ONLY_THE_MAPPING:
            del _REGISTRY[key]
