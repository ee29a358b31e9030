"""`amp_fx.pipeline`: the pass order written once, as data, and run as written."""

from __future__ import annotations

import importlib

import torch

from amp_fx.capture.fx import trace
from amp_fx.core.node_info import ORIGINAL_CODE_KEY, POLICY_KEY
from amp_fx.core.policy import preset
from amp_fx.pipeline import ORIGINAL_CODE_AFTER, PASSES, rewrite_graph


def test_each_pass_is_the_function_of_its_own_module():
    names = [step.name for step in PASSES]
    assert len(set(names)) == len(names)
    assert ORIGINAL_CODE_AFTER in names
    for step in PASSES:
        assert getattr(importlib.import_module(f"amp_fx.passes.{step.name}"), step.name) is step.run


def test_rewrite_graph_runs_the_passes_and_keeps_the_code_before_any_cast():
    policy = preset("O1", torch.bfloat16, "cpu")
    gm = rewrite_graph(trace(torch.nn.Linear(4, 2)), policy)
    assert gm(torch.randn(3, 4)).dtype == torch.bfloat16
    assert "bfloat16" in gm.code and "bfloat16" not in gm.meta[ORIGINAL_CODE_KEY]
    assert gm.meta[POLICY_KEY] is policy
