"""FP32 masters that follow loads into the model: ``model.load_state_dict`` takes effect whenever it runs.

An optimizer with FP32 masters (`FusedAdam`, `FusedSGD`, or amp's MASTERS kind) updates the master and
writes the rounded result into the model. A load that changed only the model's fp16 parameters would be
undone by the next step, which writes the stale master back. `follow_model_loads` gives a module two
``load_state_dict`` hooks that prevent it:

- before anything is loaded, the load is checked as torch would check it (missing and unexpected keys
  when strict and ``module`` is the one loaded, shapes always) and refused with the model and its
  masters untouched (torch itself would copy the matching parameters first and raise afterwards);
- the checkpoint's values are kept for the parameters they load into, at the checkpoint's precision;
- after the load, every master of those parameters is set from them: an FP32 checkpoint gives FP32
  masters equal to its values, not the fp16-rounded ones.

The masters are found through *sources*: `tracked_masters` (every `MasterKeeper` holding the
parameter, which registers itself with `track_params`: amp_fx's fused optimizers, and amp's optimizers
with masters) by default; ``amp.initialize`` adds its session's. It uses only the nn.Module API, so it
works for a GraphModule, a `CapturedModel` or any module.

Example:
    >>> import torch
    >>> from amp_fx.optim import FusedSGD, master_params
    >>> model = follow_model_loads(torch.nn.Linear(2, 1).half())
    >>> opt = FusedSGD(model.parameters(), lr=0.0)
    >>> _ = model.load_state_dict({"weight": torch.full((1, 2), 0.1), "bias": torch.zeros(1)})
    >>> next(master_params(opt))
    tensor([[0.1000, 0.1000]])
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

MASTER_KEY = "master_param"
MasterSource = Callable[[], dict[int, Tensor]]

# param -> the master keepers that hold it (weak both ways: neither is kept alive by this table).
_keepers_by_param: WeakIdKeyDictionary = WeakIdKeyDictionary()
_SOURCES_ATTRIBUTE = "_amp_fx_master_sources"
_CAPTURED_ATTRIBUTE = "_amp_fx_loaded_values"


class MasterKeeper(Protocol):
    """What keeps FP32 masters for parameters: `FusedOptimizer`, amp's MASTERS optimizer."""

    def masters_by_param(self) -> dict[int, Tensor]:
        """id(param) -> its FP32 master, for each parameter that has one."""

    def adopt_master(self, param: Tensor, value: Tensor) -> Callable[[], None] | None:
        """Give ``param``, held FP32 and now stored low, the FP32 master ``value`` where this keeper
        keeps masters and it has none; returns what takes it back (None if none was given)."""

    def release_master(self, param: Tensor) -> tuple[Tensor, Callable[[], None]] | None:
        """``param``, stored low until now, is stored FP32 from here on and is its own master: stop
        keeping a master for it and return that master (its exact value) with what takes the
        change back; None where this keeper keeps no master for it."""


def track_params(keeper: MasterKeeper, params: Iterable[Tensor]) -> None:
    """Note that ``keeper`` keeps, or may come to keep, masters for some of ``params``."""
    for param in params:
        owners = _keepers_by_param.get(param)
        if owners is None:
            owners = _keepers_by_param[param] = weakref.WeakSet()
        owners.add(keeper)


def tracked_masters(params: Iterable[Tensor]) -> dict[int, list[Tensor]]:
    """id(param) -> the FP32 masters the tracked keepers keep for it (params without any left out)."""
    params = list(params)
    wanted = {id(param) for param in params}
    keepers = {id(k): k for param in params for k in list(_keepers_by_param.get(param, ()))}
    found: dict[int, list[Tensor]] = {}
    for keeper in keepers.values():
        for key, master in keeper.masters_by_param().items():
            if key in wanted:
                found.setdefault(key, []).append(master)
    return found


