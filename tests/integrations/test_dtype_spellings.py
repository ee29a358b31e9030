"""One dtype parser for every entry point: `amp_fx.convert`, `amp_fx.preset`, `AmpTrainer`,
`AmpPrecision` and `amp.initialize` accept the same spellings of fp16 and bf16, refuse the same
others with one message naming the accepted ones, and scale fp16 losses wherever the opt level's
loss-scale setting says so, however the dtype was spelt."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import amp_fx
import amp_fx.amp._state as amp_state
from amp_fx import amp
from amp_fx.core.dtypes import LOW_PRECISION_DTYPE_NAMES
from amp_fx.core.opt_levels import OPT_LEVELS, lookup_opt_level

FP16_SPELLINGS = [torch.float16, "float16", "fp16", "half", "torch.float16", "FP16", "Half"]
BF16_SPELLINGS = [torch.bfloat16, "bfloat16", "bf16", "torch.bfloat16", "BF16"]
SPELLINGS = [(s, torch.float16) for s in FP16_SPELLINGS] + [(s, torch.bfloat16) for s in BF16_SPELLINGS]
REFUSED = [torch.float32, "float32", "fp32", "float", "f16", "", "int8", 16]
LEVELS = list(OPT_LEVELS)


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture(autouse=True)
def clean_amp_state():
    amp_state._current = None
    yield
    amp_state._current = None


def test_every_name_in_the_table_is_a_spelling_tested_here() -> None:
    """The table the parser reads and the spellings above agree: a name added to one is tested."""
    tested = {s.lower().removeprefix("torch.") for s, _ in SPELLINGS if isinstance(s, str)}
    assert tested == set(LOW_PRECISION_DTYPE_NAMES)


@pytest.mark.parametrize("spelling, dtype", SPELLINGS)
def test_convert_and_preset_accept_every_spelling(spelling, dtype) -> None:
    assert amp_fx.preset("O2", dtype=spelling).dtype == dtype
    converted = amp_fx.convert(small_model(), "O2", dtype=spelling, device_type="cpu")
    assert converted.get_submodule("0").weight.dtype == dtype
    # The same dtype, spelt otherwise, agrees with a policy.
    policy = amp_fx.preset("O2", dtype=dtype, device_type="cpu")
    agreed = amp_fx.convert(small_model(), policy=policy, dtype=spelling)
    assert agreed.get_submodule("0").weight.dtype == dtype


@pytest.mark.parametrize("policy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_convert_refuses_a_dtype_that_contradicts_the_policy(policy_dtype, level) -> None:
    """Also the default dtype spelt out (fp16 against a bf16 policy), which used to be kept silently."""
    other = torch.float16 if policy_dtype == torch.bfloat16 else torch.bfloat16
    policy = amp_fx.preset(level, dtype=policy_dtype)
    for spelling in (other, str(other), amp_fx.core.dtypes.short_dtype_name(other)):
        with pytest.raises(ValueError, match=r"dtype torch\.\w+ vs the policy's .*pass only the policy"):
            amp_fx.convert(small_model(), policy=policy, dtype=spelling)
    # Left out, the policy decides.
    converted = amp_fx.convert(small_model(), policy=policy)
    assert converted.meta["amp_fx_policy"].dtype == policy_dtype


@pytest.mark.parametrize("spelling, dtype", SPELLINGS)
@pytest.mark.parametrize("level", LEVELS)
def test_amp_precision_accepts_every_spelling_and_scales_fp16(spelling, dtype, level) -> None:
    from amp_fx.integrations.lightning import AmpPrecision

    plugin = AmpPrecision(level, dtype=spelling)
    assert plugin.dtype == dtype
    scaled = dtype == torch.float16 and lookup_opt_level(level).dynamic_loss_scale
    assert plugin.loss_scaler.is_enabled() is scaled
    assert plugin.precision == ("16-mixed" if dtype == torch.float16 else "bf16-mixed")
    # A spelling of the policy's own dtype agrees with it.
    assert AmpPrecision(dtype=spelling, policy=amp_fx.preset(level, dtype=dtype)).dtype == dtype


@pytest.mark.parametrize("spelling, dtype", SPELLINGS)
@pytest.mark.parametrize("level", LEVELS)
def test_amp_initialize_accepts_every_spelling_and_scales_as_the_level_says(spelling, dtype, level) -> None:
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, dtype=spelling, verbosity=0)
    dynamic = lookup_opt_level(level).dynamic_loss_scale
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == (2.0**16 if dynamic else 1.0)
    lowered = lookup_opt_level(level).stores_weights_low
    assert model.get_submodule("0").weight.dtype == (dtype if lowered else torch.float32)
    if lookup_opt_level(level).lowers_precision:
        assert model.meta["amp_fx_policy"].dtype == dtype


@pytest.mark.parametrize("spelling, dtype", SPELLINGS)
def test_amp_trainer_accepts_every_spelling_and_scales_fp16(spelling, dtype, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from amp_fx.integrations.transformers import AmpTrainer

    for level in ("O1", "O2"):
        args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = AmpTrainer(model=small_model(), args=args, opt_level=level, dtype=spelling)
        assert trainer._amp_setup.dtype == dtype
        assert (trainer.loss_scaler is not None) is (dtype == torch.float16)


@pytest.mark.parametrize("bad", REFUSED)
def test_every_entry_point_refuses_other_dtypes_naming_the_accepted_ones(bad, tmp_path: Path) -> None:
    from amp_fx.integrations.lightning import AmpPrecision

    message = r"dtype must be torch.float16 or torch.bfloat16 \(or its name: 'float16', 'fp16', 'half'"
    with pytest.raises(ValueError, match=message):
        amp_fx.preset("O2", dtype=bad)
    with pytest.raises(ValueError, match=message):
        amp_fx.convert(small_model(), "O2", dtype=bad)
    with pytest.raises(ValueError, match=message):
        AmpPrecision("O2", dtype=bad)
    model = small_model()
    with pytest.raises(ValueError, match=message):
        amp.initialize(model, opt_level="O2", dtype=bad, verbosity=0)
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from amp_fx.integrations.transformers import AmpTrainer

    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError, match=message):
        AmpTrainer(model=small_model(), args=args, dtype=bad)
