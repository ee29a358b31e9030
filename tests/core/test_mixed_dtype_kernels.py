"""Which kernels refuse arguments of mixed floating dtypes, and that O2/O3 cast them to one.

A probe calls each op with its first floating argument in bf16 and the others in float32 (every
tensor of a list argument included: aten ``lstm`` takes ``Tensor[] hx`` and ``Tensor[] params``).
Where the kernel refuses, the low-weight levels' rule for the op must cast every floating
argument to one dtype (LOWER, FP32 or PROMOTE), as autocast does for the ops it lists; a
passthrough op that refuses would fail on the export front end, whose graphs read weights,
states the module creates (``zeros``) and inputs with their own dtypes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from amp_fx.core.op_lists import autocast_op_lists
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

# op -> its arguments: tensors as dtype -> tensor makers (lists of them for Tensor[] arguments).
_CALLS: dict[str, tuple[Callable, list]] = {
    "lstm": (torch.lstm, [_r(5, 2, 3), [_r(1, 2, 4), _r(1, 2, 4)], _rnn_params(4), *_RNN_FLAGS]),
    "gru": (torch.gru, [_r(5, 2, 3), _r(1, 2, 4), _rnn_params(3), *_RNN_FLAGS]),
    "rnn_tanh": (torch.rnn_tanh, [_r(5, 2, 3), _r(1, 2, 4), _rnn_params(1), *_RNN_FLAGS]),
    "rnn_relu": (torch.rnn_relu, [_r(5, 2, 3), _r(1, 2, 4), _rnn_params(1), *_RNN_FLAGS]),
    "lstm_cell": (torch.lstm_cell, [_r(2, 3), [_r(2, 4), _r(2, 4)], _r(16, 3), _r(16, 4)]),
    "gru_cell": (torch.gru_cell, [_r(2, 3), _r(2, 4), _r(12, 3), _r(12, 4)]),
    "rnn_tanh_cell": (torch.rnn_tanh_cell, [_r(2, 3), _r(2, 4), _r(4, 3), _r(4, 4)]),
    "rnn_relu_cell": (torch.rnn_relu_cell, [_r(2, 3), _r(2, 4), _r(4, 3), _r(4, 4)]),
    "linear": (torch.nn.functional.linear, [_r(2, 3), _r(4, 3)]),
    "matmul": (torch.matmul, [_r(2, 3), _r(3, 4)]),
    "bmm": (torch.bmm, [_r(2, 2, 3), _r(2, 3, 4)]),
    "addmm": (torch.addmm, [_r(2, 4), _r(2, 3), _r(3, 4)]),
    "baddbmm": (torch.baddbmm, [_r(2, 2, 4), _r(2, 2, 3), _r(2, 3, 4)]),
    "conv1d": (torch.nn.functional.conv1d, [_r(1, 2, 5), _r(3, 2, 2)]),
    "conv2d": (torch.nn.functional.conv2d, [_r(1, 2, 5, 5), _r(3, 2, 2, 2)]),
    "prelu": (torch.nn.functional.prelu, [_r(2, 3), _r(1)]),
    "bilinear": (torch.nn.functional.bilinear, [_r(2, 3), _r(2, 3), _r(4, 3, 3)]),
    "addcmul": (torch.addcmul, [_r(3), _r(3), _r(3)]),
    "addcdiv": (torch.addcdiv, [_r(3), _r(3), _r(3)]),
    "atan2": (torch.atan2, [_r(3), _r(3)]),
    "cross": (torch.linalg.cross, [_r(2, 3), _r(2, 3)]),
    "dot": (torch.dot, [_r(3), _r(3)]),
    "vdot": (torch.vdot, [_r(3), _r(3)]),
    "cat": (torch.cat, [[_r(2), _r(2)]]),
    "stack": (torch.stack, [[_r(2), _r(2)]]),
    "lerp": (torch.lerp, [_r(3), _r(3), 0.5]),
    "scatter": (torch.scatter, [_r(2, 3), 1, lambda d: torch.tensor([[0, 1, 2]] * 2), _r(2, 3)]),
    "scatter_add": (torch.scatter_add, [_r(2, 3), 1, lambda d: torch.tensor([[0, 1, 2]] * 2), _r(2, 3)]),
    "index_add": (torch.index_add, [_r(3, 2), 0, lambda d: torch.tensor([0, 2]), _r(2, 2)]),
    "index_copy": (torch.index_copy, [_r(3, 2), 0, lambda d: torch.tensor([0, 2]), _r(2, 2)]),
    "masked_scatter": (torch.masked_scatter, [_r(3), lambda d: torch.tensor([True, False, True]), _r(3)]),
    "where": (torch.where, [lambda d: torch.tensor([True, False, True]), _r(3), _r(3)]),
    "embedding": (torch.nn.functional.embedding, [lambda d: torch.tensor([0, 1]), _r(3, 2)]),
    "layer_norm": (torch.nn.functional.layer_norm, [_r(2, 3), (3,), _r(3), _r(3)]),
    "group_norm": (torch.nn.functional.group_norm, [_r(2, 4, 3), 2, _r(4), _r(4)]),
}


def _make(argument, first: list[bool]):
    if isinstance(argument, list):
        return [_make(a, first) for a in argument]
    if callable(argument):
        made = argument(LOW if first[0] else HIGH)
        first[0] = first[0] and not made.is_floating_point()  # the first floating tensor is low
        return made
    return argument


def refuses_mixed_dtypes(op: str) -> bool:
    """Whether ``op``'s CPU kernel refuses a bf16 first argument with float32 others."""
    function, template = _CALLS[op]
    torch.manual_seed(0)
    try:
        function(*_make(template, [True]))
    except RuntimeError:
        return True
    return False


def _casts_to_one_dtype(rule: Rule) -> bool:
    return rule in (Rule.LOWER, Rule.FP32, Rule.PROMOTE)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_low_weight_levels_cast_the_arguments_of_kernels_that_refuse_mixed_dtypes(level) -> None:
    rules = preset_op_rules(lookup_opt_level(level), "cpu", keep_batchnorm_fp32=level == "O2")
    refusing = [op for op in sorted(_CALLS) if refuses_mixed_dtypes(op)]
    uncast = [op for op in refusing if op not in rules or not _casts_to_one_dtype(rules[op].rule)]
    assert not uncast, f"{level} leaves these kernels mixed dtypes: {uncast}"


def test_the_probe_finds_the_recurrent_kernels_and_the_promote_list() -> None:
    # The probe can fail: these kernels do refuse (the LSTM, GRU and RNN among them).
    assert {"lstm", "gru", "rnn_tanh", "lstm_cell", "linear", "conv2d"} <= {
        op for op in _CALLS if refuses_mixed_dtypes(op)
    }
    # And every op autocast promotes that the probe calls is covered by it.
    promote = autocast_op_lists("cuda").promote | autocast_op_lists("cpu").promote
    assert {"addcmul", "cat", "stack", "dot"} <= promote & set(_CALLS)
