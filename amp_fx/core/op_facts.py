"""What ops do, besides the rule autocast gives them: the one home of amp_fx's facts about ops.

`amp_fx.core.op_lists` holds torch.autocast's lists (which ops run low, which in float32); this
module holds everything else the passes need to know about an op, by canonical op name
(`amp_fx.passes.normalize_ops`) unless a set says otherwise: which ops alias their input, which
only read metadata, which are norms, and what dtype an op produces when its rule casts nothing
(`amp_fx.passes.propagate_dtypes`). A new op rule is a line here or in `op_lists`, plus at most the
one pass that acts on it.

    >>> "transpose" in VIEW_OPS, "transpose" in RESHAPE_OPS
    (True, False)
    >>> sorted(FLOATING_CONVERSION_METHODS)
    ['bfloat16', 'double', 'float', 'half']
"""

from __future__ import annotations

import operator

import torch

__all__ = [
    "VIEW_OPS",
    "RESHAPE_OPS",
    "INPLACE_OPERATORS",
    "OUTPUT_NOT_SAVED_OPS",
    "SAME_DTYPE_IN_PLACE_OPS",
    "SHAPE_METHODS",
    "METADATA_ATTRIBUTES",
    "NON_TENSOR_METHODS",
    "NON_TENSOR_ATTRIBUTES",
    "SAME_DTYPE_ATTRIBUTES",
    "NON_TENSOR_MODULES",
    "NORM_OPS",
    "RUNNING_STATS_FLAGS",
    "CONVERSION_METHOD_DTYPES",
    "FLOATING_CONVERSION_METHODS",
    "TENSOR_TYPE_DTYPES",
    "BOOL_OPS",
    "INT64_OPS",
    "VALUES_INDICES_OPS",
    "ALWAYS_VALUES_INDICES_OPS",
    "PAIR_OPS",
    "SPLIT_OPS",
    "INT64_ACCUMULATING_OPS",
    "FIRST_ARGUMENT_DTYPE_OPS",
    "FACTORY_FUNCTIONS",
    "VALUE_MOVING_OPS",
]

# ---------------------------------------------------------------------------------------------
# Aliasing: what an op's result shares with its input
# ---------------------------------------------------------------------------------------------
# Ops (and method names) whose result may share its first argument's storage: an in-place update
# of the result updates the argument.
VIEW_OPS = frozenset(
    {
        "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "squeeze", "unsqueeze",
        "expand", "expand_as", "narrow", "select", "t", "unflatten", "flatten", "as_strided", "unfold",
        "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "getitem", "contiguous", "detach",
        "chunk", "split", "unbind", "tensor_split", "split_with_sizes", "real", "imag", "view_as_real",
        "view_as_complex", "alias", "T", "mT",
    }
)  # fmt: skip
# Ops whose output holds their first argument's values in the same order, only reshaped: a view,
# or a copy where the input's strides need one. Narrower than VIEW_OPS (no transpose, no slicing),
# so a kernel that overwrites the output in place overwrites exactly the input's values.
RESHAPE_OPS = frozenset({"view", "reshape", "flatten", "contiguous"})
# Python's operators that update their first operand in place (``x += y``, ``x[i] = y``).
INPLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.imatmul,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.setitem,
    }
)
# In-place ops (canonical names) whose kernels refuse a source of another floating dtype than the
# destination (``fp32.index_add_(0, i, bf16)``), found by tests/core/test_mixed_dtype_kernels.py's
# probe. The in-place op keeps the destination's dtype, so the passes cast its sources to it, as
# eager's matching dtypes would have them; ``x[i] = y`` (setitem) is ``index_put_``.
SAME_DTYPE_IN_PLACE_OPS = frozenset(
    {
        "index_add", "index_copy", "index_put", "setitem", "scatter", "scatter_add", "masked_scatter",
        "lerp", "addmm", "addmv", "addbmm", "baddbmm",
    }
)  # fmt: skip
# Ops whose autograd backward reads their inputs, never their output: the output may be overwritten
# once nothing else reads it.
OUTPUT_NOT_SAVED_OPS = frozenset({"linear", "matmul", "mm", "bmm", "addmm"})

# ---------------------------------------------------------------------------------------------
# Metadata: reads that return no tensor
# ---------------------------------------------------------------------------------------------
# Tensor methods that return sizes or strides, never values (``x.view(-1, x.size(-1))``).
SHAPE_METHODS = frozenset({"size", "dim", "numel", "stride"})
# Tensor attributes that return metadata, never values.
METADATA_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device"})
# Tensor methods and attributes whose result is not a tensor.
NON_TENSOR_METHODS = SHAPE_METHODS | frozenset(
    {
        "item", "tolist", "element_size", "data_ptr", "is_contiguous", "is_floating_point", "is_complex",
        "nelement", "ndimension", "get_device", "__len__", "storage_offset",
    }
)  # fmt: skip
NON_TENSOR_ATTRIBUTES = METADATA_ATTRIBUTES | frozenset(
    {"is_cuda", "requires_grad", "layout", "is_leaf", "grad_fn"}
)
# Tensor attributes that are tensors of the tensor's own dtype.
SAME_DTYPE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag", "grad"})
# Modules (``__module__``) of functions called on plain Python values (sizes, shapes), never on
# tensors: ``math.sqrt(d)``, ``len(shape)``, ``operator.mul`` of two sizes.
NON_TENSOR_MODULES = frozenset({"math", "builtins", "operator", "_operator"})

# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------
# Functional norms: their weight and bias must match their input's dtype unless the weights are
# float32 (batch/layer/group norm accept low-precision input with float32 weights, not the reverse).
NORM_OPS = frozenset({"batch_norm", "instance_norm", "layer_norm", "group_norm", "rms_norm"})
# Functional norms that update the running statistics they are given, and the argument that says
# whether they do (while training).
RUNNING_STATS_FLAGS = {"batch_norm": "training", "instance_norm": "use_input_stats"}

# ---------------------------------------------------------------------------------------------
# Output dtypes of ops whose rule casts nothing (static dtype propagation)
# ---------------------------------------------------------------------------------------------
# ``x.float()``, ``x.long()``, ...: the dtype each conversion method returns.
CONVERSION_METHOD_DTYPES = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "int": torch.int32,
    "long": torch.int64,
    "short": torch.int16,
    "bool": torch.bool,
    "byte": torch.uint8,
    "char": torch.int8,
    "cfloat": torch.complex64,
    "cdouble": torch.complex128,
}
FLOATING_CONVERSION_METHODS = frozenset(
    method for method, dtype in CONVERSION_METHOD_DTYPES.items() if dtype.is_floating_point
)
# Ops whose result holds (some of) their tensor inputs' values unchanged, moved or cast: views,
# concatenation, copies and dtype conversions. A parameter read through them is read as it is
# (`amp_fx.passes.shared.decisions` asks which op finally computes with it).
VALUE_MOVING_OPS = (
    VIEW_OPS
    | frozenset(
        {"cat", "stack", "clone", "repeat", "tile", "to", "_to_copy", "type", "type_as", "expand_copy"}
    )
    | FLOATING_CONVERSION_METHODS
)
# ``x.type("torch.HalfTensor")``: the dtype of each tensor type string.
TENSOR_TYPE_DTYPES = {
    "torch.FloatTensor": torch.float32,
    "torch.HalfTensor": torch.float16,
    "torch.BFloat16Tensor": torch.bfloat16,
    "torch.DoubleTensor": torch.float64,
    "torch.LongTensor": torch.int64,
    "torch.IntTensor": torch.int32,
    "torch.BoolTensor": torch.bool,
}
# Ops that return bool.
BOOL_OPS = frozenset(
    {
        "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
        "isnan", "isinf", "isfinite", "isneginf", "isposinf", "isclose", "any", "all", "signbit",
        "isreal", "is_nonzero", "equal", "isin",
    }
)  # fmt: skip
# Ops that return int64 indices or counts.
INT64_OPS = frozenset(
    {
        "argmax",
        "argmin",
        "argsort",
        "nonzero",
        "count_nonzero",
        "bucketize",
        "searchsorted",
        "one_hot",
        "multinomial",
    }
)
# Ops returning (values, int64 indices); max/min only with a dim argument.
VALUES_INDICES_OPS = frozenset(
    {"topk", "sort", "kthvalue", "mode", "cummax", "cummin", "median", "max", "min"}
)
# ... of which these whatever their arguments.
ALWAYS_VALUES_INDICES_OPS = frozenset({"topk", "sort", "kthvalue", "mode", "cummax", "cummin"})
# Ops returning two tensors of their input's dtype.
PAIR_OPS = frozenset({"var_mean", "std_mean", "aminmax"})
# Ops returning a sequence, of a length known only at run time, of tensors of their input's dtype.
SPLIT_OPS = frozenset(
    {"split", "chunk", "unbind", "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit"}
)
# Reductions that accumulate integer and bool inputs in int64.
INT64_ACCUMULATING_OPS = frozenset({"sum", "prod", "cumsum", "cumprod", "nansum"})
# Ops whose output has their first argument's dtype whatever the other arguments' (indices, masks,
# norm weights): torch's type promotion over all of them would be wrong.
FIRST_ARGUMENT_DTYPE_OPS = frozenset(
    {
        "embedding_bag", "batch_norm", "instance_norm", "layer_norm", "group_norm", "rms_norm",
        "local_response_norm", "index_select", "gather", "take", "take_along_dim", "masked_select",
        "masked_fill", "masked_scatter", "index_fill", "scatter", "scatter_reduce", "index_add",
        "index_copy", "narrow", "select", "roll", "pad", "repeat_interleave", "dropout",
    }
)  # fmt: skip
# torch's tensor factories (functions, not names): their dtype comes from their arguments or the
# default dtype, never from type promotion.
FACTORY_FUNCTIONS = {
    torch.zeros, torch.ones, torch.empty, torch.rand, torch.randn, torch.eye, torch.linspace, torch.logspace,
    torch.full, torch.arange, torch.randint, torch.randperm, torch.tensor, torch.as_tensor, torch.zeros_like,
    torch.ones_like, torch.empty_like, torch.rand_like, torch.randn_like, torch.full_like, torch.randint_like,
}  # fmt: skip
