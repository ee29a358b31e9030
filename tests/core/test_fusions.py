"""amp_fx.core.fusions: the one table of fused kernels, and the files and names that follow from it.

docs/DESIGN.md ("Adding a fusion") lists the files a new fusion touches; these tests keep the list
true: each row's files exist, its flag is a `Policy` field, its pass is in `PASSES`, and every
fused op name the policy knows comes from the table.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import amp_fx.ops
from amp_fx.core.fusions import FUSED_OPS, FUSION_TABLE, FUSIONS, FusedOp, OutputDtype, lookup_fusion
from amp_fx.core.op_lists import DEVICE_TYPES, KNOWN_OPS, OP_ALIASES, PASSTHROUGH_OPS
from amp_fx.core.opt_levels import OPT_LEVELS, lookup_opt_level
from amp_fx.core.policy import Policy, preset
from amp_fx.pipeline import PASSES

ROOT = Path(__file__).resolve().parents[2]
# The files of a fusion, as docs/DESIGN.md ("Adding a fusion") writes them.
FILES = (
    "kernels/<family>/",
    "amp_fx/ops/<module>.py",
    "passes/<pass>.py",
    "amp_fx/core/fusions.py",
    "amp_fx/core/policy.py",
    "tests/kernels/test_<family>.py",
    "tests/ops/test_<module>.py",
    "tests/passes/test_<pass>.py",
    "benchmarks/bench_<family>.py",
)


def _design_section(title: str) -> str:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_rows_are_frozen_and_the_tables_read_only() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FUSION_TABLE["fused_norms"].cuda_only = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        FUSION_TABLE["fused_foo"] = FUSIONS[0]  # type: ignore[index]
    with pytest.raises(TypeError):
        FUSED_OPS["foo"] = FUSIONS[0].ops[0]  # type: ignore[index]


def test_flags_passes_and_op_names_are_each_one_rows() -> None:
    assert list(FUSION_TABLE) == [fusion.flag for fusion in FUSIONS]
    assert len({fusion.pass_name for fusion in FUSIONS}) == len(FUSIONS)
    assert len(FUSED_OPS) == sum(len(fusion.ops) for fusion in FUSIONS)
    assert all(fusion.flag.startswith("fused_") for fusion in FUSIONS)


def test_a_flag_needs_only_a_flag_decided_before_it() -> None:
    for index, fusion in enumerate(FUSIONS):
        if fusion.needs is not None:
            assert fusion.needs in [earlier.flag for earlier in FUSIONS[:index]], fusion.flag


def test_lookup_names_the_flags() -> None:
    assert lookup_fusion("fused_norms") is FUSIONS[0]
    with pytest.raises(ValueError, match="did you mean 'fused_norms'.*The flags are fused_norms, "):
        lookup_fusion("fused_norm")


def test_a_fused_op_is_an_op_of_its_own_or_another_spelling() -> None:
    with pytest.raises(ValueError, match="give same_as .* or output"):
        FusedOp("foo")
    with pytest.raises(ValueError, match="not both"):
        FusedOp("foo", same_as="linear", output=OutputDtype.PROMOTED)


# ---- the Policy ----------------------------------------------------------------------------------
def test_every_flag_is_a_policy_field_defaulting_from_its_row() -> None:
    fields = {field.name: field for field in dataclasses.fields(Policy) if "fusion" in field.metadata}
    assert sorted(fields) == sorted(FUSION_TABLE) == sorted(Policy.fusion_flags())
    for flag, field in fields.items():
        assert field.metadata["fusion"] is FUSION_TABLE[flag] and field.default is False


@pytest.mark.parametrize("level", OPT_LEVELS)
@pytest.mark.parametrize("device", DEVICE_TYPES)
def test_each_switch_defaults_as_its_row_says(level: str, device: str) -> None:
    policy = preset(level, device_type=device)
    for fusion in FUSIONS:
        expected = (
            lookup_opt_level(level).fuses_kernels
            and (not fusion.cuda_only or device == "cuda")
            and (fusion.needs is None or getattr(policy, fusion.needs))
        )
        assert getattr(policy, fusion.flag) is expected, fusion.flag
    undecided = preset(level)  # the CUDA-only defaults wait for the device type
    for fusion in FUSIONS:
        assert (getattr(undecided, fusion.flag) is None) == fusion.cuda_only, fusion.flag


def test_a_switch_is_off_by_default_where_the_switch_it_needs_is_off() -> None:
    for fusion in FUSIONS:
        if fusion.needs is not None:
            policy = preset("O2", device_type="cuda", **{fusion.needs: False})
            assert getattr(policy, fusion.flag) is False, fusion.flag
            assert getattr(preset("O2", device_type="cuda"), fusion.flag) is True


def test_the_policy_and_preset_docstrings_list_no_switch_by_hand() -> None:
    """The switches are documented by their rows (`Fusion.description`); doctest lines may use one."""
    for documented in (Policy, preset):
        prose = "\n".join(line for line in documented.__doc__.splitlines() if ">>>" not in line)
        assert not re.findall(r"\bfused_[a-z_]+", prose), documented.__name__


# ---- the pipeline --------------------------------------------------------------------------------
def test_the_fusion_passes_end_the_pipeline_in_the_tables_order() -> None:
    names = [step.name for step in PASSES]
    assert names[-len(FUSIONS) :] == [fusion.pass_name for fusion in FUSIONS]
    assert not {fusion.pass_name for fusion in FUSIONS} & set(names[: -len(FUSIONS)])


# ---- the op names --------------------------------------------------------------------------------
def test_fused_ops_are_functions_of_their_op_module() -> None:
    for fusion in FUSIONS:
        module = importlib.import_module(f"amp_fx.ops.{fusion.ops_module}")
        for op in fusion.ops:
            function = getattr(module, op.name)
            assert callable(function) and function.__name__ == op.name, (fusion.flag, op.name)


def test_fused_ops_are_in_the_policys_vocabulary() -> None:
    for name, op in FUSED_OPS.items():
        if op.same_as is None:
            assert name in PASSTHROUGH_OPS and op.output is not None
        else:
            assert OP_ALIASES[name] == op.same_as and op.same_as in KNOWN_OPS


def _ops_functions() -> set[str]:
    """The public names of the modules of `amp_fx.ops` (the functions and modules graphs call)."""
    names: set[str] = set()
    for module_info in pkgutil.iter_modules(amp_fx.ops.__path__):
        module = importlib.import_module(f"amp_fx.ops.{module_info.name}")
        names |= set(getattr(module, "__all__", ()))
    return names


def test_no_fused_op_enters_the_policys_vocabulary_but_from_the_table() -> None:
    """An op name that a function of amp_fx/ops has is known to the policy only through a row
    (or because it is an aten op's name, as max_pool2d)."""
    vocabulary = KNOWN_OPS | set(OP_ALIASES)
    named = {name for name in _ops_functions() & vocabulary if not hasattr(torch.ops.aten, name)}
    assert named == set(FUSED_OPS)


def test_no_module_of_the_policy_writes_a_fused_op_name() -> None:
    """The op lists, op facts, preset rules, policy, dtype rules, pipeline and report read the
    table: none holds a fused op's name or a fusion pass's name as a string of its own."""
    names = set(FUSED_OPS) | {fusion.pass_name for fusion in FUSIONS}
    paths = [
        *sorted((ROOT / "amp_fx" / "core").glob("*.py")),
        *sorted((ROOT / "amp_fx" / "inspect").glob("*.py")),
        *sorted((ROOT / "passes" / "propagate_dtypes").glob("*.py")),
        ROOT / "amp_fx" / "pipeline.py",
    ]
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}"
        for path in paths
        if path.name != "fusions.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not found, "\n".join(found)


# ---- the files docs/DESIGN.md lists --------------------------------------------------------------
def test_design_lists_the_files_of_a_fusion() -> None:
    section = _design_section("Adding a fusion")
    for template in FILES:
        assert f"`{template}" in section, template


@pytest.mark.parametrize("fusion", FUSIONS, ids=lambda fusion: fusion.flag)
def test_each_fusion_has_the_files_design_lists(fusion) -> None:
    values = {"<family>": fusion.kernel_family, "<module>": fusion.ops_module, "<pass>": fusion.pass_name}
    for template in FILES:
        if "<family>" in template and fusion.kernel_family is None:
            continue  # an op module that computes in torch alone
        path = template
        for placeholder, value in values.items():
            path = path.replace(placeholder, value or "")
        # A pass with a helper of its own is a folder.
        folder = ROOT / path.removesuffix(".py") / "__init__.py"
        assert (ROOT / path).exists() or (template == "passes/<pass>.py" and folder.exists()), path
