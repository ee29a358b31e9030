"""cut_module_regions: each call of a chosen module becomes one region, the nodes the passes added
(no module of their own) included, wherever the passes placed them."""

from __future__ import annotations

import torch
import torch.fx

from amp_fx.passes.shared.module_regions import cut_module_regions


def _stack(*paths: str) -> dict:
    return {path or "root": (path, torch.nn.Module) for path in ("", *paths)}


def test_a_cast_placed_far_from_its_user_joins_the_users_one_region() -> None:
    # h -> cast (added by a pass, no module) ... the model's own op ... head(cast, t): the head's
    # call is one region, not one for the cast and one for the op that reads it.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    h = graph.call_function(torch.neg, (x,))
    cast = graph.call_method("to", (h, torch.bfloat16))
    t = graph.call_function(torch.abs, (x,))
    head = graph.call_function(torch.mul, (cast, t))
    graph.output(head)
    h.meta["nn_module_stack"] = t.meta["nn_module_stack"] = _stack()
    head.meta["nn_module_stack"] = _stack("head")
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = torch.randn(3)
    expected = gm(inputs)

    assert cut_module_regions(gm, {"head"}, "cut_") == [("cut_0", "head")]
    region = gm.get_submodule("cut_0")
    assert [n.target for n in region.graph.nodes if n.op == "call_method"] == ["to"]
    torch.testing.assert_close(gm(inputs), expected, rtol=0, atol=0)
