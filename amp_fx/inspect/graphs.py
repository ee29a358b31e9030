"""The rewritten graphs of a converted model, either front end, each with the label the report
shows it under and the module it belongs to: what `amp_fx.report`, `amp_fx.watch` and the views
of recorded ranges walk.

    >>> import torch, amp_fx
    >>> gm = amp_fx.convert(torch.nn.Linear(4, 2), "O2", device_type="cpu")
    >>> [(g.label, g.module, g.root) for g in model_graphs(gm)]
    [('<model>', '', True)]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from amp_fx.capture.captured_model import CapturedModel, capture_states

__all__ = ["ModelGraph", "labelled_graphs", "model_graphs"]


@dataclass(frozen=True)
class ModelGraph:
    """One rewritten graph of a converted model."""

    # ``<model>`` for the model's own, else the captured module's qualified name; ``#2`` and on
    # for a module's later graphs (another argument structure or mode).
    label: str
    # The qualified name of the module the graph computes ("" for the model): its nodes' module
    # names are relative to it.
    module: str
    gm: torch.fx.GraphModule
    # Whether a call of the model itself runs it (the graph of the model, not of a part).
    root: bool


def model_graphs(model: torch.nn.Module) -> list[ModelGraph]:
    """Each rewritten graph of ``model``: its own (a torch.fx front-end model) and those its
    torch.export-captured modules hold, in ``named_modules`` order. Raises TypeError for a model
    `amp_fx.convert` did not return."""
    if not isinstance(model, (torch.fx.GraphModule, CapturedModel)):
        raise TypeError(
            f"report expects a model returned by amp_fx.convert, got {type(model).__name__}; "
            "call amp_fx.report(amp_fx.convert(model, opt_level))"
        )
    # A torch.export front-end model runs only the graphs it captures, also where the model given
    # to convert was a GraphModule (an ExportedProgram's ``.module()``): its own graph is not run.
    own = isinstance(model, torch.fx.GraphModule) and not isinstance(model, CapturedModel)
    graphs = [ModelGraph("<model>", "", model, True)] if own else []
    for name, state in capture_states(model):
        for index, graph in enumerate(state.graphs):
            label = name or "<model>"
            label = label if index == 0 else f"{label} #{index + 1}"
            graphs.append(ModelGraph(label, name, graph, not own and name == ""))
    return graphs


def labelled_graphs(model: torch.nn.Module) -> dict[str, torch.fx.GraphModule]:
    """Label -> each rewritten graph of ``model`` (`model_graphs`)."""
    return {graph.label: graph.gm for graph in model_graphs(model)}
