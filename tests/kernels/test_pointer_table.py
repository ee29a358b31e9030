"""Pointer tables: layout, chunking, alignment flag and caching."""

from __future__ import annotations

import pytest
import torch

from amp_fx.kernels.pointer_table import LaunchConfig, group_by_dtype, pointer_table


def test_layout_and_chunks() -> None:
    a, b, c = torch.zeros(70), torch.zeros(1), torch.zeros(32)
    table = pointer_table([[a, b, c], [a, None, c]], chunk_size=32)
    assert table.tensors.tolist() == [
        [a.data_ptr(), a.data_ptr(), 70],
        [b.data_ptr(), 0, 1],
        [c.data_ptr(), c.data_ptr(), 32],
    ]
    assert table.chunks.tolist() == [[0, 0], [0, 32], [0, 64], [1, 0], [2, 0]]
    assert table.num_chunks == 5
    assert table.aligned


def test_empty_tensors_get_no_chunks() -> None:
    table = pointer_table([[torch.zeros(0), torch.zeros(3)]], chunk_size=16)
    assert table.num_chunks == 1
    assert table.chunks.tolist() == [[1, 0]]


def test_cache_reuses_tables_while_pointers_repeat() -> None:
    tensors = [torch.zeros(5), torch.zeros(9)]
    first = pointer_table([tensors], chunk_size=16)
    again = pointer_table([tensors], chunk_size=16)
    assert again.tensors is first.tensors and again.chunks is first.chunks
    assert pointer_table([tensors], chunk_size=32).chunks is not first.chunks


def test_moved_tensors_rebuild_only_the_pointer_rows() -> None:
    tensors = [torch.zeros(6), torch.zeros(10)]
    first = pointer_table([tensors], chunk_size=4)
    moved = [tensors[0], torch.zeros(10)]
    table = pointer_table([moved], chunk_size=4)
    assert table.chunks is first.chunks  # same sizes: the chunk table is shared
    assert table.tensors[1, 0].item() == moved[1].data_ptr()
    assert first.tensors[1, 0].item() == tensors[1].data_ptr()


def test_unaligned_view_clears_the_aligned_flag() -> None:
    base = torch.zeros(20)
    assert not pointer_table([[base[1:]]], chunk_size=16).aligned
    assert pointer_table([[base[4:]]], chunk_size=16).aligned


def test_group_by_dtype_keeps_first_seen_order() -> None:
    groups = group_by_dtype([torch.bfloat16, torch.float16, torch.bfloat16], [True, True, False])
    assert groups == {(torch.bfloat16, True): [0], (torch.float16, True): [1], (torch.bfloat16, False): [2]}


def test_launch_config_is_validated() -> None:
    with pytest.raises(ValueError, match="power of two"):
        LaunchConfig(block_size=24, chunk_size=48, num_warps=1)
    with pytest.raises(ValueError, match="multiple of block_size"):
        LaunchConfig(block_size=16, chunk_size=40, num_warps=1)
