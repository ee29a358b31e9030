"""Launching the distributed tests' ranks: spawned processes, a file-store process group, results
saved per rank, and the small model the DDP and FSDP tests train.

A test module defines ``worker(rank, *args, out_dir)``, which joins the group with
`file_store_process_group`, computes and ends with `save_rank_result`; the test runs it with
`run_ranks` and compares the ranks' results with one process::

    def worker(rank: int, out_dir: str) -> None:
        torch.set_num_threads(1)
        with file_store_process_group("gloo", rank, 2, out_dir):
            save_rank_result({"rank": rank}, out_dir, rank)

    results = run_ranks(worker, tmp_path, world_size=2, timeout_s=60)
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

IN_FEATURES, HIDDEN, CLASSES = 16, 32, 4
# How long a rank waits in a collective for the others before it raises.
COLLECTIVE_TIMEOUT_S = 60


def make_model() -> nn.Module:
    """The model the DDP and FSDP tests train: seeded, so every rank and the reference start equal."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.LayerNorm(HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


@contextlib.contextmanager
def file_store_process_group(backend: str, rank: int, world_size: int, out_dir: str | Path) -> Iterator[None]:
    """The default process group for this rank, destroyed on exit. Its store is a file in the
    test's own directory: no port to pick, release and race for."""
    dist.init_process_group(
        backend,
        init_method=Path(out_dir, "store").as_uri(),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _result_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir, f"rank{rank}.pt")


def save_rank_result(result: Any, out_dir: str | Path, rank: int) -> None:
    """What this rank computed, for `run_ranks` to return (tensors and plain Python values)."""
    torch.save(result, _result_path(out_dir, rank))


def _run_rank(rank: int, worker: Callable[..., None], args: tuple, out_dir: str) -> None:
    """One rank's process: the worker, then an exit that skips the interpreter's teardown.

    A rank of CI's (torch 2.14.1, gloo) once died of SIGABRT, "terminate called without an active
    exception", with no Python error: a C++ thread object destroyed unjoined, which is what torch's
    exit-time destruction of gloo's threads does when it goes wrong. A finished rank has destroyed
    its group and saved its result, so it leaves with ``os._exit``; an abort anywhere else prints
    every thread's Python stack (faulthandler) into the test's captured stderr."""
    faulthandler.enable()
    worker(rank, *args, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    worker: Callable[..., None], out_dir: Path, *, world_size: int, timeout_s: float, args: tuple = ()
) -> list[Any]:
    """Runs ``worker(rank, *args, str(out_dir))`` in ``world_size`` spawned processes; waits at most
    ``timeout_s`` (then raises TimeoutError), kills any process left, and returns each rank's
    `save_rank_result`. A worker that raises makes this raise torch's ProcessRaisedException."""
    context = mp.start_processes(
        _run_rank, args=(worker, args, str(out_dir)), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{worker.__module__}.{worker.__qualname__} did not finish on {world_size} ranks "
                    f"within {timeout_s} s"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(_result_path(out_dir, r), weights_only=True) for r in range(world_size)]