def masters_for_stored_low(stored: Iterable[tuple[Tensor, Tensor]]) -> Callable[[], None]:
    """For each ``(param, value)``: ``param`` was ``value`` (FP32) and is now stored in a low dtype (the
    torch.export front end stores some parameters at their first capture, after optimizers may have
    been built). Each keeper holding it that keeps masters takes ``value`` as its FP32 master, as
    one built after the store would (from the exact value, not the rounded one).
    Returns what takes those masters back.

    Example:
        >>> from amp_fx.optim import FusedSGD
        >>> w = torch.nn.Parameter(torch.full((2,), 1 / 3))
        >>> opt = FusedSGD([w], lr=0.1)
        >>> value, w.data = w.data, w.data.half()
        >>> undo = masters_for_stored_low([(w, value)])
        >>> opt.state[w][MASTER_KEY].dtype, torch.equal(opt.state[w][MASTER_KEY], value)
        (torch.float32, True)
    """
    undos = [
        undo
        for param, value in stored
        for keeper in list(_keepers_by_param.get(param, ()))
        if (undo := keeper.adopt_master(param, value)) is not None
    ]

    def undo() -> None:
        for undo_one in reversed(undos):
            undo_one()

    return undo


def masters_for_stored_fp32(stored: Iterable[Tensor]) -> Callable[[], None]:
    """Each of ``stored`` was stored low and is now stored FP32 (the torch.export front end's first
    graph reading it decided so: a router's weight, `amp_fx.capture.storage`): it takes its exact
    value from a keeper's FP32 master where one exists (the rounded value it holds is the master's
    rounding) and is its own master from then on, as a keeper built after the store would have it;
    the same parameter object, so a torch optimizer holding it keeps stepping it. Returns what
    takes it back (masters and values).

    Example:
        >>> from amp_fx.optim import FusedSGD
        >>> w = torch.nn.Parameter(torch.full((2,), 1 / 3).half())
        >>> opt = FusedSGD([w], lr=0.1)
        >>> opt.state[w][MASTER_KEY].fill_(1 / 3)  # the master holds the exact value
        tensor([0.3333, 0.3333])
        >>> w.data = w.data.float()
        >>> _ = masters_for_stored_fp32([w])
        >>> w.dtype, torch.equal(w, torch.full((2,), 1 / 3)), MASTER_KEY in opt.state[w]
        (torch.float32, True, False)
    """
    undos: list[Callable[[], None]] = []
    for param in stored:
        for keeper in list(_keepers_by_param.get(param, ())):
            released = keeper.release_master(param)
            if released is None:
                continue
            master, undo_release = released
            data = param.data
            param.data = master.detach().to(device=data.device, dtype=data.dtype)

            def undo(
                param: Tensor = param, data: Tensor = data, undo_release: Callable[[], None] = undo_release
            ) -> None:
                param.data = data
                undo_release()

            undos.append(undo)

    def undo_all() -> None:
        for undo_one in reversed(undos):
            undo_one()

    return undo_all


def masters_of(module: nn.Module) -> dict[int, list[Tensor]]:
    """id(param) -> the FP32 masters kept for each of ``module``'s parameters (params without any left out).

    The sources are those `_update_masters` uses: every keeper holding the parameter, and the
    sources given to `follow_model_loads` on ``module`` or any of its submodules. Each master appears
    once per parameter, however many sources report it; a parameter that is its own master is left out.

    Example:
        >>> import torch
        >>> from amp_fx.optim import FusedSGD
        >>> model = torch.nn.Linear(2, 1).half()
        >>> opt = FusedSGD(model.parameters(), lr=0.1)
        >>> [m[0].dtype for m in masters_of(model).values()]
        [torch.float32, torch.float32]
    """
    params = {id(param): param for param in module.parameters()}
    found: dict[int, list[Tensor]] = {}

    def add(key: int, master: Tensor) -> None:
        masters = found.setdefault(key, [])
        if master is not params[key] and not any(m is master for m in masters):
            masters.append(master)

    for key, masters in tracked_masters(params.values()).items():
        for master in masters:
            add(key, master)
    for sub in module.modules():
        for source in getattr(sub, _SOURCES_ATTRIBUTE, ()):
            # A source may cover other models' parameters too (one amp.initialize, several models).
            for key, master in source().items():
                if key in params:
                    add(key, master)
    return {key: masters for key, masters in found.items() if masters}


