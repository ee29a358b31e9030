"""`amp_fx.master_state_dict` returns the FP32 masters the optimizers hold, and saved states resume bitwise.

References: the optimizer's own masters (`amp_fx.optim.master_params`, `amp.master_params`) and
``model.state_dict()``. Every test first checks that the steps left masters that the stored
low-precision copies cannot represent, so returning the rounded copies would fail it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import amp_fx
from amp_fx import amp
from amp_fx.optim import FusedAdam, FusedSGD, master_params

LOW = (torch.float16, torch.bfloat16)


def _mlp(seed: int = 0) -> nn.Module:
    """Linear weights (low at O2), BatchNorm and LayerNorm (FP32 at O2, BatchNorm with buffers)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Linear(16, 4))  # fmt: skip


def _batches(count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(123)
    return [
        (torch.randn(4, 8, generator=generator), torch.randint(0, 4, (4,), generator=generator))
        for _ in range(count)
    ]


def _make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "FusedAdam":
        return FusedAdam(params, lr=1e-3)
    return FusedSGD(params, lr=1e-2, momentum=0.9)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for x, y in _batches(steps):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _masters_by_key(model: nn.Module, masters) -> dict[str, Tensor]:
    """Every state_dict key of a parameter (tied ones too) -> its master, pairing in parameters() order."""
    by_id = {id(p): m for p, m in zip(model.parameters(), masters, strict=True)}
    return {name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def _assert_masters_then_rest(model: nn.Module, result: dict[str, Tensor], masters: dict[str, Tensor]) -> int:
    """The result has state_dict's keys, the masters of low-precision parameters (FP32, not the rounded
    copies, no copy made) and state_dict's values elsewhere; returns how many masters it checked."""
    state = model.state_dict()
    assert list(result) == list(state)
    checked = 0
    for key, value in result.items():
        assert type(value) is torch.Tensor, key
        assert not value.requires_grad, key
        if state[key].dtype in LOW:
            master = masters[key]
            assert value.dtype == torch.float32 and torch.equal(value, master), key
            assert value.data_ptr() == master.data_ptr(), key  # the master itself, detached: no copy
            assert not torch.equal(value, state[key].float()), (
                f"{key}: the steps left masters the copy rounds"
            )
            checked += 1
        else:
            assert value.dtype == state[key].dtype and torch.equal(value, state[key]), key
    return checked


# ---- the torch.fx front end -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("optimizer_kind", ["FusedAdam", "FusedSGD"])
def test_fx_model_after_steps_gives_the_optimizers_masters(dtype, optimizer_kind) -> None:
    model = amp_fx.convert(_mlp(), "O2", dtype=dtype, front_end="fx")
    assert isinstance(model, torch.fx.GraphModule)
    optimizer = _make_optimizer(optimizer_kind, model.parameters())
    _train(model, optimizer, steps=3)

    result = amp_fx.master_state_dict(model)
    masters = _masters_by_key(model, master_params(optimizer))
    assert _assert_masters_then_rest(model, result, masters) == 6  # three Linear layers, weight and bias

    # A freshly converted model (other initial weights) and a fresh optimizer take the masters exactly.
    fresh = amp_fx.convert(_mlp(seed=1), "O2", dtype=dtype, front_end="fx")
    fresh_optimizer = _make_optimizer(optimizer_kind, fresh.parameters())
    fresh.load_state_dict(result)
    fresh_masters = _masters_by_key(fresh, master_params(fresh_optimizer))
    for key, master in masters.items():
        assert torch.equal(fresh_masters[key], master), key
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_without_masters_it_is_the_state_dict(opt_level) -> None:
    model = amp_fx.convert(_mlp(), opt_level, dtype=torch.bfloat16, front_end="fx")
    if opt_level != "O2":  # FP32 parameters are their own masters: nothing to replace
        _train(model, FusedAdam(model.parameters(), lr=1e-3), steps=2)
    state, result = model.state_dict(), amp_fx.master_state_dict(model)
    assert list(result) == list(state)
    assert all(v.dtype == state[k].dtype and torch.equal(v, state[k]) for k, v in result.items())
    if opt_level == "O2":
        assert any(v.dtype == torch.bfloat16 for v in result.values())  # no optimizer: the stored copies


def test_masters_of_a_master_weights_false_group_are_not_invented() -> None:
    model = amp_fx.convert(_mlp(), "O2", dtype=torch.float16, front_end="fx")
    _train(model, FusedAdam(model.parameters(), lr=1e-3, master_weights=False), steps=2)
    state, result = model.state_dict(), amp_fx.master_state_dict(model)
    assert all(v.dtype == state[k].dtype and torch.equal(v, state[k]) for k, v in result.items())


def test_any_module_an_amp_fx_optimizer_trains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4)).half()  # not converted: .half() by hand
    optimizer = FusedSGD(model.parameters(), lr=0.1)
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    optimizer.step()
    result = amp_fx.master_state_dict(model)
    assert _assert_masters_then_rest(model, result, _masters_by_key(model, master_params(optimizer))) == 4


