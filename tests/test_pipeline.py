"""`amp_fx.pipeline`: the pass order written once, as data, and run as written, each pass on the
graph and the one context of the conversion."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from amp_fx.capture.fx import trace
from amp_fx.core.node_info import FORWARD_SIGNATURE_KEY, ORIGINAL_CODE_KEY, POLICY_KEY
from amp_fx.core.policy import preset
from amp_fx.passes.insert_casts import insert_casts
from amp_fx.passes.shared.conversion import Conversion, PassResult
from amp_fx.passes.shared.decisions import plan_parameters
from amp_fx.pipeline import ORIGINAL_CODE_AFTER, PARAMETER_PLAN_AFTER, PASSES, rewrite_graph


def test_each_pass_is_the_function_of_its_own_module():
    names = [step.name for step in PASSES]
    assert len(set(names)) == len(names)
    assert ORIGINAL_CODE_AFTER in names and PARAMETER_PLAN_AFTER in names
    for step in PASSES:
        assert getattr(importlib.import_module(f"amp_fx.passes.{step.name}"), step.name) is step.run


def test_rewrite_graph_runs_the_passes_and_keeps_the_code_before_any_cast():
    policy = preset("O1", torch.bfloat16, "cpu")
    gm = rewrite_graph(trace(torch.nn.Linear(4, 2)), Conversion(policy))
    assert gm(torch.randn(3, 4)).dtype == torch.bfloat16
    assert "bfloat16" in gm.code and "bfloat16" not in gm.meta[ORIGINAL_CODE_KEY]
    assert gm.meta[POLICY_KEY] is policy


def test_the_passes_leave_only_the_records_for_after_the_conversion_in_gm_meta():
    gm = trace(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    traced = set(gm.meta)  # the front end's own records (the forward's signature, ...)
    rewrite_graph(gm, Conversion(preset("O2", torch.bfloat16, "cpu")))
    assert FORWARD_SIGNATURE_KEY in traced
    assert set(gm.meta) == traced | {POLICY_KEY, ORIGINAL_CODE_KEY}
    assert gm.get_parameter("0.weight").dtype == torch.bfloat16
    assert gm.get_parameter("1.weight").dtype == torch.float32  # the plan reached cast_parameters


def test_each_pass_returns_its_graph_module_and_whether_it_modified_it():
    gm, context = trace(nn.Linear(4, 2)), Conversion(preset("O1", torch.bfloat16, "cpu"))
    modified = {}
    for step in PASSES:
        result = step(gm, context)
        assert isinstance(result, PassResult) and result.graph_module is gm
        modified[step.name] = result.modified
        if step.name == PARAMETER_PLAN_AFTER:
            context = plan_parameters(gm, context)
    # Annotations are no modification; casts are; O1 stores no parameter and fuses nothing.
    assert modified["classify"] is False and modified["propagate_dtypes"] is False
    assert modified["insert_casts"] is True
    assert modified["cast_parameters"] is False and modified["fuse_norms"] is False


def test_a_pass_that_reads_the_parameter_plan_before_it_is_made_says_how_to_make_it():
    with pytest.raises(RuntimeError, match="plan_parameters"):
        insert_casts(trace(nn.Linear(4, 2)), Conversion(preset("O2", torch.bfloat16, "cpu")))