def _expected_keys(module: nn.Module, prefix: str) -> dict[str, Tensor | None]:
    """The keys of ``module.state_dict(prefix=prefix)``, each with its parameter or buffer (torch's rules)."""
    keys: dict[str, Tensor | None] = {}
    for name, sub in module.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
        base = f"{name}." if name else ""
        keys.update({base + k: v for k, v in sub._parameters.items() if v is not None})
        keys.update(
            {
                base + k: v
                for k, v in sub._buffers.items()
                if v is not None and k not in sub._non_persistent_buffers_set
            }
        )
        if type(sub).get_extra_state is not nn.Module.get_extra_state:
            keys[base + "_extra_state"] = None
    return keys


def _check_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, strict: bool) -> None:
    """Raise RuntimeError, as torch's load_state_dict would, but before anything is loaded."""
    expected = _expected_keys(module, prefix)
    given = {k for k in state_dict if k.startswith(prefix)}
    errors = []
    if strict:
        if missing := sorted(set(expected) - given):
            errors.append(f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}.")
        if unexpected := sorted(given - set(expected)):
            errors.append(f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}.")
    for key, tensor in expected.items():
        value = state_dict.get(key)
        if tensor is not None and isinstance(value, Tensor) and value.shape != tensor.shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                f"the shape in current model is {tensor.shape}."
            )
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: {' '.join(errors)} Nothing was "
            "loaded: the model and its FP32 master weights are unchanged."
        )


def follow_model_loads(module: nn.Module, source: MasterSource | None = None) -> nn.Module:
    """Make ``module.load_state_dict`` set the FP32 masters of the parameters it loads; returns ``module``.

    ``source`` (optional) returns id(param) -> master for masters kept outside the tracked keepers
    (``amp.initialize`` passes its session's); the hooks are installed once per module, later calls
    only add sources. See the module docstring for what the hooks do.

    Example:
        >>> import torch
        >>> model = follow_model_loads(torch.nn.Linear(2, 1))
        >>> follow_model_loads(model) is model
        True
    """
    sources: list[MasterSource] | None = getattr(module, _SOURCES_ATTRIBUTE, None)
    if sources is not None:
        if source is not None:
            sources.append(source)
        return module
    setattr(module, _SOURCES_ATTRIBUTE, [] if source is None else [source])
    # Module-level hooks: a torch.save'd model pickles (closures, or a bound method in the
    # instance's __dict__, would not).
    module.register_load_state_dict_pre_hook(_check_and_capture)
    module.register_load_state_dict_post_hook(_update_masters)
    return module


def _caller_strict() -> bool:
    """The ``strict`` the caller gave ``nn.Module.load_state_dict`` (torch hands its hooks True)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is nn.Module.load_state_dict.__code__:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return True


def _check_and_capture(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any, strict: bool, *args: Any
) -> None:
    # torch passes strict=True to every module's hooks whatever the caller asked: the missing and
    # unexpected keys are checked when this module is the one loaded, as its caller asked.
    _check_load(module, state_dict, prefix, strict=prefix == "" and _caller_strict())
    captured = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(value, Tensor) and value.is_floating_point() and value.shape == param.shape:
            captured[id(param)] = value
    module.__dict__[_CAPTURED_ATTRIBUTE] = captured


def _update_masters(module: nn.Module, incompatible_keys: Any) -> None:
    captured = module.__dict__.pop(_CAPTURED_ATTRIBUTE, {})
    params = list(module.parameters())
    masters = masters_of(module)
    with torch.no_grad():
        for param in params:
            value = captured.get(id(param))
            for master in masters.get(id(param), ()) if value is not None else ():
                master.copy_(value)
