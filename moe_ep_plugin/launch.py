"""Start N local ranks (one process each) when not under torchrun, or join torchrun's ranks.

Used by the trainers' command lines and by the multi-process tests: one mechanism for both.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """Initialise the default group from the environment (torchrun or :func:`spawn`); returns (rank, world)."""
    backend = backend or default_backend()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def _entry(local_rank: int, world: int, port: int, backend: str, timeout_s: float, fn: Callable, args: tuple,
           errors: Any) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        init_process_group(backend, timeout_s)
        fn(*args)
    except BaseException:  # report every rank's failure to the parent, then fail this process
        errors.put((local_rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, nprocs: int, args: tuple = (), backend: str | None = None, timeout_s: float = 120.0) -> None:
    """Run ``fn(*args)`` on ``nprocs`` fresh local processes joined in one default process group.

    Raises ``RuntimeError`` carrying the traceback of every rank that failed.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, nprocs, port, backend or default_backend(), timeout_s, fn, args, errors),
                         daemon=False) for r in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or any(p.exitcode != 0 for p in procs):
        details = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures))
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"{len(failures)} of {nprocs} ranks failed (exit codes {codes})\n{details}")


def launch(fn: Callable, nprocs: int, args: tuple = (), backend: str | None = None, timeout_s: float = 120.0) -> None:
    """Run ``fn(*args)`` on every rank: in this process under torchrun, else on ``nprocs`` spawned ones."""
    if under_torchrun():
        init_process_group(backend, timeout_s)
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
    else:
        spawn(fn, nprocs, args, backend, timeout_s)
