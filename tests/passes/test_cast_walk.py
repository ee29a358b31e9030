"""cast_walk: the one way the matchers walk casts, on graphs traced from real code (named by
`normalize_ops`; the references: the dtypes the casts convert to when run)."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from amp_fx.core.node_info import node_info
from amp_fx.passes.normalize_ops import normalize_ops
from amp_fx.passes.shared.cast_walk import cast_target, known_dtype, output_readers, under_casts
from amp_fx.passes.shared.dtypes import ASSUMED_DTYPE_NOTE, DERIVED_ASSUMED_DTYPE_NOTE

CASTS = {
    "to(dtype)": lambda x, y: x.to(torch.float16),
    "to(dtype=)": lambda x, y: x.to(dtype=torch.bfloat16),
    "float()": lambda x, y: x.float(),
    "double()": lambda x, y: x.double(),
    "int()": lambda x, y: x.int(),
    "type_as(y)": lambda x, y: x.type_as(y),
    "to(y.dtype)": lambda x, y: x.to(y.dtype),
}


def _graph(function) -> tuple[torch.fx.GraphModule, dict[str, torch.fx.Node]]:
    gm = normalize_ops(torch.fx.symbolic_trace(function)).graph_module
    return gm, {node.name: node for node in gm.graph.nodes}


def _cast(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if node_info(n).op == "to")


@pytest.mark.parametrize("spelling", list(CASTS))
def test_cast_target_is_the_dtype_the_cast_makes(spelling: str) -> None:
    gm, nodes = _graph(CASTS[spelling])
    node_info(nodes["y"]).out_dtype = torch.bfloat16  # as propagate_dtypes records a known dtype
    made = CASTS[spelling](torch.ones(2), torch.ones(2, dtype=torch.bfloat16)).dtype
    assert cast_target(_cast(gm)) == made


def test_no_target_for_a_device_move_or_an_assumed_dtype() -> None:
    gm, _ = _graph(lambda x, y: x.to("cpu"))
    assert cast_target(_cast(gm)) is None
    gm, nodes = _graph(CASTS["type_as(y)"])
    node_info(nodes["y"]).out_dtype = torch.float32
    node_info(nodes["y"]).notes.append(ASSUMED_DTYPE_NOTE)  # a model input without example_inputs
    assert known_dtype(nodes["y"]) is None and cast_target(_cast(gm)) is None
    node_info(nodes["y"]).notes[:] = [DERIVED_ASSUMED_DTYPE_NOTE]  # computed from one: as recorded
    assert cast_target(_cast(gm)) == torch.float32


def test_under_casts_goes_through_the_casts_the_predicate_lets_through() -> None:
    gm, nodes = _graph(lambda x: x.half().float().double())
    last = next(iter(gm.graph.output_node().all_input_nodes))
    assert under_casts(last) == (nodes["x"], [last, nodes["float_1"], nodes["half"]])
    to_floating = under_casts(last, lambda cast: cast_target(cast) in (torch.float32, torch.float16))
    assert to_floating == (last, [])
    widening = under_casts(nodes["float_1"], lambda cast: cast_target(cast) != torch.float64)
    assert widening == (nodes["x"], [nodes["float_1"], nodes["half"]])
    assert under_casts(3) == (3, [])


def _two_views(x):
    e = x.exp()
    return e.view(-1).half(), e.reshape(2, -1).half()


def _view_read_twice(x):
    v = x.exp().view(-1)
    return v.half(), v.float(), v.size()


def test_output_readers_walk_every_reshape_to_the_readers() -> None:
    gm, nodes = _graph(_two_views)
    readers = output_readers(nodes["exp"])
    assert readers.reshapes == (nodes["view"], nodes["reshape"])
    assert readers.ends == (nodes["half"], nodes["half_1"]) and not readers.one_path
    gm, nodes = _graph(_view_read_twice)
    readers = output_readers(nodes["exp"])
    assert readers.reshapes == (nodes["view"],) and readers.one_path
    assert readers.ends == (nodes["half"], nodes["float_1"])
    assert readers.metadata_reads == (nodes["size"],)
