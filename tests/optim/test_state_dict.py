"""Checkpoints: bit-exact resume through torch.save/load(weights_only=True), refusals, add_param_group."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from amp_fx import LossScaler
from amp_fx.optim import FusedAdam, FusedSGD, master_params
from amp_fx.testing import tolerances

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float16]
OPTIMIZERS = {
    "adam": lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01),
    "sgd": lambda params: FusedSGD(params, lr=0.05, momentum=0.9, nesterov=True),
}
# Step 4 overflows (an inf grad), so the resumed run also has to reproduce a skip.
POISONED_STEPS = {4}


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _train(case, optimizer, scaler, steps) -> None:
    for index in steps:
        scaler.scale(torch.zeros(()))
        case.next_grads(scale=scaler.get_scale())
        if index in POISONED_STEPS:
            case.params[0].grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_state_dict_loads_again_after_a_load(problem, name) -> None:
    """torch's Optimizer adds ``differentiable`` to the defaults at each load (accelerate loads an
    optimizer's own state dict when it prepares it): a state dict from before still loads."""
    case = problem(torch.float16, seed=57)
    optimizer = OPTIMIZERS[name](case.params)
    saved = optimizer.state_dict()
    optimizer.load_state_dict(optimizer.state_dict())
    optimizer.load_state_dict(saved)
    assert "differentiable" not in saved["param_groups"][0]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_is_bit_identical_to_an_uninterrupted_run(problem, optimizer_snapshot, name) -> None:
    snapshot, assert_same = optimizer_snapshot
    straight = problem(DTYPES, seed=51)
    straight_opt = OPTIMIZERS[name](straight.params)
    straight_scaler = LossScaler(init_scale=512.0, growth_interval=2, hysteresis=2)
    _train(straight, straight_opt, straight_scaler, range(8))

    first = problem(DTYPES, seed=51)
    first_opt = OPTIMIZERS[name](first.params)
    first_scaler = LossScaler(init_scale=512.0, growth_interval=2, hysteresis=2)
    _train(first, first_opt, first_scaler, range(3))
    checkpoint = _round_trip(
        {
            "model": [p.detach() for p in first.params],
            "optimizer": first_opt.state_dict(),
            "scaler": first_scaler.state_dict(),
        }
    )

    resumed = problem(DTYPES, seed=51)  # fresh params, then overwritten by the checkpoint
    with torch.no_grad():
        for param, saved in zip(resumed.params, checkpoint["model"], strict=True):
            param.copy_(saved)
    resumed_opt = OPTIMIZERS[name](resumed.params)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_scaler = LossScaler()
    resumed_scaler.load_state_dict(checkpoint["scaler"])
    for _ in range(3):  # the grad stream continues where the first run stopped
        resumed.next_grads()
    _train(resumed, resumed_opt, resumed_scaler, range(3, 8))

    assert_same(snapshot(straight_opt), snapshot(resumed_opt))
    assert straight_scaler.state_dict() == resumed_scaler.state_dict()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_holds_masters_and_loads_with_weights_only(problem, name) -> None:
    case = problem(DTYPES, seed=53)
    optimizer = OPTIMIZERS[name](case.params)
    case.next_grads()
    optimizer.step()
    loaded = _round_trip(optimizer.state_dict())
    masters = [state.get("master_param") for state in loaded["state"].values()]
    assert [m is not None for m in masters] == [d != torch.float32 for d in DTYPES]
    for saved, live in zip(masters, master_params(optimizer), strict=True):
        if saved is not None:
            assert torch.equal(saved, live)
    assert loaded["param_groups"][0]["step"].item() == 1


def test_loaded_state_is_a_copy(problem) -> None:
    case = problem(torch.float16, seed=55)
    optimizer = FusedAdam(case.params)
    other = FusedAdam([torch.nn.Parameter(p.detach().clone()) for p in case.params])
    other.load_state_dict(optimizer.state_dict())
    case.next_grads()
    optimizer.step()  # must not move `other`'s masters, moments or step
    assert other.param_groups[0]["step"].item() == 0
    for mine, theirs in zip(master_params(other), case.params, strict=True):
        assert not torch.equal(mine.to(torch.float16), theirs.detach())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_moments_come_with_the_first_step_and_an_unstepped_state_dict_loads(
    problem, optimizer_snapshot, name
) -> None:
    # As torch.optim and Apex: building the optimizer creates the masters, not the moments.
    snapshot, assert_same = optimizer_snapshot
    case = problem(DTYPES, seed=61)
    optimizer = OPTIMIZERS[name](case.params)
    assert all(set(optimizer.state[p]) <= {"master_param"} for p in case.params)
    twin = problem(DTYPES, seed=61)
    twin_opt = OPTIMIZERS[name](twin.params)
    twin_opt.load_state_dict(_round_trip(optimizer.state_dict()))
    for run, opt in ((case, optimizer), (twin, twin_opt)):
        run.next_grads()
        opt.step()
    assert_same(snapshot(optimizer), snapshot(twin_opt))
    assert all(set(optimizer.state[p]) - {"master_param"} for p in case.params)  # now they exist


def test_a_refused_step_creates_no_moments(problem) -> None:
    case = problem(DTYPES, seed=63)
    optimizer = FusedAdam([{"params": case.params[:2]}, {"params": case.params[2:]}])
    case.next_grads()
    case.params[3].grad = case.params[3].grad.to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        optimizer.step()
    assert all(set(optimizer.state[p]) <= {"master_param"} for p in case.params)


def _drop_group(sd):
    sd["param_groups"] = sd["param_groups"][:1]


def _drop_param(sd):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]


def _reshape_master(sd):
    sd["state"][0]["master_param"] = torch.zeros(7, 5)


def _half_moment(sd):
    sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].half()


