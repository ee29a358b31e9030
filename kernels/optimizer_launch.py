"""How the Triton optimizer kernels (``adam``, ``sgd``) are launched: once per dtype group.

A kernel's element types are compile-time constants, so the tensors of one call are grouped by
(param dtype, grad dtype, has master) and each group is one launch over its pointer table
(``amp_fx.kernels.pointer_table``), never one launch per tensor. The grouping, the tables and the
arguments every optimizer kernel takes are the same for all of them: `launch_per_dtype_group`
does that part, and each family's wrapper passes only its own: its ``@triton.jit`` kernel, its
state tensors and its hyperparameters.

What this asks of a kernel: its parameters start with

    tensor_table, chunk_table           int64 pointer tables; a row holds param, grad, master (0:
                                        none), each state (0: none), step_offset (0: none), numel
    step_ptr                            float32 [1]: the steps already taken
    grad_multiplier_ptr, found_inf_ptr  float32 [1]: read only if HAS_GRAD_MULTIPLIER /
                                        HAS_FOUND_INF (else ``step`` stands in)

and it has the constexprs ``PARAM_DTYPE``, ``GRAD_DTYPE``, ``HAS_MASTER``, ``HAS_GRAD_MULTIPLIER``,
``HAS_FOUND_INF``, ``HAS_STEP_OFFSETS``, ``ALIGNED``, ``CHUNK_SIZE`` and ``BLOCK_SIZE``, all set
here; its other parameters are the wrapper's ``arguments``, by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from amp_fx.kernels.devices import on_device
from amp_fx.kernels.pointer_table import LaunchConfig, group_by_dtype, pointer_table, triton_dtype

__all__ = ["launch_per_dtype_group"]


def launch_per_dtype_group(
    kernel: Any,
    launch: LaunchConfig,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    states: Sequence[Sequence[Tensor] | None],
    step: Tensor,
    *,
    grad_multiplier: Tensor | None,
    found_inf: Tensor | None,
    step_offsets: Sequence[Tensor] | None,
    arguments: Mapping[str, Any],
) -> None:
    """Launch ``kernel`` once per (param dtype, grad dtype, has master) group of ``params``, on
    ``step``'s device, with ``launch``'s chunk and block sizes.

    ``states`` holds one list per state operand of the kernel, in its table's column order (Adam's
    ``exp_avgs, exp_avg_sqs``); None for an operand this call leaves out (SGD's buffers without
    momentum: pointer 0). ``step_offsets`` None: the kernel reads none. ``arguments`` are the
    kernel's own scalars and constexprs. The tensors must be checked already
    (``amp_fx.kernels.arguments.check_update``).

    Example:
        >>> launch_per_dtype_group(_sgd_kernel, LAUNCH, params, grads, masters, [buffers], step,
        ...     grad_multiplier=None, found_inf=None, step_offsets=None,
        ...     arguments={"lr": 0.1, "momentum": 0.9, ...})  # doctest: +SKIP
    """
    absent = [None] * len(params)
    masters = absent if masters is None else masters
    columns = [
        params,
        grads,
        masters,
        *(absent if state is None else state for state in states),
        absent if step_offsets is None else step_offsets,
    ]
    groups = group_by_dtype(
        [p.dtype for p in params], [g.dtype for g in grads], [m is not None for m in masters]
    )
    with on_device(step.device):
        for (param_dtype, grad_dtype, has_master), indices in groups.items():
            # The step offsets are the one scalar column: one value per tensor, read once per program.
            table = pointer_table(
                [[column[i] for i in indices] for column in columns], launch.chunk_size, scalar_columns=1
            )
            if table.num_chunks == 0:
                continue
            kernel[(table.num_chunks,)](
                table.tensors,
                table.chunks,
                step,
                step if grad_multiplier is None else grad_multiplier,
                step if found_inf is None else found_inf,
                **arguments,
                PARAM_DTYPE=triton_dtype(param_dtype),
                GRAD_DTYPE=triton_dtype(grad_dtype),
                HAS_MASTER=has_master,
                HAS_GRAD_MULTIPLIER=grad_multiplier is not None,
                HAS_FOUND_INF=found_inf is not None,
                HAS_STEP_OFFSETS=step_offsets is not None,
                ALIGNED=table.aligned,
                CHUNK_SIZE=launch.chunk_size,
                BLOCK_SIZE=launch.block_size,
                num_warps=launch.num_warps,
            )
