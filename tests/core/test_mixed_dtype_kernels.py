"""Which kernels refuse arguments of mixed floating dtypes, and that O2/O3 cast them to one.

The probe calls every op the policy tables know (autocast's lists, the passthrough set, the
low-weight levels' rules) that has a CPU kernel: with the sample arguments of torch's OpInfo
database (``op_db``, one sample per op) where it has the op, else with the hand-made calls below
(recurrent layers and their ``Tensor[]`` arguments, which ``op_db`` lacks). Each floating argument
in turn is made bf16 with the others float32, then float32 with the others bf16 (a low activation
into FP32 weights, an FP32 input into low weights). An op whose kernel runs each dtype alone but
refuses some mix must be cast to one dtype by the low-weight levels' rule for it (LOWER, FP32,
PROMOTE, or an autocast island), as autocast does for the ops it lists; a passthrough op that
refuses would fail on the export front end, whose graphs read weights, states the module creates
(``zeros``) and inputs with their own dtypes. Norms are the exception that casts otherwise: a
module's parameters share one dtype, and `low_parameter_dtype` casts the input to low ones.

In-place forms (``x.index_add_(0, i, y)``) are probed the same way: where the kernel refuses a
source of another dtype than the destination, the op must be in `SAME_DTYPE_IN_PLACE_OPS`, whose
sources the passes cast to the destination's dtype.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from amp_fx.core.op_facts import NORM_OPS, SAME_DTYPE_IN_PLACE_OPS
from amp_fx.core.op_lists import KNOWN_OPS, autocast_op_lists
from amp_fx.core.opt_levels import lookup_opt_level
from amp_fx.core.preset_rules import preset_op_rules
from amp_fx.core.rules import Rule

LOW, HIGH = torch.bfloat16, torch.float32


def _r(*shape: int) -> Callable[[torch.dtype], torch.Tensor]:
    return lambda dtype: torch.randn(*shape, dtype=dtype)


def _rnn_params(gates: int) -> list:
    return [_r(gates * 4, 3), _r(gates * 4, 4), _r(gates * 4), _r(gates * 4)]


# has_biases, num_layers, dropout, train, bidirectional, batch_first
_RNN_FLAGS = (True, 1, 0.0, False, False, False)

# Ops op_db has no entry for -> (function, its arguments: tensors as dtype -> tensor makers, lists
# of them for Tensor[] arguments).
_CALLS: dict[str, tuple[Callable, list]] = {
    "lstm": (torch.lstm, [_r(5, 2, 3), [_r(1, 2, 4), _r(1, 2, 4)], _rnn_params(4), *_RNN_FLAGS]),
    "gru": (torch.gru, [_r(5, 2, 3), _r(1, 2, 4), _rnn_params(3), *_RNN_FLAGS]),
    "rnn_tanh": (torch.rnn_tanh, [_r(5, 2, 3), _r(1, 2, 4), _rnn_params(1), *_RNN_FLAGS]),
    "rnn_relu": (torch.rnn_relu, [_r(5, 2, 3), _r(1, 2, 4), _rnn_params(1), *_RNN_FLAGS]),
    "lstm_cell": (torch.lstm_cell, [_r(2, 3), [_r(2, 4), _r(2, 4)], _r(16, 3), _r(16, 4)]),
    "gru_cell": (torch.gru_cell, [_r(2, 3), _r(2, 4), _r(12, 3), _r(12, 4)]),
    "rnn_tanh_cell": (torch.rnn_tanh_cell, [_r(2, 3), _r(2, 4), _r(4, 3), _r(4, 4)]),
    "rnn_relu_cell": (torch.rnn_relu_cell, [_r(2, 3), _r(2, 4), _r(4, 3), _r(4, 4)]),
    "chain_matmul": (torch.chain_matmul, [_r(2, 3), _r(3, 4)]),
    "conv_tbc": (torch.conv_tbc, [_r(5, 2, 3), _r(2, 3, 4), _r(4)]),
    "grid_sampler": (torch.grid_sampler, [_r(1, 2, 4, 4), _r(1, 3, 3, 2), 0, 0, False]),
}


def _is_probed(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != torch.float64


@functools.cache
def _op_db_entries() -> dict[str, Any]:
    """Canonical op name -> the OpInfo whose samples it is probed with (exact names first)."""
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db

    # Importing torch's test utilities freezes torch.backends' flags for the whole process
    # (disable_global_flags): other tests set them afterwards (the mkldnn switch of
    # test_torchvision_models), so they are left as they were.
    if not frozen:
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    entries: dict[str, Any] = {}
    for spelling in (
        lambda info: info.name,
        lambda info: info.aten_name,
        lambda info: info.name.replace(".", "_"),
        lambda info: info.name.split(".")[-1],
    ):
        for info in op_db:
            if info.name.startswith(("sparse.", "_refs.")):
                continue
            entries.setdefault(spelling(info), info)
    return entries


def _template(info: Any) -> tuple[Any, Any] | None:
    """(leaves with each floating tensor a maker, spec) of the op's first sample with two floating
    tensors; None where it has none."""
    samples = info.sample_inputs("cpu", torch.float32)
    try:
        for index, sample in enumerate(samples):
            if index >= 8:
                return None
            leaves, spec = pytree.tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
            if sum(_is_probed(leaf) for leaf in leaves) >= 2:
                return leaves, spec
        return None
    finally:
        # Closed here, not by a garbage collection during a later test: some of op_db's sample
        # generators run under torch.no_grad(), whose exit then changes that test's grad mode.
        close = getattr(samples, "close", None)
        if close is not None:
            close()


def _calls(op: str, entries: dict[str, Any]) -> list[tuple[str, Callable[[list[torch.dtype]], Any]]]:
    """(form, call) pairs for ``op``: ``call(dtypes)`` runs it with its floating tensors in
    ``dtypes``, in order; forms are "function" and, where op_db has one, "in_place"."""
    if op in _CALLS:
        function, template = _CALLS[op]
        leaves, spec = pytree.tree_flatten(template)

        def make_hand(dtypes: list[torch.dtype]) -> list:
            torch.manual_seed(0)
            floats = iter(dtypes)
            made = [leaf(next(floats)) if callable(leaf) else leaf for leaf in leaves]
            return pytree.tree_unflatten(made, spec)

        return [("function", lambda dtypes: function(*make_hand(dtypes)))]
    info = entries.get(op)
    if info is None:
        return []
    found = _template(info)
    if found is None:
        return []
    leaves, spec = found

    def make(dtypes: list[torch.dtype]) -> tuple:
        floats = iter(dtypes)
        made = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        made = [leaf.to(next(floats)) if _is_probed(leaf) else leaf for leaf in made]
        return pytree.tree_unflatten(made, spec)

    def run(function: Callable) -> Callable[[list[torch.dtype]], Any]:
        def call(dtypes: list[torch.dtype]) -> Any:
            first, args, kwargs = make(dtypes)
            return function(first, *args, **kwargs)

        return call

    forms = [("function", run(info.op))]
    if info.inplace_variant is not None:
        forms.append(("in_place", run(info.inplace_variant)))
    return forms


def _count_floats(call: Callable[[list[torch.dtype]], Any]) -> int:
    # Called with more dtypes than it reads: count how many it took.
    taken: list[torch.dtype] = []

    class Counting(list):
        def __iter__(self):
            for dtype in super().__iter__():
                taken.append(dtype)
                yield dtype

    try:
        call(Counting([HIGH] * 64))
    except Exception:  # noqa: BLE001 - the count is what matters here
        pass
    return len(taken)


def _runs(call: Callable[[list[torch.dtype]], Any], dtypes: list[torch.dtype]) -> bool:
    try:
        call(dtypes)
    except (RuntimeError, TypeError, NotImplementedError, ValueError, IndexError):
        return False
    return True


def probed_ops() -> set[str]:
    """The ops the policy tables know: autocast's lists, the passthrough set, the preset rules."""
    ops = set(KNOWN_OPS)
    for level in ("O2", "O3"):
        ops |= set(preset_op_rules(lookup_opt_level(level), "cpu", keep_batchnorm_fp32=level == "O2"))
    return ops