def _drop_one_moment(sd):
    del sd["state"][0]["exp_avg_sq"]


def _drop_master(sd):
    del sd["state"][0]["master_param"]


def _extra_key(sd):
    sd["state"][1]["momentum_buffer"] = torch.zeros(3)


def _missing_state(sd):
    del sd["state"][3]


def _bad_lr(sd):
    sd["param_groups"][1]["lr"] = "fast"


def _bad_step(sd):
    sd["param_groups"][0]["step"] = torch.zeros(2)


def _negative_step_tensor(sd):
    sd["param_groups"][0]["step"] = torch.tensor([-5.0])


def _nan_step_tensor(sd):
    sd["param_groups"][0]["step"] = torch.tensor([float("nan")])


def _inf_step_tensor(sd):
    sd["param_groups"][1]["step"] = torch.tensor(float("inf"))


def _negative_step_number(sd):
    sd["param_groups"][1]["step"] = -5


def _sgd_dict(sd):
    params = [
        torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(((5, 7), (3,)), DTYPES[:2], strict=True)
    ]
    sd.clear()
    sd.update(FusedSGD([{"params": params[:1]}, {"params": params[1:]}], momentum=0.9).state_dict())


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (_drop_group, "has 1 param groups but this optimizer has 2"),
        (_drop_param, "has 0 parameters but this optimizer's group has 1"),
        (_reshape_master, "'master_param' must be a float32 tensor of shape"),
        (_half_moment, "'exp_avg' must be a float32 tensor"),
        (_drop_one_moment, "missing \\['exp_avg_sq'\\]"),
        (_drop_master, "missing \\['master_param'\\]"),
        (_extra_key, "unexpected \\['momentum_buffer'\\]"),
        (_missing_state, "no state for parameter 3"),
        (_bad_lr, "lr must be a finite Python float"),
        (_bad_step, "'step' must be a float tensor of one element"),
        (_negative_step_tensor, "'step' must be a finite count"),
        (_nan_step_tensor, "'step' must be a finite count"),
        (_inf_step_tensor, "'step' must be a finite count"),
        (_negative_step_number, "'step' must be a finite count"),
        (_sgd_dict, "it was not saved by a FusedAdam"),
    ],
)
def test_bad_state_dict_is_refused_and_nothing_changes(problem, optimizer_snapshot, corrupt, match) -> None:
    snapshot, assert_unchanged = optimizer_snapshot
    case = problem(DTYPES, seed=57)
    optimizer = FusedAdam([{"params": case.params[:1]}, {"params": case.params[1:]}], lr=1e-2)
    case.next_grads()
    optimizer.step()
    state_dict = copy.deepcopy(optimizer.state_dict())
    corrupt(state_dict)
    case.next_grads()
    optimizer.step()  # the optimizer moved on since the state dict was taken
    before = snapshot(optimizer)
    with pytest.raises(ValueError, match=match):
        optimizer.load_state_dict(state_dict)
    assert_unchanged(before, snapshot(optimizer))


def test_add_param_group_creates_masters_and_matches_torch(problem) -> None:
    case = problem([torch.float16, torch.bfloat16, torch.float32, torch.float16], seed=59)
    optimizer = FusedAdam(case.params[:2], lr=1e-2)
    reference = torch.optim.AdamW(case.fp32[:2], lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        case.next_grads()
        for param in (*case.params[2:], *case.fp32[2:]):
            param.grad = None
        optimizer.step()
        reference.step()
    optimizer.add_param_group({"params": case.params[2:], "lr": 5e-3})
    reference.add_param_group({"params": case.fp32[2:], "lr": 5e-3})
    new_state = optimizer.state[case.params[3]]
    assert torch.equal(new_state["master_param"], case.params[3].detach().float())
    assert optimizer.param_groups[1]["step"].item() == 0
    for _ in range(4):
        case.next_grads()
        optimizer.step()
        reference.step()
    rtol, atol = tolerances(torch.float32)
    for master, expected in zip(master_params(optimizer), case.fp32, strict=True):
        torch.testing.assert_close(master, expected.detach(), rtol=rtol, atol=atol)
    assert [g["step"].item() for g in optimizer.param_groups] == [7, 4]
    # and the larger optimizer round-trips
    clone = FusedAdam(case.params[:2], lr=1e-2)
    clone.add_param_group({"params": case.params[2:]})
    clone.load_state_dict(_round_trip(optimizer.state_dict()))
    assert clone.param_groups[1]["lr"] == 5e-3


def test_add_param_group_refuses_a_duplicate_without_changing_anything(problem) -> None:
    case = problem(torch.float16, seed=61)
    optimizer = FusedAdam(case.params)
    with pytest.raises(ValueError, match="appear in more than one parameter group"):
        optimizer.add_param_group({"params": case.params[:1]})
    assert len(optimizer.param_groups) == 1
    with pytest.raises(ValueError, match="dtype"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    assert len(optimizer.param_groups) == 1
    # Twice in one group (torch.optim warns): one launch would update it twice at once.
    fresh = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="parameter 1 .* is parameter 0 again"):
        optimizer.add_param_group({"params": [fresh, fresh]})
    assert len(optimizer.param_groups) == 1 and fresh not in optimizer.state
    with pytest.raises(ValueError, match="again"):
        FusedSGD([fresh, fresh])


def test_optimizer_survives_deepcopy(problem) -> None:
    case = problem(torch.float16, seed=63)
    optimizer = FusedSGD(case.params, lr=0.1, momentum=0.9)
    duplicate = copy.deepcopy(optimizer)  # copies the params too: give those grads
    for param in duplicate.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)
    duplicate.step()
    assert duplicate.param_groups[0]["step"].item() == 1
    assert optimizer.param_groups[0]["step"].item() == 0
