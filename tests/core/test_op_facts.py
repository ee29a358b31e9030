"""`amp_fx.core.op_facts` against torch: the names it lists are the methods, attributes and
arguments torch has, and the dtypes it states are the ones torch returns."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from amp_fx.core.op_facts import (
    CONVERSION_METHOD_DTYPES,
    FLOATING_CONVERSION_METHODS,
    NON_TENSOR_ATTRIBUTES,
    NON_TENSOR_METHODS,
    NORM_OPS,
    RESHAPE_OPS,
    RUNNING_STATS_FLAGS,
    SAME_DTYPE_ATTRIBUTES,
    TENSOR_TYPE_DTYPES,
    VIEW_OPS,
)


def test_narrower_sets_lie_within_the_wider():
    assert RESHAPE_OPS < VIEW_OPS
    assert set(RUNNING_STATS_FLAGS) < NORM_OPS
    assert FLOATING_CONVERSION_METHODS < set(CONVERSION_METHOD_DTYPES)


@pytest.mark.parametrize("name", sorted(NON_TENSOR_METHODS | NON_TENSOR_ATTRIBUTES | SAME_DTYPE_ATTRIBUTES))
def test_tensor_has_each_method_and_attribute(name: str):
    assert hasattr(torch.Tensor, name)


@pytest.mark.parametrize("method", sorted(CONVERSION_METHOD_DTYPES))
def test_conversion_methods_return_the_stated_dtype(method: str):
    assert getattr(torch.ones(2), method)().dtype == CONVERSION_METHOD_DTYPES[method]


@pytest.mark.parametrize("type_string", sorted(TENSOR_TYPE_DTYPES))
def test_tensor_type_strings_give_the_stated_dtype(type_string: str):
    assert torch.ones(2).type(type_string).dtype == TENSOR_TYPE_DTYPES[type_string]


@pytest.mark.parametrize("op", sorted(RUNNING_STATS_FLAGS))
def test_running_stats_flag_is_an_argument_of_the_norm(op: str):
    assert RUNNING_STATS_FLAGS[op] in inspect.signature(getattr(F, op)).parameters