@functools.cache
def probe() -> dict[str, dict[str, list[str]]]:
    """op -> form -> the mixes its kernel refuses (e.g. "bf16 at 0"), for every probed op whose
    kernel runs each dtype alone; ops whose kernels take every mix are left out."""
    torch.manual_seed(0)
    entries = _op_db_entries()
    refusals: dict[str, dict[str, list[str]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in sorted(probed_ops()):
            for form, call in _calls(op, entries):
                count = _count_floats(call)
                if count < 2 or not (_runs(call, [HIGH] * count) and _runs(call, [LOW] * count)):
                    continue  # one floating argument, or no kernel for a dtype alone
                refused = []
                for position in range(count):
                    for odd, rest in ((LOW, HIGH), (HIGH, LOW)):
                        dtypes = [rest] * count
                        dtypes[position] = odd
                        if not _runs(call, dtypes):
                            refused.append(f"{str(odd).removeprefix('torch.')} at {position}")
                if refused:
                    refusals.setdefault(op, {})[form] = refused
    return refusals


def refuses_mixed_dtypes(op: str, form: str = "function") -> bool:
    """Whether ``op``'s CPU kernel (its ``form``) refuses some mix of bf16 and float32 arguments."""
    return form in probe().get(op, {})


def _casts_to_one_dtype(op: str, rule: Rule, level: str) -> bool:
    if rule in (Rule.LOWER, Rule.FP32, Rule.PROMOTE):
        return True
    if rule is Rule.OPAQUE:  # an autocast island casts the arguments; O3 runs untraced code bare
        return lookup_opt_level(level).autocast_opaque
    # A module's parameters share one dtype; the input is cast to low ones (low_parameter_dtype).
    return rule is Rule.PASSTHROUGH and op in NORM_OPS


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_low_weight_levels_cast_the_arguments_of_kernels_that_refuse_mixed_dtypes(level) -> None:
    rules = preset_op_rules(lookup_opt_level(level), "cpu", keep_batchnorm_fp32=level == "O2")
    refusing = [op for op in sorted(probe()) if refuses_mixed_dtypes(op)]
    # An op without a rule gets the preset's global rule, PASSTHROUGH.
    uncast = {
        op: probe()[op]["function"]
        for op in refusing
        if not _casts_to_one_dtype(op, rules[op].rule if op in rules else Rule.PASSTHROUGH, level)
    }
    assert not uncast, f"{level} leaves these kernels mixed dtypes: {uncast}"


def test_in_place_forms_that_refuse_a_source_of_another_dtype_cast_it() -> None:
    refusing = {op for op in probe() if refuses_mixed_dtypes(op, "in_place")}
    assert refusing - SAME_DTYPE_IN_PLACE_OPS == set(), "in-place kernels whose sources stay uncast"


def test_the_probe_covers_the_policy_tables_and_finds_the_known_kernels() -> None:
    # The probe can fail: these kernels do refuse (the LSTM, GRU and RNN among them), and
    # it reaches most of the ops the tables name, not a hand-picked few.
    entries = _op_db_entries()
    reached = {op for op in probed_ops() if op in entries or op in _CALLS}
    assert len(reached) > 0.8 * len(probed_ops()), sorted(probed_ops() - reached)
    assert {"lstm", "gru", "rnn_tanh", "lstm_cell", "linear", "conv2d", "index_add", "lerp"} <= set(probe())
    assert {"index_add", "scatter", "index_put", "masked_scatter"} <= {
        op for op in probe() if refuses_mixed_dtypes(op, "in_place")
    }
    # Ops whose kernels take any mix are not reported.
    assert not {"add", "mul", "where", "copysign"} & set(probe())
    # And every op autocast promotes that the probe reaches is covered by it.
    promote = autocast_op_lists("cuda").promote | autocast_op_lists("cpu").promote
    assert {"addcmul", "cat", "stack", "dot"} <= promote & reached