def test_two_optimizers_with_masters_for_one_parameter_give_one_of_them_and_a_warning(caplog) -> None:
    model = nn.Linear(4, 2).half()
    first, second = FusedSGD(model.parameters(), lr=0.1), FusedSGD(model.parameters(), lr=0.1)
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    second.step()  # the two optimizers' masters now differ
    with caplog.at_level("WARNING", logger="amp_fx.training.saving"):
        result = amp_fx.master_state_dict(model)
    assert "2 optimizers keep FP32 masters for weight" in caplog.text
    first_masters, second_masters = (_masters_by_key(model, master_params(o)) for o in (first, second))
    assert not torch.equal(first_masters["weight"], second_masters["weight"])
    assert any(
        all(torch.equal(result[k], m[k]) for k in ("weight", "bias")) for m in (first_masters, second_masters)
    )


@pytest.mark.parametrize("not_a_model", [{"weight": torch.zeros(1)}, "model", None])
def test_not_a_module_is_a_type_error_naming_the_fix(not_a_model) -> None:
    with pytest.raises(TypeError, match="master_state_dict needs the model .*pass the model amp_fx.convert"):
        amp_fx.master_state_dict(not_a_model)


def test_an_optimizer_passed_instead_of_the_model_is_a_type_error() -> None:
    optimizer = FusedAdam(nn.Linear(2, 2).half().parameters())
    with pytest.raises(TypeError, match="got FusedAdam"):
        amp_fx.master_state_dict(optimizer)


# ---- the torch.export front end: a Hugging Face GPT-2 ----------------------------------------
def _gpt2_config():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)


def _token_batches(count: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (2, 8), generator=generator) for _ in range(count)]


