"""Pointer tables: how one kernel launch reaches many tensors of different sizes.

An optimizer step touches hundreds of tensors (291 for a 24-layer GPT), of sizes from 1 to 10^8
elements. One launch per tensor would cost hundreds of launches; copying everything into one flat
buffer would cost extra passes over memory. Instead, each launch gets two small int64 tables:

    tensor table [T, K + 1]   row i: the data pointers of tensor i's K operands (param, grad,
                              master, ...; 0 where absent), then tensor i's element count
    chunk table  [C, 2]       row c: (tensor index, first element) of the chunk program c updates

Tensor i is cut into ceil(numel_i / chunk_size) chunks of ``chunk_size`` elements (the last one
shorter), so the grid is C = sum_i ceil(numel_i / chunk_size) programs and every program does about
the same work, whatever the mix of sizes. A kernel loads its row, turns each pointer into a typed
pointer with ``.to(tl.pointer_type(tl.float16))`` (this also works under ``TRITON_INTERPRET=1``)
and walks its chunk in blocks.

A pointer loaded from memory carries no alignment information, so the compiler would issue one
narrow load per element. When every pointer in the table is a multiple of 16 bytes (the PyTorch
allocator returns 512-byte aligned blocks; only views at odd offsets break this), ``aligned`` is
True and the kernels tell the compiler so with ``tl.multiple_of``, which lets it issue 16-byte
vector loads. Chunk starts are multiples of ``chunk_size``, itself a multiple of 16 elements.

Tables are cached, keyed on the pointers and sizes they hold, so a steady-state training step,
whose tensors do not move, reuses them with no host-to-device copy. The key is the table's whole
content, so a cached table is always right for the tensors that produced the key.

Example:
    >>> import torch
    >>> a, b = torch.zeros(5), torch.zeros(3)
    >>> table = pointer_table([[a, b]], chunk_size=4)
    >>> table.chunks.tolist()
    [[0, 0], [0, 4], [1, 0]]
    >>> table.tensors[:, -1].tolist()
    [5, 3]
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton.language as tl
from torch import Tensor

logger = logging.getLogger(__name__)

ALIGNMENT_BYTES = 16
_CACHE_SIZE = 256


@dataclass(frozen=True)
class LaunchConfig:
    """How a kernel splits its work: elements per program (chunk) and per loop iteration (block)."""

    block_size: int
    chunk_size: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1) or self.block_size < 16:
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size ({self.chunk_size}) must be a multiple of block_size ({self.block_size})"
            )


@dataclass(frozen=True)
class PointerTable:
    """Device tables for one launch; see the module docstring for the layout."""

    tensors: Tensor  # int64 [T, K + 1]
    chunks: Tensor  # int64 [C, 2]
    num_chunks: int
    aligned: bool


class _LRU(OrderedDict):
    def lookup(self, key: tuple) -> object | None:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def store(self, key: tuple, value: object) -> None:
        self[key] = value
        if len(self) > _CACHE_SIZE:
            self.popitem(last=False)


# Chunk tables depend only on the sizes, pointer rows also on the addresses: kept apart, so that
# tensors that move (grads freed by zero_grad(set_to_none=True) and allocated elsewhere) rebuild
# only the small [T, K + 1] table, never the [C, 2] one (640k rows for 1.3B params in 2048-chunks).
_chunk_cache = _LRU()
_row_cache = _LRU()


def clear_cache() -> None:
    """Forget every cached table (they are rebuilt on the next launch)."""
    _chunk_cache.clear()
    _row_cache.clear()


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    if device.type != "cuda":
        return host.to(device)
    # A pinned source lets the copy run asynchronously: no host synchronization, also under
    # torch.cuda.set_sync_debug_mode("error").
    return host.pin_memory().to(device, non_blocking=True)


def _chunk_table(numels: tuple[int, ...], chunk_size: int, device: torch.device) -> tuple[Tensor, int]:
    key = (device, chunk_size, numels)
    cached = _chunk_cache.lookup(key)
    if cached is None:
        sizes = torch.tensor(numels, dtype=torch.int64)
        counts = (sizes + chunk_size - 1) // chunk_size
        tensor_index = torch.repeat_interleave(torch.arange(len(numels)), counts)
        first_chunk_of_tensor = torch.cumsum(counts, 0) - counts
        start = (torch.arange(len(tensor_index)) - first_chunk_of_tensor[tensor_index]) * chunk_size
        chunks = torch.stack([tensor_index, start], dim=1)
        cached = (_to_device(chunks, device), len(tensor_index))
        _chunk_cache.store(key, cached)
    return cached


def pointer_table(
    columns: Sequence[Sequence[Tensor | None]], chunk_size: int, scalar_columns: int = 0
) -> PointerTable:
    """Build (or fetch from the cache) the tables for tensors ``columns[k][i]``, operand k of tensor i.

    ``columns[0]`` must hold tensors (its sizes define the chunks); later columns may hold None for
    an absent operand (pointer 0). All tensors must be on one device and already validated (dense,
    same shape as ``columns[0][i]``), except the last ``scalar_columns`` columns: they point to one
    value per tensor (a per-parameter step offset), read once per program, so their alignment does
    not decide ``aligned``.
    """
    first = columns[0]
    if len(first) == 0:
        raise ValueError("pointer_table needs at least one tensor")
    device = first[0].device
    pointers = tuple(0 if t is None else t.data_ptr() for column in columns for t in column)
    numels = tuple(t.numel() for t in first)
    chunks, num_chunks = _chunk_table(numels, chunk_size, device)
    key = (device, len(columns), scalar_columns, pointers, numels)
    rows = _row_cache.lookup(key)
    if rows is None:
        num_tensors = len(first)
        host_rows = torch.tensor(pointers + numels, dtype=torch.int64).view(len(columns) + 1, num_tensors)
        vector_pointers = pointers[: (len(columns) - scalar_columns) * num_tensors]
        aligned = all(p % ALIGNMENT_BYTES == 0 for p in vector_pointers)
        if not aligned:
            logger.info(
                "pointer table for %d tensors is not 16-byte aligned: kernels use narrow loads", num_tensors
            )
        rows = (_to_device(host_rows.t().contiguous(), device), aligned)
        _row_cache.store(key, rows)
    return PointerTable(tensors=rows[0], chunks=chunks, num_chunks=num_chunks, aligned=rows[1])


def group_by_dtype(*keys: Sequence[object]) -> dict[tuple, list[int]]:
    """Indices of tensors grouped by the tuple (keys[0][i], keys[1][i], ...), in first-seen order.

    One launch serves one group, since the element types are compile-time constants of a kernel.

    Example:
        >>> group_by_dtype([torch.float16, torch.float32, torch.float16])
        {(torch.float16,): [0, 2], (torch.float32,): [1]}
    """
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*keys, strict=True)):
        groups.setdefault(key, []).append(i)
    return groups


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton element type for a torch dtype (fp16, bf16, fp32)."""
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]