def test_export_front_end_gpt2_gives_masters_with_ties_and_loads_into_the_original_class(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    config = _gpt2_config()
    torch.manual_seed(0)
    converted = amp_fx.convert(GPT2LMHeadModel(config), "O2", dtype=torch.bfloat16)
    assert isinstance(converted, GPT2LMHeadModel) and not isinstance(converted, torch.fx.GraphModule)
    optimizer = FusedAdam(converted.parameters(), lr=1e-3)
    for ids in _token_batches(3):
        out = converted(input_ids=ids, labels=ids)
        assert type(out.loss) is torch.Tensor
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    result = amp_fx.master_state_dict(converted)
    masters = _masters_by_key(converted, master_params(optimizer))
    assert _assert_masters_then_rest(converted, result, masters) > 0
    assert result["transformer.wte.weight"] is result["lm_head.weight"]
    assert all(torch.equal(result[key], master) for key, master in masters.items())

    fresh = GPT2LMHeadModel(config)
    fresh.load_state_dict(amp_fx.master_state_dict(converted))
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    for name, param in fresh.named_parameters(remove_duplicate=False):
        assert param.dtype == torch.float32 and torch.equal(param, masters[name]), name

    # The one line save_pretrained needs; the original class reads back exactly the masters.
    converted.save_pretrained(tmp_path, state_dict=amp_fx.master_state_dict(converted))
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    for name, param in reloaded.named_parameters(remove_duplicate=False):
        assert type(param.data) is torch.Tensor and torch.equal(param, masters[name]), name


# ---- amp.initialize and the Apex checkpoint recipe -------------------------------------------
def _mlp_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _gpt2_loss(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(input_ids=ids, labels=ids)
    assert type(out.loss) is torch.Tensor
    return out.loss


def _amp_steps(model, optimizer, loss_fn, batches) -> None:
    for batch in batches:
        loss = loss_fn(model, batch)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()


def _amp_masters(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The masters amp keeps, by key: the fused optimizer's own, or amp's FP32 copies in param_groups."""
    if isinstance(optimizer, (FusedAdam, FusedSGD)):
        return _masters_by_key(model, master_params(optimizer))
    return _masters_by_key(model, amp.master_params(optimizer))


def _make_amp_run(model_kind: str, optimizer_kind: str, seed: int):
    torch.manual_seed(seed)
    if model_kind == "gpt2":
        from transformers import GPT2LMHeadModel

        model, loss_fn, batches = GPT2LMHeadModel(_gpt2_config()), _gpt2_loss, _token_batches(5)
    else:
        model, loss_fn, batches = _mlp(seed), _mlp_loss, _batches(5)
    if optimizer_kind == "FusedAdam":
        optimizer = FusedAdam(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    return model, optimizer, loss_fn, batches


@pytest.mark.parametrize("model_kind", ["mlp", "gpt2"])
@pytest.mark.parametrize("optimizer_kind", ["FusedAdam", "AdamW"])
def test_apex_checkpoint_resumes_bit_for_bit(model_kind, optimizer_kind, tmp_path) -> None:
    path = tmp_path / "checkpoint.pt"
    model, optimizer, loss_fn, batches = _make_amp_run(model_kind, optimizer_kind, seed=0)
    _amp_steps(model, optimizer, loss_fn, batches[:3])
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, path
    )
    saved_amp = amp.state_dict()
    torch.manual_seed(99)  # GPT-2's dropout: the same random stream in both runs (the recipe saves none)
    _amp_steps(model, optimizer, loss_fn, batches[3:])
    continued_params = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    continued_masters = {k: v.clone() for k, v in _amp_masters(model, optimizer).items()}
    continued_amp = amp.state_dict()

    # master_state_dict reads amp's masters, as the model's own FP32 state_dict does.
    result = amp_fx.master_state_dict(model)
    assert list(result) == list(model.state_dict())
    low = [k for k, v in model.named_parameters(remove_duplicate=False) if v.dtype in LOW]
    assert low
    for key in low:
        assert type(result[key]) is torch.Tensor and result[key].dtype == torch.float32, key
        assert torch.equal(result[key], continued_masters[key]), key
        assert not torch.equal(result[key], continued_params[key].float()), key

    # A new process: other initial weights, initialize, then load all three.
    resumed, resumed_optimizer, _, _ = _make_amp_run(model_kind, optimizer_kind, seed=1)
    checkpoint = torch.load(path, weights_only=True)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    assert amp.state_dict() == saved_amp
    torch.manual_seed(99)
    _amp_steps(resumed, resumed_optimizer, loss_fn, batches[3:])

    assert amp.state_dict() == continued_amp
    for key, param in resumed.named_parameters(remove_duplicate=False):
        assert param.dtype == continued_params[key].dtype and torch.equal(param, continued_params[key]), key
    for key, master in _amp_masters(resumed, resumed_optimizer).items():
        assert torch.equal(master, continued_masters[key]), key
